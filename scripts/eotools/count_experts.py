# SPDX-License-Identifier: Apache-2.0
"""Command line of scripts/count-experts: count router picks per data set.

Sources:
  synthetic  reads a make-test-model checkpoint's planted routers (exact for those models:
             their picks are a known function of the tokens) and needs no GPU.
  server     drives a running vLLM server (OpenAI completions API) started with the
             series' counting hook, VLLM_EXPERT_COUNT_FILE=PATH, and reads the hook's
             file(s) before and after each data set: the set's counts are the difference.
             This machine must see PATH (same host or a shared volume): pass it as
             --counts-file. To get a fresh snapshot the tool writes a nonce to
             PATH.request; every rank's writer then rewrites its file (PATH, or
             PATH-stem.ppN/.dpN.json per rank) with that nonce. Serve nothing else while
             counting, and disable prefix caching (a cached prefix is not prefilled, so
             it is not counted).
  engine     starts vLLM offline in this process (vllm.LLM, with the series applied on
             this machine) with the counting hook on, prefix caching off and any
             --engine-arg, and counts the same way as server; the hook's files go to
             --counts-file (default OUT_DIR/.engine-counts/counts.json).

Before the first data set one short request starts the hook's writer (it starts at the
first real step of a server, after CUDA graph capture); it is not in any set's counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time
import urllib.error
import urllib.request
import uuid

import numpy as np

from .coldset import model_identity
from .counts import Counts, CountsError, load_counts, merge_ranks, subtract
from .devtools import dev_module

EPILOG = """exit codes: 0 counted; 1 bad input (missing or empty data set, unknown source,
a model that is not a make-test-model checkpoint for --source synthetic, a server that does
not answer or whose hook does not write PATH); 2 usage."""


def read_dataset(path: pathlib.Path) -> list[str]:
    """Sequences of a data set: JSONL rows with a "prompt" or "text" field, or a text file
    whose blank-line-separated paragraphs are one sequence each."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        seqs = [r.get("prompt") or r.get("text") or "" for r in rows]
    else:
        seqs = [p.strip() for p in text.split("\n\n")]
    return [s for s in seqs if s.strip()]


def synthetic_counts(
    model_dir: pathlib.Path, name: str, kind: str, path: pathlib.Path, decode_tokens: int
) -> Counts:
    """Picks of the planted routers over the data set's prompts (prefill) and over the
    model's greedy continuation of each (decode steps)."""
    plant = dev_module("testmodel.plant", "--source synthetic")
    from tokenizers import Tokenizer

    plan = plant.load_plan(model_dir)  # --source synthetic counts only make-test-model checkpoints
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    seqs = read_dataset(path)
    if not seqs:
        raise ValueError(f"data set {name!r} ({path}) holds no text")
    g = plan.geometry
    prefill = np.zeros((g.num_layers, g.num_experts), np.int64)
    decode = np.zeros_like(prefill)
    n_prefill = n_decode = 0
    for text in seqs:
        prompt = tok.encode(text).ids
        out, cur = [], prompt[-1]
        for _ in range(decode_tokens):
            cur = int(plan.successor[cur]) if plan.successor[cur] >= 0 else cur
            out.append(cur)
        seq = np.array(prompt + out)
        p = len(prompt)
        for layer in range(g.num_layers):
            picks = plan.router_topk(layer, seq[: p + max(len(out) - 1, 0)])
            np.add.at(prefill[layer], picks[:p].ravel(), 1)
            np.add.at(decode[layer], picks[p:].ravel(), 1)
        n_prefill += p
        n_decode += max(len(out) - 1, 0)
    try:  # a data set shipped with the model: name it relative to the model
        source = f"{path.resolve().relative_to(model_dir.resolve())} of {model_dir.name}"
    except ValueError:
        source = str(path)
    return Counts(
        model=model_identity(model_dir),
        data={
            "name": name,
            "kind": kind,
            "source": source,
            "sequences": len(seqs),
            "tokens": {"prefill": n_prefill, "decode": n_decode},
            "decode_tokens_per_sequence": decode_tokens,
        },
        prefill=prefill,
        decode=decode,
        top_k=g.top_k,
        tool="scripts/count-experts --source synthetic (planted routers)",
    )


