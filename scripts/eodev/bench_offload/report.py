# SPDX-License-Identifier: Apache-2.0
"""The result written out: the JSON, its Markdown report (the table of every row, then each
check's lines) and, with matplotlib, its plots."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from .. import bench_streams
from .. import gpu_harness as gh
from ..bench import prefill_bound
from ..bench.sweep import plot_sweep, sweep_lines
from .agreement import divergence_lines, prefill_agreement_lines
from .memory import census_lines, vram_saved_lines
from .profiles import profile_lines
from .reproduction import baseline_lines, reproduction_lines


def write_report(doc: dict, out: pathlib.Path) -> None:
    """The JSON, its markdown table and (with matplotlib) its plots."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    try:
        from ..bench.report import plot

        plot(doc, out.with_suffix(".png"))
        if plot_sweep(doc, out.with_suffix(".sweep.png")):
            gh.log(f"wrote the sweep's plot {out.with_suffix('.sweep.png')}")
        if prefill_bound.plot(doc, out.with_suffix(".prefill.png")):
            gh.log(f"wrote the prefill plot {out.with_suffix('.prefill.png')}")
        if bench_streams.plot(doc, out.with_suffix(".streams.png")):
            gh.log(f"wrote the many-streams plot {out.with_suffix('.streams.png')}")
    except ImportError:
        gh.log("no plot: matplotlib is not installed")
    gh.log(f"wrote {out} and its .md table (and .png plot)")


def markdown(doc: dict) -> str:
    """A short table of one suite run: medians of the repeats, every repeat in the JSON."""
    lines = [
        f"# {doc['suite']} on {doc['gpu']} ({doc['date']})",
        "",
        f"Command: `{doc.get('engine_runs_command') or doc['command']}`",
        "",
        "| config | workload | host fraction | same tokens as unpatched | "
        "decode tok/s (median of repeats) | "
        "TPOT p50 / p90 ms | TTFT 2k / 8k (/ 32k) ms | host reads/token | swaps/token | start-up s "
        "| peak VRAM / host GiB | vs unpatched | TPOT vs physical bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r.get('variant', r['config'])} | {r['workload']} | {r['host_fraction']:.3f} | "
            f"{r.get('sequences_identical_to_unpatched', '-')} | "
            f"{np.median(r['decode_tok_s']):.1f} "
            f"({', '.join(f'{x:.1f}' for x in r['decode_tok_s'])}) | "
            f"{r['tpot_ms_p50']:.3f} / {r['tpot_ms_p90']:.3f} | "
            f"{_ttft_cell(r)} | "
            f"{r['host_reads_per_token']:.2f} | {r['swaps_per_token']:.3f} | "
            f"{r['startup_s']:.0f} | {_memory_cell(r)} | "
            f"{_ratio_cell(r)} | {_bound_cell(r)} |"
        )
    lines += [
        "",
        "The first configuration of a run pays torch.compile and Triton JIT on a cold "
        "cache: compare start-up times between the later configurations only. Host "
        "reads per token come from the planted routing of the decoded tokens, or, with "
        "runtime swap, from its counters. Peak VRAM is the engine process's after load "
        "and graph capture (* the whole device's, in runs from before it was recorded per "
        "process); host memory is the process's peak resident set, pinned memory included.",
    ]
    for label, ab in doc.get("decide_ab", {}).items():
        lo, hi = ab["pair_ratio_range"]
        p50 = ab["tpot_ms_p50"]
        lines += [
            "",
            f"Decide kernel alone, {label}: TPOT {ab['ratio']} = {ab['pair_ratio_p50']:.3f} "
            f"(median of {len(ab['pair_ratios'])} request pairs in one engine, alternating "
            f"order; range {lo:.3f}-{hi:.3f}); TPOT p50 "
            + ", ".join(f"{n} {v:.3f} ms" for n, v in p50.items())
            + ".",
        ]
    lines += prefill_bound.lines(doc)
    lines += divergence_lines(doc)
    lines += prefill_agreement_lines(doc)
    lines += sweep_lines(doc)
    lines += bench_streams.lines(doc)
    lines += baseline_lines(doc)
    lines += request_lines(doc)
    lines += vram_saved_lines(doc)
    lines += census_lines(doc)
    lines += [x for w in path_warnings(doc) for x in ("", w)]
    lines += profile_lines(doc)
    lines += reproduction_lines(doc)
    for spec, err in doc.get("failed", {}).items():
        lines += ["", f"FAILED: {spec}: `{err.strip().splitlines()[0] if err.strip() else ''}`"]
    if doc.get("not_run"):
        lines += ["", f"Not run in this suite run: {', '.join(doc['not_run'])}."]
    return "\n".join(lines) + "\n"


