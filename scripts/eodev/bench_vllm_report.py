# SPDX-License-Identifier: Apache-2.0
"""What scripts/bench-vllm makes of `vllm bench serve`'s saved results: one run entry per
configuration and concurrency in the project's suite format (bench/results/README.md), ratios
against unpatched at the same concurrency, the same ratios from this project's own clients
(bench-offload's many-streams rows, scripts/bench's fresh runs) set beside them, and the
Markdown table.

Everything here works on plain data (the result files vLLM 0.29.0's benchmarks/serve.py
writes with --save-result), so the CPU tests check it without a server.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

# The fields read from a result file. serve.py writes `p<N>_<metric>_ms` for every percentile
# of --metric-percentiles and every metric of --percentile-metrics, and `median_*` always.
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
RESULT_FIELDS = (
    "completed",
    "failed",
    "num_prompts",
    "max_concurrency",
    "duration",
    "total_output_tokens",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p90_ttft_ms",
    "median_tpot_ms",
    "p50_tpot_ms",
    "p90_tpot_ms",
    "p50_itl_ms",
)
DEFAULT_VARIANT = "offload-03-swap+stage"  # bench-offload's name for the compose default path
PROMPTS = (
    "vLLM's random dataset (`--dataset-name random`): each prompt a run of consecutive token "
    "ids from a seeded random offset, so no planted domain or conversation"
)
THROUGHPUT_SOURCE = (
    "vLLM's output_throughput: every request's output tokens over the benchmark's duration "
    "(first token and prefill included)"
)


class ResultError(ValueError):
    """A saved vLLM result that cannot be read, or lacks a field this report needs."""


def read_result(path: pathlib.Path) -> dict[str, Any]:
    """One `--save-result` file, with every field of RESULT_FIELDS present."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResultError(f"{path}: not a readable vLLM result ({e})") from None
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: not a vLLM result (a JSON object expected)")
    missing = [k for k in RESULT_FIELDS if k not in doc]
    if missing:
        raise ResultError(
            f"{path}: lacks {', '.join(missing)} (the client needs --percentile-metrics "
            f"{','.join(PERCENTILE_METRICS)} --metric-percentiles "
            f"{','.join(map(str, PERCENTILES))})"
        )
    return doc


