# SPDX-License-Identifier: Apache-2.0
"""One configuration x workload of the result (an entry of its "runs"): the engine's figures,
its ratios against the unpatched engine it is compared with, its physical bound, and the merge
of several rounds into one row."""

from __future__ import annotations

import numpy as np
from eotools.selection import GiB

from ..bench import prefill_bound
from .memory import census_diff, sites_diff, vram_bytes, vram_saved


def run_row(
    name: str, workload: str, res: dict, base: dict | None, host_read_us: float | None = None
) -> dict:
    """One configuration x workload in the project's result format, with its physical bound
    when the cost of one host read is known: the unpatched TPOT plus the host reads it must
    make per token, each at that cost (TPOT here is the median inter-token time)."""
    dec = res["tasks"][workload]
    mem = res["memory"]
    total = mem["expert_gpu_bytes"] + mem["expert_host_bytes"]
    delta = dec.get("swap_delta")
    if delta is not None and dec.get("decoded_all"):  # runtime swap: its own counters
        reads = delta["host_reads"] / dec["decoded_all"]
        swaps = delta["swaps"] / dec["decoded_all"]
        source = "the runtime swap's counters (decode tokens, warm-up included)"
    else:
        reads = res["host_reads_per_token"].get(workload, float("nan"))
        swaps = 0.0
        source = "planted routing of the decoded tokens"
    ref = base["tasks"].get(workload) if base else None
    bound = None
    if ref is not None and host_read_us is not None and reads == reads:  # not NaN
        bound = ref["tpot_ms_p50"] + reads * host_read_us / 1e3
    return {
        "config": name,
        "workload": workload,
        "host_fraction": mem["expert_host_bytes"] / total if total else 0.0,
        "decode_tok_s": dec["decode_tok_s"],
        "tpot_ms_p50": dec["tpot_ms_p50"],
        "tpot_ms_p90": dec["tpot_ms_p90"],
        # every request's TPOT (prompts x repeats): the spread within one engine
        "tpot_ms_by_request": [x["tpot_ms"] for x in dec.get("runs", []) if "tpot_ms" in x],
        "ttft_ms": dec["ttft_ms"],
        "ttft_2k_ms": res["tasks"]["ttft_2k"]["ttft_ms"],
        "ttft_8k_ms": res["tasks"]["ttft_8k"]["ttft_ms"],
        "ttft_32k_ms": res["tasks"].get("ttft_32k", {}).get("ttft_ms"),
        "host_reads_per_token": reads,
        "host_reads_source": source,
        "swaps_per_token": swaps,
        "startup_s": res["startup_s"],
        "peak_vram_gib": vram_bytes(mem) / GiB,
        "vram_source": (
            "this engine's process (driver accounting, after load and graph capture)"
            if mem.get("process_vram_bytes")
            else "the whole device (after load; with --paired or --group, every engine on it)"
        ),
        "peak_host_gib": mem["host_peak_rss_bytes"] / GiB,
        "expert_host_gib": mem["expert_host_bytes"] / GiB,
        "expert_gpu_gib": mem["expert_gpu_bytes"] / GiB,
        "moe_layers": mem.get("moe_layers"),
        "one_table_layers": mem.get("one_table_layers"),
        "itl_samples": dec["itl_samples"],
        "physical_bound_tpot_ms": bound,
        "tpot_vs_bound": dec["tpot_ms_p50"] / bound if bound else None,
        "decode_vs_unpatched": (
            np.median(dec["decode_tok_s"]) / np.median(ref["decode_tok_s"]) if ref else None
        ),
        **_repeat_ratios(dec["decode_tok_s"], ref["decode_tok_s"] if ref else None),
        **prefill_bound.row_fields(res, base),
        "census_vs_unpatched": census_diff(
            mem.get("census"), base["memory"].get("census") if base else None
        ),
        "alloc_sites_vs_unpatched": sites_diff(
            mem.get("alloc_sites"), base["memory"].get("alloc_sites") if base else None
        ),
        "vram_saved": vram_saved(mem, base["memory"] if base else None),
    }


