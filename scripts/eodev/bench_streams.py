# SPDX-License-Identifier: Apache-2.0
"""bench-offload's many-streams workload (--streams 1,4,16): N requests of mixed domains
decoded together, for each N, in every engine of the run. More streams pick more distinct
experts per step, and a runtime swap meets a mixed workload instead of one conversation.

Each engine runs one `streams` task (eodev.engine_probe): distinct held-out prompts, the
domains interleaved, so that no two streams of a batch share a prompt. The report gives, per
configuration and N, the total decode tokens per second of every repeat, TPOT p50/p90 over all
requests, the ratio of medians against the run's unpatched engine at the same N, and with the
runtime swap its host reads and swaps per token from its own counters.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from .testmodel import data
from .testmodel.plant import Plan

PROMPT_TOKENS = 256


def parse_streams(value: str) -> list[int]:
    """ "1,4,16" -> [1, 4, 16] (argparse type)."""
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of stream counts: {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be 1 or more: {value!r}")
    return out


def prompts(plan: Plan, count: int) -> list[list[int]]:
    """`count` distinct held-out prompts, the domains taken in turn."""
    per_domain = -(-count // len(plan.planting.domains))
    by_domain = [
        [
            list(c.token_ids)
            for c in data.conversations(plan, d, "heldout", per_domain, PROMPT_TOKENS, seed=31)
        ]
        for d in plan.planting.domains
    ]
    mixed = [p for group in itertools.zip_longest(*by_domain) for p in group if p is not None]
    return mixed[:count]


def task(plan: Plan, streams: list[int], decode_tokens: int, repeats: int) -> dict:
    """The engine task: enough distinct prompts for every batch of the run (warm-up too)."""
    count = sum(streams) * (1 + repeats)
    return {
        "kind": "streams",
        "name": "streams",
        "prompts": prompts(plan, count),
        "streams": streams,
        "max_tokens": decode_tokens,
        "warmup": 1,
        "repeats": repeats,
    }


def engine_overrides(streams: list[int]) -> dict:
    """Room for the largest batch: as many sequences, and CUDA graphs up to its size (1, 2,
    4, ... and the largest itself), so that every N decodes in a captured graph."""
    top = max(streams)
    sizes = sorted({1, 2, 4, *(2**k for k in range(top.bit_length()) if 2**k <= top), top})
    return {"max_num_seqs": max(top, 4), "compilation_config": {"cudagraph_capture_sizes": sizes}}


def rows(runs: list[tuple[str, dict, dict | None]]) -> list[dict]:
    """Per configuration (spec, its result, the unpatched result its ratios are taken
    against) and N: the streams task's numbers, with the ratio of median total tokens/s
    against that unpatched engine at the same N."""
    out = []
    for spec, res, base in runs:
        if "streams" not in res["tasks"]:
            continue
        ref = {}
        if base is not None and "streams" in base["tasks"]:
            ref = {r["streams"]: r for r in base["tasks"]["streams"]["by_streams"]}
        for r in res["tasks"]["streams"]["by_streams"]:
            row = {"config": res["spec"]["config"], "variant": spec, **r}
            theirs = ref.get(r["streams"])
            row["total_vs_unpatched"] = (
                float(np.median(r["total_decode_tok_s"]) / np.median(theirs["total_decode_tok_s"]))
                if theirs
                else None
            )
            out.append(row)
    return out


def lines(doc: dict) -> list[str]:
    """The report's many-streams table (nothing when the run had none)."""
    got = doc.get("streams") or []
    if not got:
        return []
    prefetch = any("prefetch" in r for r in got)
    out = [
        "",
        "Many streams (mixed domains, decoded together): total decode tokens/s, median of the "
        "repeats (every repeat in brackets), TPOT over all requests, and with the runtime "
        "swap its host reads and swaps per token"
        + (
            "; with decode prefetch, the share of host picks whose row the guess had copied "
            "and the MB copied per decode step (guessed and missed rows)."
            if prefetch
            else "."
        ),
        "",
        "| config | streams | total decode tok/s | vs unpatched | TPOT p50 / p90 ms "
        "| host reads/token | swaps/token |"
        + (" prefetch hits | MB copied/step |" if prefetch else ""),
        "|---|---:|---|---|---|---|---|" + ("---|---|" if prefetch else ""),
    ]
    for r in got:
        ratio = r.get("total_vs_unpatched")
        reads, swaps = r.get("host_reads_per_token"), r.get("swaps_per_token")
        line = (
            f"| {r['variant']} | {r['streams']} | {np.median(r['total_decode_tok_s']):.1f} "
            f"({', '.join(f'{x:.1f}' for x in r['total_decode_tok_s'])}) | "
            f"{'-' if ratio is None else f'{ratio:.3f}x'} | "
            f"{r['tpot_ms_p50']:.3f} / {r['tpot_ms_p90']:.3f} | "
            f"{'-' if reads is None else f'{reads:.2f}'} | "
            f"{'-' if swaps is None else f'{swaps:.3f}'} |"
        )
        if prefetch:
            pf = r.get("prefetch") or {}
            hits, per_step = pf.get("hit_share"), pf.get("bytes_copied_per_step")
            line += (
                f" {'-' if hits is None else f'{hits:.3f}'} |"
                f" {'-' if per_step is None else f'{per_step / 1e6:.1f}'} |"
            )
        out.append(line)
    return out


def plot(doc: dict, path) -> bool:
    """Total decode tokens/s against unpatched at each stream count, one bar per patched
    configuration (whiskers: each repeat against unpatched's median), its host reads per
    token written above. False (nothing written) when the run had no streams."""
    got = [r for r in doc.get("streams") or [] if r["config"] != "unpatched"]
    if not got:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .bench.report import save_figure

    counts = sorted({r["streams"] for r in got})
    variants = list(dict.fromkeys(r["variant"] for r in got))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, name in enumerate(variants):
        mine = {r["streams"]: r for r in got if r["variant"] == name}
        for i, n in enumerate(counts):
            r = mine.get(n)
            if r is None or not r.get("total_vs_unpatched"):
                continue
            x = i + (k - (len(variants) - 1) / 2) * width
            mid = r["total_vs_unpatched"]
            # the unpatched engine's median, as this row's ratio was taken against it
            ref = float(np.median(r["total_decode_tok_s"])) / mid
            each = [t / ref for t in r["total_decode_tok_s"]]
            ax.bar(x, mid, width, color=f"C{k}", label=name if i == 0 else None)
            ax.errorbar(x, mid, [[mid - min(each)], [max(each) - mid]], color="k", capsize=3)
            if r.get("host_reads_per_token") is not None:
                ax.annotate(
                    f"{r['host_reads_per_token']:.2f}",
                    (x, max(each)),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=7,
                )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(counts)), [f"{n} stream{'s' * (n > 1)}" for n in counts])
    ax.set_ylabel("total decode tok/s / unpatched (median)")
    ax.set_title("Many streams of mixed domains; above each bar: host reads per token")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)
    return True
