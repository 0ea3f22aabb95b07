# SPDX-License-Identifier: Apache-2.0
"""What scripts/soak concludes from a run, and how it writes it down: the swap self-check's
log lines, the probe set at start and end, VRAM and host RSS growth after warm-up, /metrics
against the client's own counts, the usage-count file, then soak.json, soak.md and soak.png.

Everything here works on plain data (log text, sample dicts, Prometheus snapshots), so the
CPU tests can check each conclusion without a server.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from eotools.counts import CountsError, load_counts

from .bench import prom

# patches/0008 (SwapRuntime.self_check): logger.info on success, logger.error on failure
SELF_CHECK_PASSED = "Expert offload: runtime swap self-check passed after"
SELF_CHECK_FAILED = "Expert offload: runtime swap self-check FAILED after"

REQUEST_SUCCESS = "vllm:request_success_total"
SWAP_DECISIONS = "vllm:expert_offload_swap_decisions_total"
# the counters kept per sample: vLLM's own request and token counters and the offload series
# of docs/metrics.md, each of which must never go down
WATCHED = (
    REQUEST_SUCCESS,
    prom.PROMPT_TOKENS,
    prom.GENERATION_TOKENS,
    prom.HOST_READS,
    prom.SWAPS,
    SWAP_DECISIONS,
)
GROWTH_LIMIT_PCT = 1.0
TAIL_SHARE = 0.2  # growth is judged on the maximum over the last 20% of the samples
# preempted requests may be prefilled again, which vLLM counts again: the prompt-token upper
# bound allows every prompt twice
PROMPT_RECOUNT = 2.0


def count_self_checks(log_text: str) -> dict[str, Any]:
    """Passes and failures of the runtime swap's self-check in the server's log (its first
    call only takes the reference fingerprints and logs nothing), with the first failures."""
    lines = log_text.splitlines()
    failed = [x.strip() for x in lines if SELF_CHECK_FAILED in x]
    passes = sum(SELF_CHECK_PASSED in x for x in lines)
    return {"passes": passes, "failures": len(failed), "failure_lines": failed[:5]}


def compare_probes(first: Sequence[dict], last: Sequence[dict]) -> list[dict]:
    """Per probe: greedy token ids at the end identical to those at the start, else the first
    differing position with both tokens and both logprobs (a near tie or a wrong expert)."""
    out = []
    for a, b in zip(first, last, strict=True):
        row: dict[str, Any] = {"name": a["name"], "tokens": len(a["token_ids"])}
        row["error"] = a.get("error") or b.get("error")
        row["identical"] = row["error"] is None and a["token_ids"] == b["token_ids"]
        if not row["identical"] and row["error"] is None:
            row.update(first_difference(a, b))
        out.append(row)
    return out


def first_difference(a: dict, b: dict) -> dict[str, Any]:
    """Where two probe answers part: position, each side's token and logprob there."""
    ids_a, ids_b = a["token_ids"], b["token_ids"]
    pos = next(
        (i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
        min(len(ids_a), len(ids_b)),
    )

    def at(seq: Sequence, i: int) -> Any:
        return seq[i] if i < len(seq) else None

    return {
        "first_diff": pos,
        "start": {"token": at(ids_a, pos), "logprob": at(a.get("logprobs") or [], pos)},
        "end": {"token": at(ids_b, pos), "logprob": at(b.get("logprobs") or [], pos)},
    }


def growth(samples: Sequence[dict], key: str, start: float, warm: float, end: float) -> dict:
    """Growth of `key` after warm-up, in %: (max over the last 20% of the traffic's samples -
    the value at warm-up end) / the value at warm-up end; None with a reason when too few
    samples fall after warm-up to say. Also min/max/first/last over the traffic."""
    during = [s for s in samples if start <= s["t"] <= end and s.get(key) is not None]
    after = [s for s in during if s["t"] >= warm]
    out: dict[str, Any] = {"pct": None, "samples": len(during), "after_warmup": len(after)}
    if during:
        values = [s[key] for s in during]
        out.update(min=min(values), max=max(values), first=values[0], last=values[-1])
    if len(after) < 2 or not after[0][key]:
        out["reason"] = "fewer than two samples after warm-up"
        return out
    tail = after[-min(len(after), max(1, math.ceil(TAIL_SHARE * len(during)))) :]
    base, top = after[0][key], max(s[key] for s in tail)
    out.update(at_warmup_end=base, tail_max=top, pct=(top - base) / base * 100)
    return out


def watched(snap: prom.Snapshot | None) -> dict[str, float | None]:
    """The watched counters' totals over all label sets (None: not exposed or no scrape)."""
    if snap is None:
        return dict.fromkeys(WATCHED)
    return {name: prom.total(snap.counters, name) for name in WATCHED}


def by_label(counters: dict[str, float], name: str, label: str) -> dict[str, float]:
    """One counter's values summed per value of one label (request_success by reason)."""
    out: dict[str, float] = {}
    pattern = re.compile(rf'{label}="([^"]*)"')
    for key, value in counters.items():
        if prom.key_name(key) == name:
            m = pattern.search(key)
            value_of = m.group(1) if m else ""
            out[value_of] = out.get(value_of, 0.0) + value
    return out


def client_counts(records: Sequence[dict]) -> dict[str, int]:
    """What the client sent and saw, over every request (probes too) between the first and
    the last scrape: the numbers vLLM's counters are checked against."""
    answered = [r for r in records if r["generated"] > 0]
    return {
        "requests": len(records),
        "completed": sum(r["completed"] for r in records),
        "cancelled": sum(r["cancelled"] for r in records),
        "errors": sum(r["error"] is not None for r in records),
        "prompt_tokens_sent": sum(r["prompt_tokens"] for r in records),
        "prompt_tokens_answered": sum(r["prompt_tokens"] for r in answered),
        "generated": sum(r["generated"] for r in records),
        "max_tokens": sum(r["max_tokens"] for r in records),
    }


def _check(name: str, passed: bool, **numbers: Any) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), **numbers}