class HookFiles:
    """The counting hook's files as this machine sees them: PATH itself (one rank) or
    PATH-stem[.dpN][.ppN]suffix (several ranks)."""

    def __init__(self, path: pathlib.Path, timeout_s: float = 120.0, poll_s: float = 0.2):
        self.path = pathlib.Path(path)
        self.timeout_s, self.poll_s = timeout_s, poll_s
        stem, suffix = self.path.stem, self.path.suffix
        self._rank_name = re.compile(
            re.escape(stem) + r"(\.dp\d+)?(\.pp\d+)?" + re.escape(suffix) + "$"
        )

    @property
    def request_path(self) -> pathlib.Path:
        return self.path.with_name(self.path.name + ".request")

    def rank_files(self) -> list[pathlib.Path]:
        if not self.path.parent.is_dir():
            return []
        return sorted(p for p in self.path.parent.iterdir() if self._rank_name.match(p.name))

    def _answered(self, nonce: str) -> list[Counts] | None:
        parts = []
        for p in self.rank_files():
            try:
                c = load_counts(p)
            except CountsError:
                return None  # being replaced right now: look again
            if (c.extra.get("snapshot") or {}).get("request") == nonce:
                parts.append(c)
        if not parts:
            return None
        rank = parts[0].extra.get("rank") or {}
        want = int(rank.get("pp_size", 1)) * int(rank.get("dp_size", 1))
        return parts if len(parts) == want else None

    def snapshot(self) -> Counts:
        """Ask every rank to write now; the merged counts once all have answered."""
        nonce = uuid.uuid4().hex
        tmp = self.request_path.with_name(self.request_path.name + ".tmp")
        try:
            tmp.write_text(nonce + "\n")
            tmp.replace(self.request_path)
        except OSError as e:
            raise CountsError(
                f"cannot ask the counting hook for a snapshot ({e}): does this machine see "
                f"the server's VLLM_EXPERT_COUNT_FILE={self.path}?"
            ) from e
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            parts = self._answered(nonce)
            if parts is not None:
                return merge_ranks(parts)
            time.sleep(self.poll_s)
        raise CountsError(
            f"the counting hook did not answer within {self.timeout_s:.0f} s: is the server "
            f"running with VLLM_EXPERT_COUNT_FILE={self.path}, and does this machine see "
            "that path (same host or a shared volume)?"
        )


