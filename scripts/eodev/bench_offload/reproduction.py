# SPDX-License-Identifier: Apache-2.0
"""Whether a run's ratios can be trusted to repeat: each against an earlier run's
(--compare-with), and the run's unpatched engines against each other (one well off the others'
median lifts or lowers every ratio taken against it)."""

from __future__ import annotations

import numpy as np

# how far one unpatched engine's decode speed may sit from the median of a run's unpatched
# engines before the report says so (repeats inside one engine spread by up to 10%)
BASELINE_TOLERANCE = 0.10


def unpatched_speeds(doc: dict) -> dict[str, dict[str, float]]:
    """Each unpatched engine of a run (with --group, one per unit, by its label) and its
    median decode tok/s per workload."""
    by_label: dict[str, dict[str, float]] = {}
    for r in doc["runs"]:
        if r["config"] == "unpatched" and r.get("decode_tok_s"):
            label = r.get("variant", "unpatched")
            by_label.setdefault(label, {})[r["workload"]] = float(np.median(r["decode_tok_s"]))
    return by_label


def reproduction(doc: dict, previous: dict) -> list[dict]:
    """Each configuration x workload of `doc` against the same row of an earlier run of the
    suite (a second run should reproduce each ratio within the spread the first reports).
    A row is reproduced when this run's ratio lies within the earlier run's per-repeat
    range; rows without a range on both sides, or whose engines ran different paths (one
    table on a different number of layers), are listed, undecided."""

    def rows(d: dict) -> dict:
        return {
            (r.get("variant", r["config"]), r["workload"]): r
            for r in d["runs"]
            if r["config"] != "unpatched" and r.get("decode_vs_unpatched") is not None
        }

    before, now = rows(previous), rows(doc)
    out = []
    for key in [k for k in now if k in before]:
        a, b = before[key], now[key]
        lo_hi = a.get("decode_vs_unpatched_range")
        within = None if not lo_hi else bool(lo_hi[0] <= b["decode_vs_unpatched"] <= lo_hi[1])
        paths = a.get("one_table_layers"), b.get("one_table_layers")
        differ = None not in paths and paths[0] != paths[1]
        out.append(
            {
                "config": key[0],
                "workload": key[1],
                "before": a["decode_vs_unpatched"],
                "before_range": lo_hi,
                "now": b["decode_vs_unpatched"],
                "now_range": b.get("decode_vs_unpatched_range"),
                "reproduced": None if differ else within,
                "baseline_off": [baseline_offset(previous, a), baseline_offset(doc, b)],
                **({"one_table_layers": list(paths)} if differ else {}),
            }
        )
    return out


def baseline_offset(doc: dict, row: dict) -> float | None:
    """How far the unpatched engine that ``row``'s ratio divides by decoded from the median
    of ``doc``'s unpatched engines (same workload), as a fraction: -0.23 for the slow
    group-1 engine of one 2026-12-01 run. Its speed is the row's median over its ratio, so
    rows of runs made before rows named their baseline work too. None with fewer than two
    unpatched engines to compare."""
    ratio, mine = row.get("decode_vs_unpatched"), row.get("decode_tok_s")
    bases = [v[row["workload"]] for v in unpatched_speeds(doc).values() if row["workload"] in v]
    if not ratio or not mine or len(bases) < 2:
        return None
    return float(np.median(mine)) / ratio / float(np.median(bases)) - 1


def reproduction_lines(doc: dict) -> list[str]:
    """The --compare-with section: each ratio beside the earlier run's, and whether it lies
    within the earlier run's per-repeat range."""
    rep = doc.get("reproduction")
    if not rep:
        return []

    def cell(ratio: float, rng: list[float] | None) -> str:
        return f"{ratio:.3f}x" + (f" ({rng[0]:.3f}-{rng[1]:.3f})" if rng else "")

    def off(x: float | None) -> str:
        flag = "**" if x is not None and abs(x) > BASELINE_TOLERANCE else ""
        return "-" if x is None else f"{flag}{x:+.0%}{flag}"

    def flagged(r: dict) -> bool:
        return any(x is not None and abs(x) > BASELINE_TOLERANCE for x in r.get("baseline_off", []))

    misses = [r for r in rep["rows"] if r["reproduced"] is False]
    lines = [
        "",
        f"Against the earlier run `{rep['against']}` ({rep['against_date']}): "
        f"{sum(r['reproduced'] is True for r in rep['rows'])} of {len(rep['rows'])} ratios "
        "within that run's per-repeat range"
        + (
            f"; {sum(flagged(r) for r in misses)} of the {len(misses)} outside it divide by an "
            f"unpatched engine more than {BASELINE_TOLERANCE:.0%} off its run's median."
            if misses
            else "."
        ),
        "",
        "| config | workload | earlier run (repeats) | this run (repeats) | within | "
        "its unpatched engine vs its run's median (earlier / this) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        verdict = {True: "yes", False: "**no**", None: "no range"}[r["reproduced"]]
        if "one_table_layers" in r:  # not the same path: no verdict
            verdict = "not the same path (one table on {} then {} layers)".format(
                *r["one_table_layers"]
            )
        base_off = r.get("baseline_off") or [None, None]
        lines.append(
            f"| {r['config']} | {r['workload']} | {cell(r['before'], r['before_range'])} | "
            f"{cell(r['now'], r['now_range'])} | {verdict} | "
            f"{off(base_off[0])} / {off(base_off[1])} |"
        )
    return lines


def baseline_lines(doc: dict) -> list[str]:
    """The run's unpatched engines side by side (with --group, one per unit). They run the
    same configuration, so they should agree; one that decodes well off the others' median
    lifts (or lowers) every ratio of its unit by about as much. In one run of 2026-12-01 one of
    three decoded 23% below the others for its whole life, and its unit's ratios could not be
    reproduced."""
    by_label = unpatched_speeds(doc)
    if len(by_label) < 2:
        return []
    workloads = [w for w in ("fresh", "repeat") if all(w in v for v in by_label.values())]
    if not workloads:
        return []
    medians = {w: float(np.median([v[w] for v in by_label.values()])) for w in workloads}
    spread = " / ".join(
        f"{max(v[w] for v in by_label.values()) / min(v[w] for v in by_label.values()):.2f}x"
        for w in workloads
    )
    lines = [
        "",
        f"Unpatched engines of this run, decode tok/s ({' / '.join(workloads)}): "
        + "; ".join(
            f"{label} {' / '.join(f'{v[w]:.1f}' for w in workloads)}"
            for label, v in by_label.items()
        )
        + f" ({spread} apart).",
    ]
    for label, v in by_label.items():
        for w in workloads:
            off = v[w] / medians[w] - 1
            if abs(off) > BASELINE_TOLERANCE:
                lines += [
                    "",
                    f"WARNING: {label} decoded {abs(off):.0%} "
                    f"{'below' if off < 0 else 'above'} the median of this run's unpatched "
                    f"engines on {w} prompts: the ratios against it are "
                    f"{'lifted' if off < 0 else 'lowered'} by about as much.",
                ]
    return lines