def _delta(first: prom.Snapshot, last: prom.Snapshot, name: str) -> float | None:
    a, b = prom.total(first.counters, name), prom.total(last.counters, name)
    return None if b is None else b - (a or 0.0)


def metrics_checks(
    first: prom.Snapshot, last: prom.Snapshot, series: Sequence[dict], client: dict[str, int]
) -> list[dict]:
    """vLLM's own counters over the soak against the client's counts, every watched counter
    non-decreasing over all scrapes, and the runtime swap having swapped. Each check keeps
    its numbers, so a failure says by how much."""
    before = by_label(first.counters, REQUEST_SUCCESS, "finished_reason")
    after = by_label(last.counters, REQUEST_SUCCESS, "finished_reason")
    reasons = {k: v - before.get(k, 0.0) for k, v in after.items()}
    finished = reasons.get("stop", 0.0) + reasons.get("length", 0.0)
    prompt = _delta(first, last, prom.PROMPT_TOKENS)
    gen = _delta(first, last, prom.GENERATION_TOKENS)
    lo_p, hi_p = client["prompt_tokens_answered"], PROMPT_RECOUNT * client["prompt_tokens_sent"]
    swaps, decisions = _delta(first, last, prom.SWAPS), _delta(first, last, SWAP_DECISIONS)
    return [
        # a cancelled request may still finish before its abort reaches the engine
        _check(
            "request_success",
            client["completed"] <= finished <= client["completed"] + client["cancelled"],
            server_finished=finished,
            by_reason=reasons,
            client_completed=client["completed"],
            client_cancelled=client["cancelled"],
        ),
        _check(
            "prompt_tokens",
            prompt is not None and lo_p <= prompt <= hi_p,
            server=prompt,
            client_answered=lo_p,
            upper_bound=hi_p,
        ),
        # cancelled requests generate more than the client received, never more than asked
        _check(
            "generation_tokens",
            gen is not None and client["generated"] <= gen <= client["max_tokens"],
            server=gen,
            client_received=client["generated"],
            client_max_tokens=client["max_tokens"],
        ),
        monotonic_check(series),
        _check(
            "swaps_advanced",
            bool(swaps and swaps > 0 and decisions and decisions > 0),
            swaps=swaps,
            decisions=decisions,
            host_reads=_delta(first, last, prom.HOST_READS),
        ),
    ]