def repeat_figures(res: dict[str, Any]) -> dict[str, Any]:
    """One client run's figures under the suite format's names."""
    return {
        "output_tok_s": res["output_throughput"],
        "total_tok_s": res["total_token_throughput"],
        "tpot_ms_p50": res["p50_tpot_ms"],
        "tpot_ms_p90": res["p90_tpot_ms"],
        "ttft_ms": res["median_ttft_ms"],
        "ttft_ms_p90": res["p90_ttft_ms"],
        "itl_ms_p50": res["p50_itl_ms"],
        "completed": res["completed"],
        "failed": res["failed"],
        "prompts": res["num_prompts"],
        "output_tokens": res["total_output_tokens"],
        "duration_s": res["duration"],
    }


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def run_entry(
    *,
    config: str,
    staging: bool,
    concurrency: int,
    host_fraction: float,
    repeats: list[dict[str, Any]],
    server: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run entry of one configuration at one concurrency: every repeat's output tokens/s,
    the repeats' medians of TPOT p50/p90 and median TTFT, the server's counters and peaks."""
    figs = [r["figures"] for r in repeats if r.get("figures")]
    entry = {
        "config": config,
        "variant": DEFAULT_VARIANT if staging else config,
        "prefill_staging": staging,
        "workload": "fresh",
        "prompts": PROMPTS,
        "concurrency": concurrency,
        "host_fraction": host_fraction,
        "decode_tok_s": [f["output_tok_s"] for f in figs],
        "decode_tok_s_source": THROUGHPUT_SOURCE,
        "total_tok_s": [f["total_tok_s"] for f in figs],
        "tpot_ms_p50": _median([f["tpot_ms_p50"] for f in figs]),
        "tpot_ms_p90": _median([f["tpot_ms_p90"] for f in figs]),
        "ttft_ms": _median([f["ttft_ms"] for f in figs]),
        "ttft_ms_p90": _median([f["ttft_ms_p90"] for f in figs]),
        "itl_ms_p50": _median([f["itl_ms_p50"] for f in figs]),
        "host_reads_per_token": per_token(repeats, "host_reads"),
        "swaps_per_token": per_token(repeats, "swaps"),
        "host_reads_source": (
            "/metrics difference over the server's generation tokens, the client's warm-up "
            "requests included"
        ),
        "startup_s": server.get("startup_s"),
        "peak_vram_gib": server.get("peak_vram_gib"),
        "peak_host_gib": server.get("peak_host_gib"),
        "repeats": len(figs),
        "requests_per_repeat": figs[0]["prompts"] if figs else 0,
        "completed": sum(f["completed"] for f in figs),
        "failed": sum(f["failed"] for f in figs),
        "client_errors": [r["error"] for r in repeats if r.get("error")],
        "raw": [r["raw"] for r in repeats if r.get("raw")],
    }
    entry.update(extra or {})
    return entry


def per_token(repeats: list[dict[str, Any]], counter: str) -> float | None:
    """A server counter's difference per generated token over every repeat; None where the
    server does not expose it (unpatched)."""
    got = [r["counters"] for r in repeats if r.get("counters")]
    vals = [c.get(counter) for c in got]
    tokens = sum(c.get("generation_tokens") or 0.0 for c in got)
    if not got or all(v is None for v in vals) or not tokens:
        return None
    return sum(v or 0.0 for v in vals) / tokens


def ratio_range(mine: Sequence[float], base: Sequence[float]) -> list[float] | None:
    """min/max .. max/min over the repeats: every pairing of a repeat with a base repeat."""
    a, b = [x for x in mine if x], [x for x in base if x]
    if not a or not b:
        return None
    return [min(a) / max(b), max(a) / min(b)]


def add_ratios(doc: dict[str, Any]) -> dict[str, Any]:
    """Every run against the unpatched run of the same concurrency (in place): output tokens/s
    (>1 faster) with its range over the repeats, TPOT p50 and TTFT (<1 shorter)."""
    base = {r["concurrency"]: r for r in doc["runs"] if r["config"] == "unpatched"}
    for r in doc["runs"]:
        b = base.get(r["concurrency"])
        out: dict[str, Any] = dict.fromkeys(
            (
                "decode_vs_unpatched",
                "decode_vs_unpatched_range",
                "tpot_p50_vs_unpatched",
                "ttft_vs_unpatched",
            )
        )
        if b is not None:
            mine, theirs = _median(r["decode_tok_s"]), _median(b["decode_tok_s"])
            if mine and theirs:
                out["decode_vs_unpatched"] = mine / theirs
                out["decode_vs_unpatched_range"] = ratio_range(r["decode_tok_s"], b["decode_tok_s"])
            if r.get("tpot_ms_p50") and b.get("tpot_ms_p50"):
                out["tpot_p50_vs_unpatched"] = r["tpot_ms_p50"] / b["tpot_ms_p50"]
            if r.get("ttft_ms") and b.get("ttft_ms"):
                out["ttft_vs_unpatched"] = r["ttft_ms"] / b["ttft_ms"]
        r.update(out)
    return doc


# -- the other client ---------------------------------------------------------------------


def other_client_ratios(other: dict[str, Any], variant: str = DEFAULT_VARIANT) -> dict:
    """The default path's ratios against unpatched in a result of this project's own clients,
    by concurrency: bench-offload's many-streams rows (total decode tokens/s of N requests
    decoded together) and, for one stream, its fresh single-prompt decode; or scripts/bench's
    fresh runs at each concurrency. {} when the document has neither."""
    out: dict[int, dict[str, Any]] = {}
    streams = other.get("streams") or []
    for r in streams:
        if r.get("variant") != variant or not r.get("total_vs_unpatched"):
            continue
        base = _streams_base(streams, r)
        out[r["streams"]] = {
            "ratio": r["total_vs_unpatched"],
            "range": ratio_range(r["total_decode_tok_s"], base) if base else None,
            "what": "many streams: total decode tok/s of N requests decoded together",
            "host_reads_per_token": r.get("host_reads_per_token"),
        }
    for r in other.get("runs") or []:
        if r.get("workload") != "fresh" or not r.get("decode_vs_unpatched"):
            continue
        if not _is_variant(r, variant):
            continue
        n = r.get("concurrency", 1)
        row = {
            "ratio": r["decode_vs_unpatched"],
            "range": r.get("decode_vs_unpatched_range"),
            "what": "one prompt decoded alone: tokens after the first over their time"
            if "concurrency" not in r
            else "decode tok/s per stream (scripts/bench)",
            "host_reads_per_token": r.get("host_reads_per_token"),
        }
        if n in out:
            out[n]["single_prompt"] = row
        else:
            out[n] = row
    return out


def _streams_base(streams: list[dict], row: dict) -> list[float] | None:
    """The unpatched many-streams row a bench-offload row's ratio was taken against: the one
    at the same N whose median the ratio implies (a run has one per group of engines)."""
    implied = statistics.median(row["total_decode_tok_s"]) / row["total_vs_unpatched"]
    cands = [
        r["total_decode_tok_s"]
        for r in streams
        if r.get("config") == "unpatched" and r.get("streams") == row["streams"]
    ]
    if not cands:
        return None
    return min(cands, key=lambda t: abs(statistics.median(t) - implied))


def _is_variant(r: dict, variant: str) -> bool:
    """A run of `variant`: bench-offload names it (`variant`); scripts/bench knows only the
    --config it was given, offload-03-swap for a server on the default path."""
    if "variant" in r or "concurrency" not in r:
        return r.get("variant", r.get("config")) == variant
    return r.get("config") == variant.split("+", 1)[0]


def overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    if not a or not b:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def comparison(doc: dict[str, Any], other: dict[str, Any], other_path: str) -> dict[str, Any]:
    """The two clients' ratios of the default path side by side at every concurrency, and
    whether they agree: their ranges over the repeats overlap (the noise each run shows)."""
    theirs = other_client_ratios(other)
    rows = []
    for r in doc["runs"]:
        if r["config"] == "unpatched" or r.get("decode_vs_unpatched") is None:
            continue
        t = theirs.get(r["concurrency"])
        row = {
            "concurrency": r["concurrency"],
            "vllm_client": r["decode_vs_unpatched"],
            "vllm_client_range": r.get("decode_vs_unpatched_range"),
            "vllm_client_host_reads_per_token": r.get("host_reads_per_token"),
            "project_client": t["ratio"] if t else None,
            "project_client_range": t["range"] if t else None,
            "project_client_measures": t["what"] if t else None,
            "project_client_host_reads_per_token": t["host_reads_per_token"] if t else None,
        }
        if t and "single_prompt" in t:
            row["project_single_prompt"] = t["single_prompt"]["ratio"]
            row["project_single_prompt_range"] = t["single_prompt"]["range"]
        agree = overlap(row["vllm_client_range"], row["project_client_range"])
        row["agree"] = agree
        if t:
            row["difference"] = row["vllm_client"] / t["ratio"] - 1.0
        rows.append(row)
    return {
        "with": other_path,
        "project_client": other.get("suite", "unknown"),
        "project_command": other.get("command"),
        "rows": rows,
        "rule": "agree: the two ratios' ranges over the repeats (min/max .. max/min) overlap",
    }


# -- Markdown ------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _x(ratio: float | None, rng: list[float] | None = None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.3f}x" + (f" ({rng[0]:.3f}-{rng[1]:.3f})" if rng else "")


def markdown(doc: dict[str, Any]) -> str:
    c = doc["client"]
    lines = [
        f"# {doc['suite']}: `vllm bench serve` on {doc['gpu']} ({doc['date']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Client: vLLM {c.get('vllm_version') or 'unknown'}'s `vllm bench serve`, "
        f"{c['input_len']} prompt and {c['output_len']} output tokens (--ignore-eos, "
        f"temperature 0), seed {c['seed']} + repeat, {c['repeats']} repeats, "
        f"{c['warmups']}; prompts: {PROMPTS}.",
        "",
        "| config | concurrency | output tok/s median (every repeat) | vs unpatched (range) "
        "| TPOT p50 / p90 ms | TPOT vs unpatched | TTFT median ms | TTFT vs unpatched "
        "| host reads/token | swaps/token | failed requests |",
        "|---|---:|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        each = ", ".join(f"{x:.1f}" for x in r["decode_tok_s"])
        lines.append(
            f"| {r['variant']} | {r['concurrency']} | {_f(_median(r['decode_tok_s']))} "
            f"({each}) | {_x(r.get('decode_vs_unpatched'), r.get('decode_vs_unpatched_range'))} "
            f"| {_f(r['tpot_ms_p50'], '.2f')} / {_f(r['tpot_ms_p90'], '.2f')} "
            f"| {_x(r.get('tpot_p50_vs_unpatched'))} | {_f(r['ttft_ms'])} "
            f"| {_x(r.get('ttft_vs_unpatched'))} | {_f(r['host_reads_per_token'], '.2f')} "
            f"| {_f(r['swaps_per_token'], '.3f')} | {r['failed']} |"
        )
    lines += [
        "",
        f"Output tok/s: {THROUGHPUT_SOURCE}. offload-03-swap+stage is the compose files' "
        "default path (one table, runtime swap, prefill staging). The raw vLLM results are "
        "in each configuration's folder beside this file.",
    ]
    lines += comparison_lines(doc.get("comparison"))
    if doc.get("failed"):
        lines += ["", "Failed:", *[f"- {x}" for x in doc["failed"]]]
    return "\n".join(lines) + "\n"


def comparison_lines(comp: dict[str, Any] | None) -> list[str]:
    if not comp:
        return []
    name = comp["project_client"]
    out = [
        "",
        f"## Beside {name}",
        "",
        f"The default path against unpatched, by `vllm bench serve` and by {name} "
        f"(`{comp['with']}`). Agree: the ranges over the repeats overlap.",
        "",
        f"| concurrency | vllm bench serve | {name} | difference | agree "
        f"| host reads/token (vllm bench serve / {name}) |",
        "|---:|---|---|---|---|---|",
    ]
    for r in comp["rows"]:
        theirs = _x(r["project_client"], r["project_client_range"])
        if r.get("project_single_prompt") is not None:
            single = _x(r["project_single_prompt"], r.get("project_single_prompt_range"))
            theirs += f"; one prompt alone {single}"
        agree = {True: "yes", False: "**no**", None: "-"}[r["agree"]]
        diff = "-" if r.get("difference") is None else f"{r['difference']:+.1%}"
        reads = (
            f"{_f(r.get('vllm_client_host_reads_per_token'), '.2f')} / "
            f"{_f(r.get('project_client_host_reads_per_token'), '.2f')}"
        )
        out.append(
            f"| {r['concurrency']} | {_x(r['vllm_client'], r['vllm_client_range'])} "
            f"| {theirs} | {diff} | {agree} | {reads} |"
        )
    if any(r["agree"] is False for r in comp["rows"]):
        out += [
            "",
            "Where they disagree, the workloads differ first (docs/benchmarks.md, \"vLLM's "
            'own client beside ours"): random-token prompts route to other experts than the '
            "planted domains, so the runtime swap meets another mix (compare the host reads "
            "per token); vLLM's client counts prefill in its throughput and keeps the server "
            "busy continuously, bench-offload decodes one batch at a time inside the engine.",
        ]
    return out
