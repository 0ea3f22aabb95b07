"""The host-fraction sweep of a bench-offload run : offload-03 with runtime swap
against vLLM's --cpu-offload-gb at each cold-set size, as ratios to the unpatched engine
of the same run (or group), a markdown section and a plot.

A sweep point is a cold-set size (experts per layer): ``offload-03-swap:N`` and
``cpu-offload-gb:N``, or the plain configurations at the run's main size.
"""

from __future__ import annotations

import pathlib

from .configs import parse_spec

SWEPT = ("offload-03-swap", "cpu-offload-gb")


def _size(row: dict, main: int | None) -> int | None:
    """Experts per layer of a sweep row (as recorded, else N from ``CONFIG:N``, else the
    run's main size); None for a variant (``+hold``, ``@TREE``), which is no sweep point.
    ``+stage`` is one: prefill staging leaves decode's code as it is."""
    _, extras, tree, n = parse_spec(row.get("variant") or row["config"])
    if (extras and extras != "stage") or tree:
        return None
    return row.get("host_experts_per_layer") or n or main


def sweep_points(doc: dict) -> dict[tuple[str, str], list[dict]]:
    """(config, workload) -> the sweep's points in ascending cold-set size: host fraction,
    ratio to unpatched and its per-repeat range. Only sizes that both configurations
    ran at count, so every point has a partner to compare with."""
    main = (doc.get("model") or {}).get("host_experts_per_layer")
    rows: dict[tuple[str, str, int], dict] = {}
    for r in doc["runs"]:
        if r["config"] not in SWEPT or r.get("decode_vs_unpatched") is None:
            continue
        size = _size(r, main)
        if size is not None:
            rows[(r["config"], r["workload"], size)] = r
    out: dict[tuple[str, str], list[dict]] = {}
    for (config, workload, size), r in sorted(rows.items(), key=lambda kv: kv[0][2]):
        if all((c, workload, size) in rows for c in SWEPT):
            lo, hi = r.get("decode_vs_unpatched_range") or (None, None)
            out.setdefault((config, workload), []).append(
                {
                    "experts_per_layer": size,
                    "host_fraction": r["host_fraction"],
                    "ratio": r["decode_vs_unpatched"],
                    "low": lo,
                    "high": hi,
                }
            )
    return out


def sweep_lines(doc: dict) -> list[str]:
    """Markdown: each sweep point's two ratios and how much faster the swap is."""
    points = sweep_points(doc)
    workloads = sorted({w for _, w in points})
    if not points or len(points.get((SWEPT[0], workloads[0]), [])) < 2:
        return []
    lines = [
        "",
        "Host-fraction sweep (each ratio against the unpatched engine of its own group; "
        "host fractions as placed, per configuration):",
        "",
        "| experts on host per layer | workload | offload-03-swap (host fraction) | "
        "cpu-offload-gb (host fraction) | swap / cpu-offload-gb |",
        "|---|---|---|---|---|",
    ]
    for w in workloads:
        swap, cpu = (points.get((c, w), []) for c in SWEPT)
        for s, c in zip(swap, cpu, strict=True):
            lines.append(
                f"| {s['experts_per_layer']} | {w} | {s['ratio']:.3f}x ({s['host_fraction']:.3f}) "
                f"| {c['ratio']:.3f}x ({c['host_fraction']:.3f}) | "
                f"{s['ratio'] / c['ratio']:.2f}x |"
            )
    return lines


def plot_sweep(doc: dict, path: pathlib.Path) -> bool:
    """Decode speed against unpatched over the host fraction, one line per configuration
    and workload, whiskers over the repeats. False (nothing written) without a sweep."""
    points = sweep_points(doc)
    if not any(len(p) >= 2 for p in points.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (config, workload), pts in sorted(points.items()):
        x = [p["host_fraction"] for p in pts]
        y = [p["ratio"] for p in pts]
        err = [
            [p["ratio"] - (p["low"] if p["low"] is not None else p["ratio"]) for p in pts],
            [(p["high"] if p["high"] is not None else p["ratio"]) - p["ratio"] for p in pts],
        ]
        ax.errorbar(
            x,
            y,
            yerr=err,
            capsize=3,
            marker="o",
            color=f"C{SWEPT.index(config)}",
            linestyle="-" if workload == "fresh" else "--",
            label=f"{config}, {workload}",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("share of the routed experts' bytes in host memory")
    ax.set_ylabel("decode tok/s vs unpatched\n(median, min-max of repeats)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"host-fraction sweep, {doc['gpu']}")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True
