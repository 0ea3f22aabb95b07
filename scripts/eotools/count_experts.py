# SPDX-License-Identifier: Apache-2.0
"""Command line of scripts/count-experts: count router picks per data set.

Sources: `synthetic` reads a make-test-model checkpoint's planted routers (exact for those
models: their picks are a known function of the tokens, checked against vLLM's own record on
a GPU) and needs no GPU. Counting a real model on a running server or an offline engine needs
the counting hook of the series, which is not written yet.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from .coldset import model_identity
from .counts import Counts

EPILOG = """exit codes: 0 counted; 1 bad input (missing or empty data set, unknown source,
a model that is not a make-test-model checkpoint for --source synthetic); 2 usage."""


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
    from tokenizers import Tokenizer

    from .testmodel.plant import load_plan

    plan = load_plan(model_dir)  # --source synthetic counts only make-test-model checkpoints
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="count-experts",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", type=pathlib.Path, required=True)
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
    ap.add_argument("--source", choices=("synthetic",), default="synthetic")
    ap.add_argument(
        "--out-dir", type=pathlib.Path, required=True, help="writes <NAME>.json per data set"
    )
    args = ap.parse_args(argv)
    kinds = dict(k.split("=", 1) for k in args.kind)
    try:
        sets = [(n, pathlib.Path(p)) for n, p in (d.split("=", 1) for d in args.data)]
    except ValueError:
        print("error: --data takes NAME=PATH", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm
    except ImportError:  # plain progress lines
        tqdm = None
    items = tqdm(sets, desc="counting", unit="set") if tqdm else sets
    for name, path in items:
        if not path.is_file():
            print(f"error: data set {name!r}: no file {path}", file=sys.stderr)
            return 1
        try:
            counts = synthetic_counts(
                args.model, name, kinds.get(name, name), path, args.decode_tokens
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        counts.save(args.out_dir / f"{name}.json")
        if not tqdm:
            print(f"counted {name}: {counts.tokens()} tokens", file=sys.stderr)
    return 0
