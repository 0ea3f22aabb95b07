# SPDX-License-Identifier: Apache-2.0
"""Score the same text on two servers and compare per-token logprobs (docs/benchmarks.md).

    scripts/compare-logprobs --a http://a:8000 --b http://b:8000 [--a2 http://a2:8000] \\
        --synthetic-model /models/synth --out bench/results/NAME.logprobs.json

Server A generates greedy text for fixed prompts. That exact text (prompt + generated, sent as
token ids) is then scored on A, B and the baseline A' (--a2, a second instance of A's
configuration; without it, a second scoring run on A) with `echo`, `logprobs: 0`,
`prompt_logprobs: 0` and `max_tokens: 1`. Reported: per-token |logprob difference| mean and
max for A vs B and for A vs A' (the run-to-run difference of the same server), over every
scored position and over the generated positions alone, and whether B generates the same
greedy tokens as A.

Exit status: 0 ok, 1 a request failed, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import numpy as np

from . import client, report
from .workloads import FilePrompts, PromptSource, SyntheticPrompts


def _ids_from_logprobs(choice: dict) -> list[int] | None:
    lp = choice.get("logprobs") or {}
    toks = lp.get("tokens") or []
    if toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
        return [int(t.split(":", 1)[1]) for t in toks]
    return None


def generate(
    url: str, model: str, prompt, max_tokens: int, seed: int
) -> tuple[list[int], list[int]]:
    """(prompt token ids, greedy generated token ids) from one server."""
    body = client.greedy_body(model, prompt, max_tokens, seed)
    body.update(logprobs=0, return_tokens_as_token_ids=True)
    res = client.post_json(url.rstrip("/") + "/v1/completions", body)
    choice = res["choices"][0]
    gen = choice.get("token_ids")
    if gen is None:
        gen = _ids_from_logprobs(choice)
    if gen is None:
        raise client.RequestFailed(f"{url}: the answer has neither token_ids nor token-id logprobs")
    prompt_ids = choice.get("prompt_token_ids")
    if prompt_ids is None:
        if isinstance(prompt, list):
            prompt_ids = prompt
        else:
            tok = client.post_json(
                url.rstrip("/") + "/tokenize", {"model": model, "prompt": prompt}
            )
            prompt_ids = tok["tokens"]
    return list(prompt_ids), list(gen)


def score(url: str, model: str, ids: list[int]) -> tuple[list[float | None], str]:
    """Logprob of every token of `ids` given the tokens before it (position 0: None), and
    which field of the answer gave them."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "echo": True,
        "logprobs": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    res = client.post_json(url.rstrip("/") + "/v1/completions", body)
    choice = res["choices"][0]
    plp = choice.get("prompt_logprobs")
    if plp is not None:
        if len(plp) != len(ids):
            raise client.RequestFailed(f"{url}: {len(plp)} prompt logprobs for {len(ids)} tokens")
        out: list[float | None] = []
        for tok, entry in zip(ids, plp, strict=True):
            if entry is None:
                out.append(None)
                continue
            e = entry.get(str(tok), entry.get(tok))
            if e is None:
                raise client.RequestFailed(f"{url}: prompt logprobs lack the scored token {tok}")
            out.append(float(e["logprob"] if isinstance(e, dict) else e))
        return out, "prompt_logprobs"
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if lp is None or len(lp) < len(ids):
        raise client.RequestFailed(f"{url}: the answer has no prompt logprobs (echo)")
    return [None if x is None else float(x) for x in lp[: len(ids)]], "echo logprobs"


def _stats(d: np.ndarray) -> dict:
    return {
        "mean": float(d.mean()) if d.size else None,
        "max": float(d.max()) if d.size else None,
        "tokens": int(d.size),
    }


def diff_stats(a: list[float | None], b: list[float | None], generated_from: int) -> dict:
    """|a - b| over positions both scored: all of them, and the generated ones."""
    pos = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x is not None and y is not None]
    d = np.array([abs(a[i] - b[i]) for i in pos])
    g = np.array([abs(a[i] - b[i]) for i in pos if i >= generated_from])
    return {**_stats(d), "generated": _stats(g)}