def _ttft_cell(r: dict) -> str:
    """TTFT medians: 2k / 8k, and 32k where it was timed."""
    keys = ("ttft_2k_ms", "ttft_8k_ms", "ttft_32k_ms")
    return " / ".join(f"{np.median(r[k]):.1f}" for k in keys if r.get(k))


def _memory_cell(r: dict) -> str:
    """The engine's peak VRAM and host memory; the VRAM is the whole device's (marked *)
    in runs made before the probe read its own process's."""
    if r.get("peak_vram_gib") is None or r.get("peak_host_gib") is None:
        return "-"
    device = "" if str(r.get("vram_source", "")).startswith("this engine") else "*"
    return f"{r['peak_vram_gib']:.2f}{device} / {r['peak_host_gib']:.2f}"


def _bound_cell(r: dict) -> str:
    """Measured TPOT as a multiple of the physical bound, where the bound is known."""
    if r.get("tpot_vs_bound") is None:
        return "-"
    return f"{r['tpot_vs_bound']:.2f}x of {r['physical_bound_tpot_ms']:.3f} ms"


def _ratio_cell(r: dict) -> str:
    """The decode ratio to unpatched with the spread it carries: over the rounds, else over
    the repeats."""
    ratio = r["decode_vs_unpatched"]
    if ratio is None:
        return "-"
    rounds = r.get("decode_vs_unpatched_rounds")
    if rounds and len(rounds) > 1:
        return f"{ratio:.3f}x ({min(rounds):.3f}-{max(rounds):.3f} over {len(rounds)} rounds)"
    if r.get("decode_vs_unpatched_range") and r["config"] != "unpatched":
        lo, hi = r["decode_vs_unpatched_range"]
        return f"{ratio:.3f}x (repeats {lo:.3f}-{hi:.3f})"
    return f"{ratio:.3f}x"


def request_lines(doc: dict) -> list[str]:
    """Every engine's per-request TPOT as mean +- standard error and range. Engines bound
    by the host's step loop vary from request to request far more than their three
    per-repeat medians show (one unpatched engine of 2026-12-01 took 1.38-2.23 ms per token
    on the same prompts), so two configurations differ only where their means do by
    more than a few standard errors."""
    rows = [r for r in doc["runs"] if len(r.get("tpot_ms_by_request") or []) > 1]
    if not rows:
        return []
    lines = [
        "",
        "Per-request TPOT (ms), every request of every repeat:",
        "",
        "| config | workload | requests | mean +- s.e. | min-max |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        t = np.asarray(r["tpot_ms_by_request"], dtype=float)
        sem = float(t.std(ddof=1)) / np.sqrt(len(t))
        lines.append(
            f"| {r.get('variant', r['config'])} | {r['workload']} | {len(t)} | "
            f"{t.mean():.3f} +- {sem:.3f} | {t.min():.2f}-{t.max():.2f} |"
        )
    return lines


def path_warnings(doc: dict) -> list[str]:
    """Rows whose engine did not run the path its configuration names: a one-table
    configuration with layers that fell back to two tables (the driver refused a range,
    VRAM ran out while merging), or offload-02 with one-table layers."""
    out = []
    for r in doc["runs"]:
        n, m = r.get("one_table_layers"), r.get("moe_layers")
        if n is None or not m or r["workload"] != "fresh":
            continue
        want = m if r["config"].startswith("offload-03") else 0
        if r["config"] in ("offload-02", "offload-03", "offload-03-swap") and n != want:
            why = (
                "the engine log says why the other layers kept two tables"
                if n < want
                else "VLLM_EXPERT_ONE_TABLE was on"
            )
            out.append(
                f"WARNING: {r.get('variant', r['config'])} ran with {n} of {m} MoE layers "
                f"as one table (expected {want}): its rows are not {r['config']}'s ({why})."
            )
    return out
