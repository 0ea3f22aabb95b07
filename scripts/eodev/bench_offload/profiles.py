# SPDX-License-Identifier: Apache-2.0
"""The decode profiles of --profile: each engine's, keyed by configuration (an unpatched
partner by the configurations it ran beside), and the report's section comparing each with its
unpatched partner's."""

from __future__ import annotations


def profiles(results: dict) -> dict:
    """Each engine's decode profile (--profile); an unpatched partner (--paired, --group) as
    'unpatched beside CONFIG[, CONFIG...]', once."""
    out = {}
    partners = {id(r["paired_base"]) for r in results.values() if r.get("paired_base")}
    seen = set()
    for (spec, rnd), res in results.items():
        suffix = f" (round {rnd})" if rnd > 1 else ""
        if res["spec"]["config"] == "unpatched":  # listed beside its configurations if a partner
            if id(res) not in partners and "profile" in res["tasks"]:
                out["unpatched" + suffix] = res["tasks"]["profile"]
            continue
        if "profile" in res["tasks"]:
            out[spec + suffix] = res["tasks"]["profile"]
        base = res.get("paired_base")
        if base is not None and "profile" in base["tasks"] and id(base) not in seen:
            seen.add(id(base))
            beside = ", ".join(base.get("partner_of") or [spec])
            out[f"unpatched beside {beside}{suffix}"] = base["tasks"]["profile"]
    return out


def _partner_profile(profs: dict, label: str) -> dict | None:
    """The profile of the unpatched engine that ran beside `label`, else the run's own."""
    spec, _, rnd = label.partition(" (round ")
    suffix = f" (round {rnd}" if rnd else ""
    for key, prof in profs.items():
        beside = key.removeprefix("unpatched beside ")
        if suffix:
            listed = beside.removesuffix(suffix).split(", ") if beside.endswith(suffix) else []
        else:  # round 1: no round in the name
            listed = [] if " (round " in beside else beside.split(", ")
        if key != beside and spec in listed:
            return prof
    return profs.get("unpatched" + suffix) or profs.get("unpatched")


def profile_lines(doc: dict, top: int = 6) -> list[str]:
    """The --profile section of the report: per engine, wall and GPU busy time per token;
    per configuration, the kernels whose time per token differs most from its unpatched
    partner's (--paired), else from the unpatched engine's."""
    profs = doc.get("profiles") or {}
    if not profs:
        return []
    lines = [
        "",
        "Decode profiles (torch profiler, CUDA activity; the profiler slows the host, so wall "
        "times compare only with each other):",
        "",
        "| engine | tokens | wall us/token | GPU busy us/token | GPU idle "
        "| largest kernels, us/token |",
        "|---|---|---|---|---|---|",
    ]
    for label, p in profs.items():
        if "error" in p:
            first = (p["error"].strip().splitlines() or [""])[0].replace("|", "\\|")
            lines.append(f"| {label} | - | - | - | - | profile failed: {first} |")
            continue
        big = ", ".join(f"`{k['name'][:40]}` {k['us_per_token']:.1f}" for k in p["kernels"][:3])
        reads = p.get("swap_delta", {}).get("host_reads")
        if reads is not None:  # the runtime swap's counters over the task, warm-up included
            big += f"; host reads in the task: {reads}"
        lines.append(
            f"| {label} | {p['tokens']} | {p['wall_us_per_token']:.1f} | "
            f"{p['gpu_busy_us_per_token']:.1f} | {p['gpu_idle_fraction']:.1%} | {big} |"
        )
    for label, p in profs.items():
        base = _partner_profile(profs, label)
        if label.startswith("unpatched") or base is None or "error" in p or "error" in base:
            continue
        mine = {k["name"]: k["us_per_token"] for k in p["kernels"]}
        theirs = {k["name"]: k["us_per_token"] for k in base["kernels"]}
        diff = sorted(
            ((n, mine.get(n, 0.0) - theirs.get(n, 0.0)) for n in mine.keys() | theirs.keys()),
            key=lambda x: -abs(x[1]),
        )[:top]
        busy = p["gpu_busy_us_per_token"] - base["gpu_busy_us_per_token"]
        wall = p["wall_us_per_token"] - base["wall_us_per_token"]
        lines += [
            "",
            f"{label} minus unpatched: wall {wall:+.1f} us/token, GPU busy "
            f"{busy:+.1f} us/token; kernels: "
            + ", ".join(f"`{n[:60]}` {d:+.1f}" for n, d in diff)
            + ".",
        ]
    return lines
