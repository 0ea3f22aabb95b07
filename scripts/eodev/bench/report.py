# SPDX-License-Identifier: Apache-2.0
"""Suite results: one run entry per (config, workload, streams), the suite JSON in the project's
format (every repeat and every raw request kept), its markdown table, a PNG plot, and the merge
of several servers' suite files with ratios against `unpatched`."""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
from collections.abc import Sequence

from . import metrics as m
from . import prom
from .configs import CONFIGS  # noqa: F401 (re-exported for the CLI)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def per_token(counter_diffs: Sequence[dict], name: str, tokens: int, seen: bool) -> float | None:
    """A counter's increase over the measured repeats per generated token (summed over its
    label sets); 0.0 when exposed but unchanged, None when the server does not expose it."""
    vals = [prom.total(d["counters"], name) for d in counter_diffs]
    if not seen or not tokens:
        return None
    return sum(v or 0.0 for v in vals) / tokens


def run_entry(
    *,
    config: str,
    workload: str,
    streams: int,
    records: list[dict],
    repeats_metrics: list[dict],
    metrics_seen: dict[str, bool],
    count_via: str,
    host_fraction: float | None,
    extra: dict,
) -> dict:
    """The run entry of one (workload, streams) of a suite: medians and percentiles over the
    measured requests, one decode speed per repeat, every raw record."""
    measured = [r for r in records if not r["warmup"] and r["error"] is None]
    reps = sorted({r["repeat"] for r in measured})
    by_rep = {k: [r for r in measured if r["repeat"] == k] for k in reps}
    tpot = m.percentiles(r["tpot_ms"] for r in measured)
    itl = m.percentiles(x for r in measured for x in r["itl_ms"])
    ttft = m.percentiles(r["ttft_ms"] for r in measured)
    tokens = sum(r["tokens"] for r in measured)
    server_tokens = [prom.total(d["counters"], prom.GENERATION_TOKENS) for d in repeats_metrics]
    entry = {
        "config": config,
        "workload": workload,
        "concurrency": streams,
        "host_fraction": host_fraction,
        "decode_tok_s": [m.decode_speed(by_rep[k]) for k in reps],
        "throughput_tok_s": [m.throughput(by_rep[k]) for k in reps],
        "tpot_ms_p50": tpot["p50"],
        "tpot_ms_p90": tpot["p90"],
        "tpot_ms_p99": tpot["p99"],
        "tpot_samples": tpot["n"],
        "itl_ms_p50": itl["p50"],
        "itl_ms_p90": itl["p90"],
        "itl_ms_p99": itl["p99"],
        "itl_samples": itl["n"],
        "ttft_ms": ttft["p50"],
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p90": ttft["p90"],
        "ttft_ms_p99": ttft["p99"],
        "ttft_samples": ttft["n"],
        "ttft_ms_by_repeat": [
            statistics.median(r["ttft_ms"] for r in by_rep[k]) if by_rep[k] else None for k in reps
        ],
        "prompt_tokens": (
            statistics.median(r["prompt_tokens"] for r in measured if r["prompt_tokens"])
            if any(r["prompt_tokens"] for r in measured)
            else None
        ),
        "generated_tokens": tokens,
        "server_generation_tokens": (
            sum(x for x in server_tokens if x is not None)
            if any(x is not None for x in server_tokens)
            else None
        ),
        "host_reads_per_token": per_token(
            repeats_metrics, prom.HOST_READS, tokens, metrics_seen.get(prom.HOST_READS, False)
        ),
        "swaps_per_token": per_token(
            repeats_metrics, prom.SWAPS, tokens, metrics_seen.get(prom.SWAPS, False)
        ),
        "host_reads_source": f"/metrics {prom.HOST_READS} difference over client-counted tokens",
        "token_count_source": count_via,
        "repeats": len(reps),
        "requests_per_repeat": len(by_rep[reps[0]]) if reps else 0,
        "prompts_reused": any(r.get("reused") for r in records if not r["warmup"]),
        "errors": sum(r["error"] is not None for r in records),
        "metrics": repeats_metrics,
        "requests": records,
    }
    entry.update(extra)
    return entry


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def add_ratios(doc: dict) -> dict:
    """Ratios of every run to the unpatched run of the same workload and streams (in place):
    decode speed (>1: faster), its range over the repeats (min/max .. max/min), TPOT p50 and
    TTFT p50 (<1: shorter)."""
    base = {
        (r["workload"], r.get("concurrency", 1)): r
        for r in doc["runs"]
        if r["config"] == "unpatched"
    }
    for r in doc["runs"]:
        b = base.get((r["workload"], r.get("concurrency", 1)))
        ratios = {
            "decode_vs_unpatched": None,
            "decode_vs_unpatched_range": None,
            "tpot_p50_vs_unpatched": None,
            "ttft_vs_unpatched": None,
        }
        if b is not None:
            d = [x for x in r["decode_tok_s"] if x]
            bd = [x for x in b["decode_tok_s"] if x]
            if d and bd:
                ratios["decode_vs_unpatched"] = _median(d) / _median(bd)
                ratios["decode_vs_unpatched_range"] = [min(d) / max(bd), max(d) / min(bd)]
            if r.get("tpot_ms_p50") and b.get("tpot_ms_p50"):
                ratios["tpot_p50_vs_unpatched"] = r["tpot_ms_p50"] / b["tpot_ms_p50"]
            if r.get("ttft_ms") and b.get("ttft_ms"):
                ratios["ttft_vs_unpatched"] = r["ttft_ms"] / b["ttft_ms"]
        r.update(ratios)
    return doc


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    lines = [
        f"# {doc['suite']} on {doc['gpu']} ({doc['date']})",
        "",
        f"Command: `{doc['command']}`",
        *[
            f"- {', '.join(s['configs'])}: `{s['command']}` ({s['date']})"
            for s in doc.get("sources", [])
        ],
        "",
        "| config | workload | streams | host fraction | decode tok/s median (every repeat) | "
        "vs unpatched (range) | TPOT p50 / p90 / p99 ms (n) | ITL p50 / p90 / p99 ms (n) | "
        "TTFT p50 ms (n) | prompt tokens | host reads/token | swaps/token | start-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        ratio = r.get("decode_vs_unpatched")
        rng = r.get("decode_vs_unpatched_range")
        ratio_s = "-" if ratio is None else f"{ratio:.3f}x ({rng[0]:.3f}-{rng[1]:.3f})"
        reps = ", ".join(_f(x) for x in r["decode_tok_s"])
        lines.append(
            f"| {r['config']} | {r['workload']} | {r.get('concurrency', 1)} | "
            f"{_f(r.get('host_fraction'), '.3f')} | {_f(_median(r['decode_tok_s']))} ({reps}) | "
            f"{ratio_s} | {_f(r['tpot_ms_p50'], '.2f')} / {_f(r['tpot_ms_p90'], '.2f')} / "
            f"{_f(r.get('tpot_ms_p99'), '.2f')} ({r.get('tpot_samples', '-')}) | "
            f"{_f(r.get('itl_ms_p50'), '.2f')} / {_f(r.get('itl_ms_p90'), '.2f')} / "
            f"{_f(r.get('itl_ms_p99'), '.2f')} ({r.get('itl_samples', '-')}) | "
            f"{_f(r['ttft_ms'])} ({r.get('ttft_samples', '-')}) | "
            f"{_f(r.get('prompt_tokens'), '.0f')} | {_f(r['host_reads_per_token'], '.3f')} | "
            f"{_f(r['swaps_per_token'], '.3f')} | {_f(r.get('startup_s'), '.0f')} |"
        )
    lines += [
        "",
        "Decode speed = (N - 1) / (tN - t1) per stream, one value per repeat (sum of N - 1 over "
        "the repeat's requests over the sum of their tN - t1); TPOT percentiles are over "
        "requests, ITL percentiles over consecutive token pairs, TTFT over requests; n is the "
        "sample count. Tokens are counted from "
        f"{', '.join(sorted({str(r.get('token_count_source')) for r in doc['runs']}))}. "
        "Host reads and swaps per token: /metrics counter differences over the measured "
        "repeats divided by the tokens the client counted. Ratios compare medians against the "
        "unpatched run of the same workload and streams; the range is min/max to max/min over "
        "the repeats.",
    ]
    if any(r.get("prompts_reused") for r in doc["runs"]):
        lines += ["", "Some fresh prompts were reused (the prompt file has too few)."]
    if any(r.get("errors") for r in doc["runs"]):
        lines += ["", "Some requests failed: see `errors` and the raw records in the JSON."]
    return "\n".join(lines) + "\n"


def save_figure(fig, path: pathlib.Path, dpi: int = 100) -> None:
    """Lay out, write and close a report's figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot(doc: dict, path: pathlib.Path) -> None:
    """Decode tok/s (median, whiskers min-max over repeats) and TTFT p50 of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    name = [r.get("variant") or r["config"] for r in runs]  # bench-offload's variants
    labels = [
        f"{n}\n{r['workload']} x{r.get('concurrency', 1)}" for n, r in zip(name, runs, strict=True)
    ]
    med = [_median(r["decode_tok_s"]) or 0.0 for r in runs]
    lo = [
        med[i] - min((x for x in r["decode_tok_s"] if x), default=0.0) for i, r in enumerate(runs)
    ]
    hi = [
        max((x for x in r["decode_tok_s"] if x), default=0.0) - med[i] for i, r in enumerate(runs)
    ]
    ttft = [r["ttft_ms"] or 0.0 for r in runs]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(runs) + 2), 7), sharex=True)
    x = range(len(runs))
    names = list(dict.fromkeys(name))
    colors = [f"C{names.index(n) % 10}" for n in name]
    a.bar(x, med, yerr=[lo, hi], capsize=3, color=colors)
    a.set_ylabel("decode tok/s per stream\n(median, min-max of repeats)")
    a.set_title(f"{doc['suite']} on {doc['gpu']}")
    b.bar(x, ttft, color=colors)
    b.set_ylabel("TTFT p50 ms")
    b.set_xticks(list(x))
    b.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    save_figure(fig, path)


