# SPDX-License-Identifier: Apache-2.0
"""Time to first token against its bound (bench-offload --copy-gbps).

A prefill chunk cannot finish before the unpatched engine's prefill of the same prompt, nor
before its layers' host experts have crossed PCIe once: with prefill staging every host
expert of every layer is copied for every chunk, and an unstaged chunk of 2048 tokens or
more reads nearly all of them. The bound of a prompt is the larger of the two, so

    bound = max(unpatched TTFT, chunks x host expert bytes / copy bandwidth)

with chunks = ceil(prompt tokens / the engine's max_num_batched_tokens). How far a
configuration's TTFT lies above it says how much of the host traffic prefill fails to hide.
"""

from __future__ import annotations

import math

import numpy as np

LENGTHS = ("2k", "8k", "32k")


def row_fields(res: dict, base: dict | None) -> dict:
    """What the bound needs from one engine run: its prefill chunk, each timed prompt's
    length, and its unpatched engine's TTFT medians."""
    tasks = res["tasks"]
    engine = res.get("engine_args") or {}
    out: dict = {
        "prefill_chunk_tokens": engine.get("max_num_batched_tokens"),
        "ttft_prompt_tokens": {
            n: tasks[f"ttft_{n}"]["prompt_tokens"] for n in LENGTHS if f"ttft_{n}" in tasks
        },
    }
    if base is not None:
        out["ttft_unpatched_ms"] = {
            n: float(np.median(base["tasks"][f"ttft_{n}"]["ttft_ms"]))
            for n in LENGTHS
            if f"ttft_{n}" in base["tasks"]
        }
    return out


def bounds(row: dict, copy_gbps: float) -> dict[str, dict]:
    """Per prompt length: TTFT median, ratio to unpatched, the bound and the ratio to it.
    Empty where the row lacks what the bound needs (runs made before it was recorded)."""
    chunk = row.get("prefill_chunk_tokens")
    ref = row.get("ttft_unpatched_ms") or {}
    host_bytes = row.get("expert_host_gib", 0.0) * 2**30
    out = {}
    for n, tokens in (row.get("ttft_prompt_tokens") or {}).items():
        ttft = row.get(f"ttft_{n}_ms")
        if not chunk or not ttft or n not in ref:
            continue
        copy_ms = math.ceil(tokens / chunk) * host_bytes / (copy_gbps * 1e9) * 1e3
        bound = max(ref[n], copy_ms)
        med = float(np.median(ttft))
        out[n] = {
            "ttft_ms": med,
            "vs_unpatched": med / ref[n],
            "copy_ms": copy_ms,
            "bound_ms": bound,
            "vs_bound": med / bound,
        }
    return out


def annotate(runs: list[dict], copy_gbps: float | None) -> None:
    """Add each fresh-workload row's "ttft_vs_bound" (in place)."""
    if not copy_gbps:
        return
    for r in runs:
        if r["workload"] != "fresh" or r["config"] == "unpatched":
            continue
        if got := bounds(r, copy_gbps):
            r["ttft_vs_bound"] = got


def _bounded(doc: dict) -> tuple[list[dict], list[str]]:
    """The rows with a bound, and the prompt lengths any of them has."""
    rows = [r for r in doc["runs"] if r.get("ttft_vs_bound")]
    return rows, [n for n in LENGTHS if any(n in r["ttft_vs_bound"] for r in rows)]


def lines(doc: dict) -> list[str]:
    """The markdown table: one row per configuration, one column group per prompt length."""
    rows, lengths = _bounded(doc)
    if not rows:
        return []
    out = [
        "",
        f"Time to first token against its bound (copy bandwidth {doc['copy_gbps']} GB/s; "
        "bound = the larger of unpatched TTFT and every host expert's bytes once per "
        "prefill chunk at that bandwidth; medians of the repeats):",
        "",
        "| config | host GiB | chunk | "
        + " | ".join(f"TTFT {n} ms | vs unpatched | vs bound (ms)" for n in lengths)
        + " |",
        "|---|---:|---:|" + "---:|---:|---:|" * len(lengths),
    ]
    for r in rows:
        cells = []
        for n in lengths:
            b = r["ttft_vs_bound"].get(n)
            cells += (
                [
                    f"{b['ttft_ms']:.1f}",
                    f"{b['vs_unpatched']:.2f}x",
                    f"{b['vs_bound']:.2f}x ({b['bound_ms']:.1f})",
                ]
                if b
                else ["-", "-", "-"]
            )
        out.append(
            f"| {r.get('variant', r['config'])} | {r.get('expert_host_gib', 0):.2f} | "
            f"{r['prefill_chunk_tokens']} | " + " | ".join(cells) + " |"
        )
    return out


def plot(doc: dict, path) -> bool:
    """TTFT against unpatched per prompt length, one bar per configuration, with each
    bound as a tick. False (nothing written) without bounds."""
    rows, lengths = _bounded(doc)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_figure

    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, r in enumerate(rows):
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(lengths))]
        got = [r["ttft_vs_bound"].get(n) for n in lengths]
        ratios = [b["vs_unpatched"] if b else 0.0 for b in got]
        ax.bar(xs, ratios, width, label=r.get("variant", r["config"]))
        ref = r["ttft_unpatched_ms"]
        ticks = [b["bound_ms"] / ref[n] if b else 0.0 for n, b in zip(lengths, got, strict=True)]
        ax.plot(xs, ticks, "k_", markersize=14)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(lengths)), [f"{n} prompt" for n in lengths])
    ax.set_ylabel("TTFT / unpatched TTFT (median)")
    ax.set_title(f"Time to first token; black ticks: bound at {doc['copy_gbps']} GB/s")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)
    return True
