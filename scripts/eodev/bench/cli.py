# SPDX-License-Identifier: Apache-2.0
"""Benchmark one OpenAI-compatible server (docs/benchmarks.md), or merge several servers' results.

    scripts/bench --url http://localhost:8000 --config offload-02 \\
        --synthetic-model /models/synth --out bench/results/NAME-offload-02.json
    scripts/bench --merge a.json b.json ... --out bench/results/NAME.json

Every request streams /v1/completions (temperature 0, ignore_eos, fixed seed and max_tokens)
and counts tokens from the token ids it streams back (vLLM `return_token_ids`), or from logprob
entries where a server sends no ids (the JSON says which). TTFT = t1 - t0, TPOT =
(tN - t1) / (N - 1), decode speed = (N - 1) / (tN - t1), ITL = gaps between consecutive
tokens, with t_i the arrival time of the chunk carrying token i. Each (workload, streams) pair
gets one warm-up repeat and --repeats measured repeats; /metrics is scraped before and after
each measured repeat (counter differences, gauge after-values). A server started with an API
key gets it from VLLM_API_KEY (`Authorization: Bearer KEY` on every request).

Output: the suite JSON (project format: runs with every repeat and every raw request record),
a markdown table (.md) and a plot (.png) next to it. --merge combines the suite files of
several servers (one per --config) into one, with ratios against `unpatched`.

Exit status: 0 ok, 1 a request failed (the results are still written), 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import shlex
import sys
import time
import urllib.error
import urllib.request
import uuid

import aiohttp
from tqdm import tqdm

from ..nvsmi import gpu_name
from . import client, prom, report
from . import metrics as m
from .workloads import WORKLOADS, FilePrompts, PromptSource, SyntheticPrompts, requests


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return vals


def _workloads(text: str) -> list[str]:
    vals = [x for x in text.split(",") if x]
    bad = [x for x in vals if x not in WORKLOADS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {bad}; choose from {WORKLOADS}")
    return vals


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", help="server base URL, e.g. http://localhost:8000")
    ap.add_argument("--config", choices=report.CONFIGS, help="the server's configuration")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="suite JSON to write")
    ap.add_argument(
        "--merge",
        type=pathlib.Path,
        nargs="+",
        metavar="JSON",
        help="merge these suite files into --out (no server needed)",
    )
    src = ap.add_argument_group("prompts (one of)")
    src.add_argument(
        "--prompts",
        type=pathlib.Path,
        help=".jsonl ({'prompt': text or token ids, 'domain': ...} per line) or "
        "a text file (one prompt per line)",
    )
    src.add_argument(
        "--synthetic-model",
        type=pathlib.Path,
        help="a make-test-model checkpoint: held-out conversations of its domains",
    )
    ap.add_argument("--model", help="model name for the API (default: first of /v1/models)")
    ap.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOADS),
        help="comma-separated, of fresh,repeat,long (default: all)",
    )
    ap.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 2],
        help="concurrent streams, comma-separated (default 1,2)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats (>= 3; default 3)")
    ap.add_argument(
        "--per-domain",
        type=int,
        default=2,
        help="requests per domain per repeat of fresh and repeat (default 2)",
    )
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per request (fixed)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=256,
        help="synthetic prompt length in tokens (default 256)",
    )
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=8192,
        help="tokens of the long prompt (8k-32k; default 8192)",
    )
    ap.add_argument(
        "--long-max-tokens",
        type=int,
        default=16,
        help="tokens generated after the long prompt (default 16)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--count-via",
        choices=("auto", *client.COUNT_MODES),
        default="auto",
        help="how tokens are counted (auto: token_ids if the server streams them)",
    )
    ap.add_argument(
        "--no-cache-salt",
        action="store_true",
        help="do not send cache_salt with long prompts (servers without it)",
    )
    ap.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    ap.add_argument(
        "--host-fraction",
        type=float,
        help="share of routed expert bytes on host (default: from /metrics gauges)",
    )
    ap.add_argument(
        "--startup-s", type=float, help="server start-up time, measured by its launcher"
    )
    ap.add_argument("--peak-vram-gib", type=float, help="peak VRAM, measured by the launcher")
    ap.add_argument("--peak-host-gib", type=float, help="peak host memory, from the launcher")
    ap.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for /health first",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, s")
    ap.add_argument("--suite", default="bench", help="suite name in the JSON")
    ap.add_argument("--gpu", help="GPU name for the JSON (default: nvidia-smi here)")
    ap.add_argument("--allow-few-repeats", action="store_true", help=argparse.SUPPRESS)
    return ap


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.merge:
        return
    if not args.url or not args.config:
        ap.error("--url and --config are needed (or --merge)")
    if (args.prompts is None) == (args.synthetic_model is None):
        ap.error("give exactly one of --prompts and --synthetic-model")
    if args.repeats < 3 and not args.allow_few_repeats:
        ap.error("--repeats must be at least 3 (docs/benchmarks.md)")
    if args.max_tokens < 2 or args.long_max_tokens < 2:
        ap.error("--max-tokens and --long-max-tokens must be >= 2 (TPOT needs two tokens)")
    if args.per_domain < 1 or args.long_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--per-domain, --long-tokens and --prompt-tokens must be positive")


def _wait_ready(url: str, seconds: float) -> float | None:
    """Poll /health; the wall-clock time it became ready if it was not ready at first."""
    deadline, waited = time.time() + seconds, False
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() if waited else None
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            raise client.RequestFailed(f"{url} not ready after {seconds:.0f} s")
        waited = True
        time.sleep(0.5)


class Scraper:
    def __init__(self, url: str, enabled: bool):
        self.url, self.enabled, self.seen, self.last = url, enabled, {}, None

    def __call__(self) -> prom.Snapshot | None:
        if not self.enabled:
            return None
        try:
            snap = prom.scrape(self.url)
        except (urllib.error.URLError, OSError, ValueError) as e:
            tqdm.write(f"bench: /metrics not available ({e}); continuing without it")
            self.enabled = False
            return None
        for name in (prom.HOST_READS, prom.SWAPS, prom.GENERATION_TOKENS):
            self.seen[name] = self.seen.get(name, False) or prom.exposed(snap, name)
        self.last = snap
        return snap


def _raw(rec: dict, req, rep: int, stream: int, origin: float) -> dict:
    """The kept form of one request record (times in ms from its t0; t0 from the suite start)."""
    times = m.token_times(rec["chunks"])
    got = m.request_metrics(rec["t0"], times)
    usage = rec.get("usage") or {}
    return {
        "repeat": rep,
        "warmup": rep == 0,
        "stream": stream,
        "prompt_id": req.prompt.id,
        "domain": req.prompt.domain,
        "reused": req.reused,
        "max_tokens": req.max_tokens,
        "prompt_tokens": rec.get("prompt_tokens"),
        "t0": rec["t0"] - origin,
        "t_last": (times[-1] - origin) if times else None,
        **got,
        "usage_completion_tokens": usage.get("completion_tokens"),
        "events": rec["events"],
        "count_via": rec["count_via"],
        "chunks": [[(t - rec["t0"]) * 1e3, n] for t, n in rec["chunks"]],
        "token_ids": rec["token_ids"],
        "finish_reason": rec["finish_reason"],
        "error": rec["error"],
    }


async def _run_repeat(http, url, body_of, reqs, streams, bar, rep, origin) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(reqs):
        queue.put_nowait((i, r))
    out: list[dict | None] = [None] * len(reqs)

    async def worker(slot: int) -> None:
        while not queue.empty():
            i, req = queue.get_nowait()
            rec = await client.stream_completion(http, url, body_of(req), body_of.count_via)
            out[i] = _raw(rec, req, rep, slot, origin)
            bar.update(1)

    await asyncio.gather(*(worker(s) for s in range(streams)))
    return [r for r in out if r is not None]


class _Body:
    def __init__(self, model: str, seed: int, count_via: str):
        self.model, self.seed, self.count_via = model, seed, count_via

    def __call__(self, req) -> dict:
        return client.completion_body(
            self.model, req.prompt.payload(), req.max_tokens, self.seed, self.count_via, req.extra
        )


def _host_fraction(args, snap: prom.Snapshot | None) -> float | None:
    if args.host_fraction is not None:
        return args.host_fraction
    if snap is not None:
        host = prom.total(snap.gauges, prom.HOST_BYTES)
        dev = prom.total(snap.gauges, prom.DEVICE_BYTES)
        if host is not None and dev is not None and host + dev > 0:
            return host / (host + dev)
    return 0.0 if args.config == "unpatched" else None


async def _suite(args, source: PromptSource, model: str, startup_s: float | None) -> list[dict]:
    scrape = Scraper(args.url, not args.no_metrics)
    salt = None if args.no_cache_salt else uuid.uuid4().hex[:12]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    plan = [(w, c) for w in args.workloads for c in args.concurrency]

    def reqs(w: str, c: int, rep: int):
        return requests(
            source,
            w,
            rep,
            args.per_domain,
            c,
            args.max_tokens,
            args.long_tokens,
            args.long_max_tokens,
            salt,
        )

    total = sum(len(reqs(w, c, rep)) for w, c in plan for rep in range(args.repeats + 1))
    runs = []
    origin = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=max(args.concurrency) + 1)
    session = aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=client.api_headers()
    )
    async with session as http:
        first = next(iter(source.by_domain.values()))[0].payload()
        if args.count_via == "auto":
            count_via = await client.probe_count_mode(http, args.url, model, first)
        else:
            count_via = args.count_via
        body_of = _Body(model, args.seed, count_via)
        with tqdm(total=total, desc=f"bench {args.config}", unit="req", file=sys.stderr) as bar:
            for w, c in plan:
                records, per_rep = [], []
                for rep in range(args.repeats + 1):
                    bar.set_postfix_str(f"{w} x{c} {'warm-up' if rep == 0 else f'repeat {rep}'}")
                    before = scrape() if rep else None
                    recs = await _run_repeat(
                        http, args.url, body_of, reqs(w, c, rep), c, bar, rep, origin
                    )
                    records += recs
                    after = scrape() if rep else None
                    if before is not None and after is not None:
                        per_rep.append({"repeat": rep, **prom.diff(before, after)})
                runs.append(
                    report.run_entry(
                        config=args.config,
                        workload=w,
                        streams=c,
                        records=records,
                        repeats_metrics=per_rep,
                        metrics_seen=scrape.seen,
                        count_via=count_via,
                        host_fraction=_host_fraction(args, scrape.last),
                        extra={
                            "max_tokens": args.long_max_tokens if w == "long" else args.max_tokens,
                            "startup_s": startup_s,
                            "peak_vram_gib": args.peak_vram_gib,
                            "peak_host_gib": args.peak_host_gib,
                            "metrics_scraped": scrape.enabled,
                        },
                    )
                )
    return runs


def _startup(args) -> float | None:
    ready_at = _wait_ready(args.url, args.wait_ready) if args.wait_ready > 0 else None
    if args.startup_s is not None:
        return args.startup_s
    if ready_at is None or args.no_metrics:
        return None
    try:
        start = prom.total(prom.scrape(args.url).gauges, "process_start_time_seconds")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return ready_at - start if start else None


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    argv_s = sys.argv[1:] if argv is None else argv
    command = "scripts/bench " + shlex.join(argv_s)
    if args.merge:
        missing = [str(p) for p in args.merge if not p.is_file()]
        if missing:
            ap.error(f"no such file: {', '.join(missing)}")
        doc = report.merge(args.merge, command)
        for p in report.write(doc, args.out):
            print(f"wrote {p}")
        return 0
    try:
        if args.synthetic_model:
            count = args.per_domain * (args.repeats + 1)
            source: PromptSource = SyntheticPrompts(args.synthetic_model, count, args.prompt_tokens)
        else:
            source = FilePrompts(args.prompts)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    try:
        startup_s = _startup(args)
        model = args.model or client.served_model(args.url)
        runs = asyncio.run(_suite(args, source, model, startup_s))
    except client.RequestFailed as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    doc = {
        "suite": args.suite,
        "date": report.now_iso(),
        "gpu": args.gpu or gpu_name(),
        "command": command,
        "server": args.url,
        "model": {"name": model, "prompts": source.describe},
        "client": {
            "seed": args.seed,
            "temperature": 0.0,
            "ignore_eos": True,
            "max_tokens": args.max_tokens,
            "long_tokens": args.long_tokens,
            "long_max_tokens": args.long_max_tokens,
            "warmup_repeats": 1,
            "repeats": args.repeats,
            "per_domain": args.per_domain,
            "domains": source.domains,
            "percentiles": list(m.PERCENTILES),
            "percentile_method": m.PERCENTILE_METHOD,
            "definitions": "TTFT = t1 - t0; TPOT = (tN - t1)/(N - 1); decode = (N - 1)/(tN - t1)",
        },
        "runs": runs,
    }
    report.add_ratios(doc)
    for p in report.write(doc, args.out):
        print(f"wrote {p}")
    failed = [r for run in runs for r in run["requests"] if r["error"]]
    for r in failed[:5]:
        print(
            f"bench: request {r['prompt_id']} (repeat {r['repeat']}) failed: {r['error']}",
            file=sys.stderr,
        )
    if failed:
        print(f"bench: {len(failed)} request(s) failed", file=sys.stderr)
        return 1
    return 0