def _pool(rows: list[dict], key: str) -> dict:
    """Token-weighted mean and max over prompts."""

    def agg(part: list[dict]) -> dict:
        n = sum(p["tokens"] for p in part)
        means = [p["mean"] * p["tokens"] for p in part if p["tokens"]]
        maxes = [p["max"] for p in part if p["tokens"]]
        return {"mean": sum(means) / n if n else None, "max": max(maxes, default=None), "tokens": n}

    return {**agg([r[key] for r in rows]), "generated": agg([r[key]["generated"] for r in rows])}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="compare-logprobs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--a", required=True, help="server A (generates the text), base URL")
    ap.add_argument("--b", required=True, help="server B, compared against A")
    ap.add_argument("--a2", help="a second instance of A's configuration (default: A again)")
    ap.add_argument("--model", help="model name (default: each server's first /v1/models)")
    ap.add_argument("--prompts", type=pathlib.Path, help=".jsonl or text file (as scripts/bench)")
    ap.add_argument("--synthetic-model", type=pathlib.Path, help="a make-test-model checkpoint")
    ap.add_argument("--per-domain", type=int, default=1, help="prompts per domain (default 1)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="synthetic prompt length")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens A generates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, help="result JSON (default: print only)")
    return ap


def _fmt(s: dict) -> str:
    if s["mean"] is None:
        return "no tokens"
    return f"mean {s['mean']:.3e}, max {s['max']:.3e} over {s['tokens']} tokens"


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if (args.prompts is None) == (args.synthetic_model is None):
        ap.error("give exactly one of --prompts and --synthetic-model")
    if args.max_tokens < 1 or args.per_domain < 1:
        ap.error("--max-tokens and --per-domain must be positive")
    try:
        source: PromptSource = (
            SyntheticPrompts(args.synthetic_model, args.per_domain, args.prompt_tokens)
            if args.synthetic_model
            else FilePrompts(args.prompts)
        )
    except (OSError, ValueError) as e:
        ap.error(str(e))
    prompts = [p for ps in source.by_domain.values() for p in ps[: args.per_domain]]
    baseline = args.a2 or args.a
    rows, sources = [], set()
    try:
        model = {u: args.model or client.served_model(u) for u in {args.a, args.b, baseline}}
        for p in prompts:
            prompt_ids, gen = generate(
                args.a, model[args.a], p.payload(), args.max_tokens, args.seed
            )
            _, gen_b = generate(args.b, model[args.b], p.payload(), args.max_tokens, args.seed)
            ids = prompt_ids + gen
            lp_a, src = score(args.a, model[args.a], ids)
            lp_b, src_b = score(args.b, model[args.b], ids)
            lp_a2, src_a2 = score(baseline, model[baseline], ids)
            sources |= {src, src_b, src_a2}
            diverge = next(
                (i for i, (x, y) in enumerate(zip(gen, gen_b, strict=False)) if x != y),
                None if len(gen) == len(gen_b) else min(len(gen), len(gen_b)),
            )
            rows.append(
                {
                    "prompt_id": p.id,
                    "domain": p.domain,
                    "prompt_tokens": len(prompt_ids),
                    "generated_tokens": len(gen),
                    "greedy_match": diverge is None,
                    "first_divergence": diverge,
                    "a_vs_b": diff_stats(lp_a, lp_b, len(prompt_ids)),
                    "a_vs_a2": diff_stats(lp_a, lp_a2, len(prompt_ids)),
                }
            )
    except client.RequestFailed as e:
        print(f"compare-logprobs: {e}", file=sys.stderr)
        return 1
    ab, aa = _pool(rows, "a_vs_b"), _pool(rows, "a_vs_a2")
    ratio = ab["mean"] / aa["mean"] if ab["mean"] is not None and aa["mean"] else None
    doc = {
        "date": report.now_iso(),
        "command": "scripts/compare-logprobs " + shlex.join(sys.argv[1:] if argv is None else argv),
        "a": args.a,
        "b": args.b,
        "a2": args.a2 or f"{args.a} (second scoring run)",
        "model": model,
        "prompts": source.describe,
        "max_tokens": args.max_tokens,
        "logprob_source": sorted(sources),
        "greedy_identical": sum(r["greedy_match"] for r in rows),
        "prompts_scored": len(rows),
        "a_vs_b": ab,
        "a_vs_a2": aa,
        "mean_ratio_vs_baseline": ratio,
        "per_prompt": rows,
    }
    lines = [
        f"A vs B : {_fmt(ab)} (generated part: {_fmt(ab['generated'])})",
        f"A vs A': {_fmt(aa)} (generated part: {_fmt(aa['generated'])}) [baseline]",
        "A vs B mean / baseline mean: "
        + (f"{ratio:.2f}x" if ratio is not None else "- (baseline is exactly 0)"),
        f"greedy tokens identical on {doc['greedy_identical']} of {len(rows)} prompts",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0