class CompletionsClient:
    """The two calls of the OpenAI API that counting needs, with the standard library. A
    server started with an API key gets it from `api_key`, by default VLLM_API_KEY (the
    variable the server and the compose files read)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = os.environ.get("VLLM_API_KEY", "") if api_key is None else api_key
        self.model = model or self.models()[0]

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            hint = ""
            if e.code == 401:
                hint = (
                    "; the server wants its API key: set VLLM_API_KEY to it"
                    if not self.api_key
                    else "; VLLM_API_KEY is not the server's key"
                )
            raise CountsError(f"server {self.url}{path}: {e}{hint}") from e
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise CountsError(f"server {self.url}{path}: {e}") from e

    def models(self) -> list[str]:
        ids = [m["id"] for m in self._call("/v1/models").get("data", [])]
        if not ids:
            raise CountsError(f"server {self.url} serves no model")
        return ids

    def complete(self, prompt: str, max_tokens: int) -> dict:
        out = self._call(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,  # vLLM: exactly max_tokens decode steps
            },
        )
        return out.get("usage") or {}


class EngineClient:
    """An offline vLLM engine in this process with the counting hook on: the calls of
    CompletionsClient, and a batched one."""

    def __init__(
        self,
        model: str,
        counts_file: pathlib.Path,
        engine_args: dict,
        llm_factory=None,
        params_factory=None,
    ):
        os.environ["VLLM_EXPERT_COUNT_FILE"] = str(counts_file)  # before vLLM starts
        # the engine core in this process: its errors reach this tool's output, and its
        # counters are written when the tool exits (as gpu_harness' engines run)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.url = f"offline engine ({model})"
        self.model = model
        if llm_factory is None or params_factory is None:
            try:
                from vllm import LLM, SamplingParams
            except ImportError as e:
                raise CountsError(
                    "--source engine needs vLLM with the series applied on this machine "
                    f"({e}); or count a running server with --source server"
                ) from e
            llm_factory, params_factory = LLM, SamplingParams
        self._params = params_factory
        self.llm = llm_factory(model=model, **{"enable_prefix_caching": False, **engine_args})

    def complete(self, prompt: str, max_tokens: int) -> dict:
        return self.complete_all([prompt], max_tokens)

    def complete_all(self, prompts: list[str], max_tokens: int) -> dict:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return {
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "completion_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }


def server_counts(
    client: CompletionsClient,
    hook: HookFiles,
    name: str,
    kind: str,
    path: pathlib.Path,
    mode: str,
    decode_tokens: int,
) -> Counts:
    """Counts of one data set on a running server: the hook's snapshot after the set
    minus the one before it."""
    seqs = read_dataset(path)
    if not seqs:
        raise ValueError(f"data set {name!r} ({path}) holds no text")
    max_tokens = 1 if mode == "prefill" else decode_tokens
    before = hook.snapshot()
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    if hasattr(client, "complete_all"):  # an offline engine: one batch
        usages = [client.complete_all(seqs, max_tokens)]
    else:
        usages = [client.complete(text, max_tokens) for text in seqs]
    for u in usages:
        for k in usage:
            usage[k] += int(u.get(k, 0))
    after = hook.snapshot()
    diff = subtract(after, before)
    if diff.tokens() == 0 or int(diff.total.sum()) == 0:
        raise ValueError(
            f"data set {name!r}: the hook counted no tokens; is {hook.path} the file of "
            f"the server at {client.url}?"
        )
    source = "engine" if isinstance(client, EngineClient) else "server"
    diff.data = {
        "name": name,
        "kind": kind,
        "source": str(path),
        "sequences": len(seqs),
        "tokens": diff.data["tokens"],
        "mode": mode,
        "decode_tokens_per_sequence": max_tokens if mode == "generate" else 0,
        "api_usage": usage,
        source: {"url": client.url, "served_model": client.model},
    }
    diff.tool = f"scripts/count-experts --source {source} ({mode}; vLLM counting hook)"
    for k in ("ranks", "snapshot"):
        diff.extra.pop(k, None)
    return diff


def engine_args(pairs: list[str]) -> dict:
    """--engine-arg KEY=VALUE pairs: VALUE as JSON where it parses, else a string."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg takes KEY=VALUE, not {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def make_engine_client(model: str, counts_file: pathlib.Path, pairs: list[str]) -> EngineClient:
    return EngineClient(model, counts_file, engine_args(pairs))


class ExitWith(Exception):
    """A one-line `error:` message for stderr and the exit status that main returns."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.message = message
        self.code = code

    def report(self) -> int:
        """Print the message as one `error:` line on stderr; the exit status to return."""
        print(f"error: {self.message}", file=sys.stderr)
        return self.code


def parser() -> argparse.ArgumentParser:
    """count-experts' command line."""
    ap = argparse.ArgumentParser(
        prog="count-experts",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        type=pathlib.Path,
        help="--source synthetic: the make-test-model checkpoint; --source server: the "
        "served model name (default: the server's first)",
    )
    ap.add_argument(
        "--data",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a named data set (JSONL with 'prompt' or 'text', or plain text "
        "with blank-line-separated sequences); one data kind per set; repeat",
    )
    ap.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="NAME=KIND",
        help="the data kind of a set (default: its name)",
    )
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=128,
        help="tokens to generate after each sequence (its decode picks)",
    )
    ap.add_argument("--source", choices=("synthetic", "server", "engine"), default="synthetic")
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--source engine: a vllm.LLM keyword argument (VALUE as JSON, else a string), "
        "e.g. tensor_parallel_size=2; repeat",
    )
    ap.add_argument(
        "--url",
        default="http://localhost:8000",
        help="--source server (a server with an API key: set VLLM_API_KEY to it)",
    )
    ap.add_argument(
        "--counts-file",
        type=pathlib.Path,
        help="--source server: the server's VLLM_EXPERT_COUNT_FILE as seen from here",
    )
    ap.add_argument(
        "--mode",
        choices=("generate", "prefill"),
        default="generate",
        help="--source server: generate --decode-tokens per sequence, or prefill only "
        "(max_tokens=1; feed generated text back to count its decode picks)",
    )
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the hook's file"
    )
    ap.add_argument(
        "--out-dir", type=pathlib.Path, required=True, help="writes <NAME>.json per data set"
    )
    return ap