def dumps(doc: object, indent: int = 0) -> str:
    """JSON with one key or item per line, but lists of plain values (token ids, per-repeat
    numbers, [time, tokens] pairs) on one line each."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(doc, dict) and doc:
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(doc, list) and doc and any(isinstance(x, dict | list) for x in doc):
        items = [f"{inner}{dumps(v, indent + 1)}" for v in doc]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(doc)


def write(doc: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """The suite JSON, its markdown table (.md) and plot (.png) next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(doc) + "\n")
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown(doc))
    try:
        plot(doc, png)
    except ImportError:  # results first: the plot can be made later with --merge of this file
        print(f"no plot: matplotlib is not installed (scripts/bench --merge {out} --out ...)")
        return [out, md]
    return [out, md, png]


def merge(paths: Sequence[pathlib.Path], command: str, suite: str | None = None) -> dict:
    """One suite document from the suite files of several servers, with ratios."""
    docs = [json.loads(p.read_text()) for p in paths]
    gpus = sorted({d.get("gpu", "unknown") for d in docs})
    models = [d.get("model") for d in docs]
    doc = {
        "suite": suite or docs[0]["suite"],
        "date": now_iso(),
        "gpu": gpus[0] if len(gpus) == 1 else " / ".join(gpus),
        "command": command,
        "model": models[0],
        "sources": [
            {
                "file": str(p),
                "date": d.get("date"),
                "command": d.get("command"),
                "gpu": d.get("gpu"),
                "server": d.get("server"),
                "configs": sorted({r["config"] for r in d["runs"]}),
            }
            for p, d in zip(paths, docs, strict=True)
        ],
        "runs": [r for d in docs for r in d["runs"]],
    }
    if any(x != models[0] for x in models):
        doc["model_mismatch"] = models
    if len(gpus) > 1:
        doc["gpu_mismatch"] = gpus
    return add_ratios(doc)