def monotonic_check(series: Sequence[dict]) -> dict[str, Any]:
    """Every watched counter never goes down from one scrape to the next (a restarted engine
    or a broken snapshot would); the counters that did are named with where."""
    backwards: dict[str, dict] = {}
    for name in WATCHED:
        values = [(s["t"], s[name]) for s in series if s.get(name) is not None]
        for (_, v0), (t1, v1) in zip(values, values[1:], strict=False):
            if v1 < v0:
                backwards[name] = {"t": t1, "before": v0, "after": v1}
                break
    ok = not backwards
    return _check("counters_non_decreasing", ok, scrapes=len(series), went_down=backwards)


def count_file_paths(path: pathlib.Path) -> list[pathlib.Path]:
    """The usage-count files of VLLM_EXPERT_COUNT_FILE=path: the path itself with one rank,
    `stem[.dpN][.ppN]suffix` with several (patches/0003, rank_file_path)."""
    if path.exists():
        return [path]
    return sorted(path.parent.glob(f"{path.stem}.*p[0-9]*{path.suffix}"))


def check_counts_file(path: pathlib.Path) -> dict[str, Any]:
    """The usage counts the server writes at shutdown: present, in the counts format, and
    with decode and prefill picks (a server that counted nothing did not count)."""
    files = count_file_paths(path)
    out: dict[str, Any] = {"counts_file": [str(f) for f in files], "passed": False}
    if not files:
        out["error"] = f"no {path} (nor a per-rank file beside it)"
        return out
    try:
        counts = [load_counts(f) for f in files]
    except CountsError as e:
        out["error"] = str(e)
        return out
    out["decode_picks"] = int(sum(int(c.decode.sum()) for c in counts))
    out["prefill_picks"] = int(sum(int(c.prefill.sum()) for c in counts))
    out["tokens"] = {p: sum(c.tokens(p) for c in counts) for p in ("prefill", "decode")}
    out["passed"] = out["decode_picks"] > 0 and out["prefill_picks"] > 0
    return out


def traffic_totals(records: Sequence[dict]) -> dict[str, Any]:
    """The soak's traffic (probes left out): requests, how they ended, tokens, per kind."""
    mine = [r for r in records if r["kind"] != "probe"]
    c = client_counts(mine)
    out: dict[str, Any] = {k: c[k] for k in ("requests", "completed", "cancelled", "errors")}
    out.update(prompt_tokens=c["prompt_tokens_sent"], generated_tokens=c["generated"])
    out["by_kind"] = {}
    for r in mine:
        k = out["by_kind"].setdefault(r["kind"], {"requests": 0, "cancelled": 0, "errors": 0})
        k["requests"] += 1
        k["cancelled"] += r["cancelled"]
        k["errors"] += r["error"] is not None
    out["first_errors"] = [r["error"] for r in mine if r["error"]][:10]
    return out


def checks(doc: dict) -> dict[str, bool]:
    """The soak's verdicts, each from the document's own numbers."""
    growth_ok = {
        k: doc["growth"][k]["pct"] is not None and doc["growth"][k]["pct"] < GROWTH_LIMIT_PCT
        for k in ("vram", "rss")
    }
    shutdown = doc["shutdown"]
    return {
        "self_check_ran": doc["self_check_passes"] > 0,
        "self_check_no_failures": doc["self_check_failures"] == 0,
        "probes_identical": bool(doc["probes"]["compare"])
        and all(p["identical"] for p in doc["probes"]["compare"]),
        "no_request_errors": doc["traffic"]["errors"] == 0 and doc["traffic"]["requests"] > 0,
        "duration_reached": doc["duration_s"] >= 0.99 * doc["settings"]["args"]["duration_s"],
        "vram_flat": growth_ok["vram"],
        "rss_flat": growth_ok["rss"],
        "metrics_consistent": bool(doc["metrics_checks"])
        and all(c["passed"] for c in doc["metrics_checks"]),
        "clean_shutdown": shutdown.get("exit_code") == 0 and not shutdown.get("killed"),
        "usage_counts_written": bool(shutdown.get("counts", {}).get("passed")),
    }