def data_sets(data: list[str]) -> list[tuple[str, pathlib.Path]]:
    """The --data NAME=PATH values as (name, path), in the order given."""
    try:
        return [(n, pathlib.Path(p)) for n, p in (d.split("=", 1) for d in data)]
    except ValueError:
        raise ExitWith("--data takes NAME=PATH", 2) from None


def check_source_options(args: argparse.Namespace) -> None:
    """Each source's required options, checked before anything starts (usage errors)."""
    if args.source == "synthetic" and args.model is None:
        raise ExitWith("--source synthetic needs --model", 2)
    if args.source == "server" and args.counts_file is None:
        raise ExitWith("--source server needs --counts-file", 2)
    if args.source == "engine" and args.model is None:
        raise ExitWith("--source engine needs --model (a checkpoint folder)", 2)


def open_source(
    args: argparse.Namespace,
) -> tuple[CompletionsClient | EngineClient | None, HookFiles | None]:
    """The client and hook files of --source server or engine, their hook's writer started
    by one warm-up request (counted in no set); (None, None) for --source synthetic."""
    if args.source not in ("server", "engine"):
        return None, None
    counts_file = args.counts_file or args.out_dir / ".engine-counts" / "counts.json"
    try:
        if args.source == "server":
            client = CompletionsClient(args.url, str(args.model) if args.model else None)
        else:
            counts_file.parent.mkdir(parents=True, exist_ok=True)
            client = make_engine_client(str(args.model), counts_file, args.engine_arg)
        hook = HookFiles(counts_file, timeout_s=args.timeout)
        client.complete("warm-up", 1)  # starts the hook's writer; counted in no set
    except (CountsError, ValueError) as e:
        raise ExitWith(str(e), 1) from e
    return client, hook


def count_set(
    args: argparse.Namespace,
    client: CompletionsClient | EngineClient | None,
    hook: HookFiles | None,
    name: str,
    kind: str,
    path: pathlib.Path,
) -> Counts:
    """One data set's counts from the chosen source."""
    if not path.is_file():
        raise ExitWith(f"data set {name!r}: no file {path}", 1)
    try:
        if args.source in ("server", "engine"):
            return server_counts(client, hook, name, kind, path, args.mode, args.decode_tokens)
        return synthetic_counts(args.model, name, kind, path, args.decode_tokens)
    except (ValueError, CountsError) as e:
        raise ExitWith(str(e), 1) from e


def count_sets(
    args: argparse.Namespace,
    client: CompletionsClient | EngineClient | None,
    hook: HookFiles | None,
    sets: list[tuple[str, pathlib.Path]],
    kinds: dict[str, str],
) -> int:
    """Count every data set in turn and write OUT_DIR/<NAME>.json, with a progress bar
    (tqdm) or, without tqdm, a line per set; the exit status. A set that fails is reported
    while its progress bar is still open, and ends the counting."""
    try:
        from tqdm import tqdm
    except ImportError:  # plain progress lines
        tqdm = None
    items = tqdm(sets, desc="counting", unit="set") if tqdm else sets
    for name, path in items:
        try:
            counts = count_set(args, client, hook, name, kinds.get(name, name), path)
        except ExitWith as e:
            return e.report()
        counts.save(args.out_dir / f"{name}.json")
        if not tqdm:
            print(f"counted {name}: {counts.tokens()} tokens", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    kinds = dict(k.split("=", 1) for k in args.kind)
    try:
        sets = data_sets(args.data)
        check_source_options(args)
        client, hook = open_source(args)
    except ExitWith as e:
        return e.report()
    return count_sets(args, client, hook, sets, kinds)