def _repeat_ratios(mine: list[float], theirs: list[float] | None) -> dict:
    """Repeat i against the unpatched engine's repeat i, and their range: the spread a
    ratio carries. With --paired or --group the two repeats ran interleaved, request by
    request; otherwise one after the other."""
    if not theirs or len(mine) != len(theirs):
        return {}
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {
        "decode_vs_unpatched_by_repeat": ratios,
        "decode_vs_unpatched_range": [min(ratios), max(ratios)],
    }


def merge_rounds(rows: list[dict]) -> dict:
    """One configuration x workload over several rounds: every repeat kept, medians of the
    per-round percentiles, and the ratio to unpatched as the median of the per-round
    ratios (each against the unpatched run of its own round) with their range."""
    out = dict(rows[0])

    def med(key: str) -> float:
        return float(np.median([r[key] for r in rows if r.get(key) is not None]))

    out["decode_tok_s"] = [x for r in rows for x in r["decode_tok_s"]]
    out["tpot_ms_by_request"] = [x for r in rows for x in r.get("tpot_ms_by_request", [])]
    for k in ("tpot_ms_p50", "tpot_ms_p90", "ttft_ms", "startup_s", "peak_vram_gib"):
        out[k] = med(k)
    out["peak_host_gib"] = max(r["peak_host_gib"] for r in rows)
    merged = [r.get("one_table_layers") for r in rows]
    if None not in merged:  # the round furthest from its configuration's path
        out["one_table_layers"] = (min if out["config"].startswith("offload-03") else max)(merged)
    for k in ("host_reads_per_token", "swaps_per_token"):
        out[k] = float(np.mean([r[k] for r in rows]))
    out["ttft_2k_ms"] = [x for r in rows for x in r["ttft_2k_ms"]]
    out["ttft_8k_ms"] = [x for r in rows for x in r["ttft_8k_ms"]]
    if all(r.get("ttft_32k_ms") for r in rows):
        out["ttft_32k_ms"] = [x for r in rows for x in r["ttft_32k_ms"]]
    out["itl_samples"] = sum(r["itl_samples"] for r in rows)
    ratios = [r["decode_vs_unpatched"] for r in rows if r.get("decode_vs_unpatched")]
    out["decode_vs_unpatched_rounds"] = ratios
    out["decode_vs_unpatched"] = float(np.median(ratios)) if ratios else None
    by_repeat = [x for r in rows for x in r.get("decode_vs_unpatched_by_repeat") or []]
    out.pop("decode_vs_unpatched_by_repeat", None)
    out.pop("decode_vs_unpatched_range", None)
    if by_repeat:
        out["decode_vs_unpatched_by_repeat"] = by_repeat
        out["decode_vs_unpatched_range"] = [min(by_repeat), max(by_repeat)]
    bounds = [r["tpot_vs_bound"] for r in rows if r.get("tpot_vs_bound")]
    out["tpot_vs_bound"] = float(np.median(bounds)) if bounds else None
    if out.get("physical_bound_tpot_ms") is not None:
        out["physical_bound_tpot_ms"] = med("physical_bound_tpot_ms")
    for same, worst in (
        ("sequences_identical_to_unpatched", "decode_logprob_max_abs_diff"),
        ("ttft_first_tokens_identical_to_unpatched", "ttft_first_logprob_max_abs_diff"),
    ):
        if all(same in r for r in rows):  # "a/b" per round: summed; the worst difference
            counts = [tuple(map(int, r[same].split("/"))) for r in rows]
            out[same] = f"{sum(a for a, _ in counts)}/{sum(b for _, b in counts)}"
            out[worst] = max(r[worst] for r in rows)
    if all("ttft_first_logprob_unpatched_spread" in r for r in rows):
        out["ttft_first_logprob_unpatched_spread"] = max(
            r["ttft_first_logprob_unpatched_spread"] for r in rows
        )
    if any("divergences" in r for r in rows):
        out["divergences"] = [d for r in rows for d in r.get("divergences", [])]
    out["rounds"] = len(rows)
    return out