def judge_interrupted(doc: dict, log_text: str) -> dict:
    """A run that stopped before its end (the host taken away, the soak killed): judge what
    soak.json and the server log hold. The traffic counts up to the last sample; the probes
    at the end, the final /metrics scrape and the shutdown never happened, so their checks
    fail, as does the duration, and the document stays `"complete": false`."""
    samples = doc.get("samples") or []
    w = dict(doc.get("window") or {})
    traffic = [x["t"] for x in samples if x.get("phase") == "traffic"]
    w.setdefault("traffic_start", traffic[0] if traffic else 0.0)
    w.setdefault("warmup_end", w["traffic_start"] + doc.get("warmup_s", 0.0))
    w.setdefault("traffic_end", traffic[-1] if traffic else w["traffic_start"])
    doc["window"] = w
    doc["duration_s"] = round(w["traffic_end"] - w["traffic_start"], 1)
    found = count_self_checks(log_text)
    doc.update(self_check_failures=found["failures"], self_check_passes=found["passes"])
    doc["self_check_failure_lines"] = found["failure_lines"]
    doc["growth"] = {
        name: growth(samples, key, w["traffic_start"], w["warmup_end"], w["traffic_end"])
        for name, key in (("vram", "vram_gib"), ("rss", "rss_gib"))
    }
    doc.setdefault("traffic", traffic_totals([]))
    doc["probes"] = {"compare": [], "note": "the run stopped before the probes at its end"}
    doc["metrics_checks"] = [
        {"name": "final scrape", "passed": False, "error": "the run stopped before it"}
    ]
    doc["shutdown"] = {"error": "the run stopped before the shutdown"}
    doc["checks"] = checks(doc)
    doc.update(passed=False, complete=False, interrupted=True)
    return doc


def _fmt(x: Any) -> str:
    """Numbers as a reader wants them: counts whole, measurements to 4 digits; a dict as
    `key value` pairs without its empty entries."""
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:.4g}"
    if isinstance(x, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in x.items() if v not in (None, {}, [])) or "-"
    return str(x)


def _check_numbers(doc: dict) -> dict[str, str]:
    """The numbers behind each verdict, for the Markdown table."""
    g, sd = doc["growth"], doc["shutdown"]
    compare, wanted = doc["probes"]["compare"], doc["settings"]["args"]["duration_s"]
    bad = [m["name"] for m in doc["metrics_checks"] if not m["passed"]]
    return {
        "self_check_ran": f"{doc['self_check_passes']} passes",
        "self_check_no_failures": f"{doc['self_check_failures']} failures",
        "probes_identical": f"{sum(p['identical'] for p in compare)} of {len(compare)} identical",
        "no_request_errors": f"{doc['traffic']['errors']} errors in {doc['traffic']['requests']}",
        "duration_reached": f"{doc['duration_s']:.0f} s of {wanted} s",
        "vram_flat": f"{_fmt(g['vram']['pct'])} % (limit {GROWTH_LIMIT_PCT} %)",
        "rss_flat": f"{_fmt(g['rss']['pct'])} % (limit {GROWTH_LIMIT_PCT} %)",
        "metrics_consistent": "failed: " + ", ".join(bad) if bad else "all consistent",
        "clean_shutdown": f"exit {sd.get('exit_code')}, {_fmt(sd.get('seconds'))} s"
        + (", killed" if sd.get("killed") else ""),
        "usage_counts_written": _fmt(
            {k: sd.get("counts", {}).get(k) for k in ("decode_picks", "prefill_picks", "error")}
        ),
    }


def markdown(doc: dict) -> str:
    """soak.md: the verdict, a table of the checks with their numbers (failures named first),
    the traffic, growth, probes and /metrics checks, and the command."""
    verdict = "PASSED" if doc.get("passed") else "FAILED"
    failed = [k for k, v in doc["checks"].items() if not v]
    if doc.get("interrupted"):
        verdict = "INTERRUPTED (judged up to its last sample)"
    lines = [f"# Soak: {verdict}", ""]
    if failed:
        lines += [f"Failed checks: {', '.join(failed)}.", ""]
    lines += [
        f"{doc['date']}, {doc['gpu']}, model `{doc['model']['path']}` ({doc['model']['layers']} "
        f"layers, {doc['model']['host_experts_per_layer']} host experts per layer), "
        f"{doc['duration_s']:.0f} s of traffic after {doc['warmup_s']} s of warm-up.",
        "",
        "| check | result | numbers |",
        "|---|---|---|",
    ]
    numbers = _check_numbers(doc)
    for name, ok in doc["checks"].items():
        lines.append(f"| {name} | {'pass' if ok else '**FAIL**'} | {numbers.get(name, '')} |")
    lines += ["", *traffic_lines(doc["traffic"]), "", *growth_lines(doc["growth"]), ""]
    lines += [*probe_lines(doc["probes"]["compare"]), "", *metrics_lines(doc["metrics_checks"])]
    lines += ["", "Command:", "", "    " + " ".join(doc["command"]), ""]
    return "\n".join(lines)


def traffic_lines(t: dict) -> list[str]:
    out = [
        f"Traffic: {t['requests']} requests, {t['completed']} completed, {t['cancelled']} "
        f"cancelled, {t['errors']} errors; {t['prompt_tokens']} prompt tokens, "
        f"{t['generated_tokens']} generated tokens received.",
        "",
        "| kind | requests | cancelled | errors |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {k} | {v['requests']} | {v['cancelled']} | {v['errors']} |"
        for k, v in sorted(t["by_kind"].items())
    ]
    return out + [f"- error: {e}" for e in t.get("first_errors", [])]


def growth_lines(g: dict) -> list[str]:
    out = ["| series | first | at warm-up end | max, last 20% | last | growth |"]
    out.append("|---|---|---|---|---|---|")
    for name, unit in (("vram", "VRAM GiB"), ("rss", "host RSS GiB")):
        r = g[name]
        cells = [_fmt(r.get(k)) for k in ("first", "at_warmup_end", "tail_max", "last")]
        pct = f"{r['pct']:.3f} %" if r["pct"] is not None else r.get("reason", "unknown")
        out.append(f"| {unit} | {' | '.join(cells)} | {pct} |")
    return out


def probe_lines(compare: Sequence[dict]) -> list[str]:
    out = ["| probe | greedy tokens at start and end |", "|---|---|"]
    for p in compare:
        if p["identical"]:
            what = f"identical ({p['tokens']} tokens)"
        elif p.get("error"):
            what = f"**error**: {p['error']}"
        else:
            s, e = p["start"], p["end"]
            what = (
                f"**differ** at token {p['first_diff']}: {s['token']} (logprob "
                f"{_fmt(s['logprob'])}) then {e['token']} (logprob {_fmt(e['logprob'])})"
            )
        out.append(f"| {p['name']} | {what} |")
    return out


def metrics_lines(items: Sequence[dict]) -> list[str]:
    out = ["| /metrics check | result | numbers |", "|---|---|---|"]
    for c in items:
        numbers = {k: v for k, v in c.items() if k not in ("name", "passed")}
        out.append(f"| {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {_fmt(numbers)} |")
    return out


def plot(doc: dict, path: pathlib.Path) -> str | None:
    """soak.png: VRAM, host RSS and the concurrency over time, warm-up end marked. None when
    matplotlib is missing (the caller says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = doc["samples"]
    t = [x["t"] for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    panels = (("vram_gib", "VRAM used, GiB"), ("rss_gib", "server host RSS, GiB"))
    for ax, (key, label) in zip(axes, panels, strict=False):
        ax.plot(t, [x.get(key) for x in s], marker=".")
        ax.set_ylabel(label)
    axes[2].step(t, [x.get("target") for x in s], where="post", label="target")
    axes[2].plot(t, [x.get("inflight") for x in s], ".", label="in flight")
    axes[2].set_ylabel("concurrency")
    axes[2].legend(loc="upper right")
    axes[2].set_xlabel("seconds since the server answered")
    window = doc.get("window") or {}
    for ax in axes:
        if window.get("warmup_end") is not None:
            ax.axvline(window["warmup_end"], color="gray", linestyle="--")
        if window.get("traffic_end") is not None:
            ax.axvline(window["traffic_end"], color="gray", linestyle=":")
    name = pathlib.Path(doc["model"]["path"]).name
    axes[0].set_title(f"soak: {name} on {doc['gpu']}; dashed: warm-up end, dotted: traffic end")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def write_json(doc: dict, out: pathlib.Path) -> None:
    """soak.json, replaced atomically: a reader (or a run cut short) sees a whole file."""
    tmp = out / ".soak.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(out / "soak.json")
