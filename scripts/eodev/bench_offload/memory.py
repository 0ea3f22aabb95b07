# SPDX-License-Identifier: Apache-2.0
"""What a configuration saves and holds in VRAM against its unpatched engine: the VRAM saved
beside the expert bytes it placed on host, and what it holds beside its weights (tensor groups
and allocation sites); with the report's lines on each."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ..engine_probe import expert_block_slack


def vram_bytes(mem: dict) -> int:
    """The engine process's VRAM where the driver reported it, else the device's used memory
    (the earliest runs of 2026-12-01 have only that)."""
    return mem.get("process_vram_bytes") or mem["device_used_bytes"]


def vram_saved(mem: dict, base: dict | None) -> dict | None:
    """What a configuration saves in VRAM against its unpatched engine, beside the expert
    bytes it placed on host: the process's VRAM (the driver's), torch's allocated and
    reserved bytes, and, where the probe recorded them, how far the expert weights'
    allocator blocks exceed their tensors' bytes in each engine (torch counts whole
    blocks) and the free bytes each engine's allocator strands in partly used segments
    (the process's VRAM counts them, torch's allocated bytes do not)."""
    if base is None or base is mem or not mem.get("expert_host_bytes"):
        return None
    out = {
        "host_bytes": mem["expert_host_bytes"],
        "process_vram": vram_bytes(base) - vram_bytes(mem),
    }
    # one table's expert rows live in VMM ranges, outside torch's allocator
    if not mem.get("one_table_layers") and "torch_allocated_bytes" in mem.keys() & base.keys():
        out["torch_allocated"] = base["torch_allocated_bytes"] - mem["torch_allocated_bytes"]
    if not mem.get("one_table_layers") and "torch_reserved_bytes" in mem.keys() & base.keys():
        out["torch_reserved"] = base["torch_reserved_bytes"] - mem["torch_reserved_bytes"]
    if "stranded_free" in mem.keys() & base.keys():
        out["stranded_free"] = mem["stranded_free"]["stranded_bytes"]
        out["unpatched_stranded_free"] = base["stranded_free"]["stranded_bytes"]
        top = mem["stranded_free"].get("top")
        if top and top[0].get("live"):
            out["stranded_worst_segment"] = top[0]
    mine, theirs = mem.get("weight_blocks"), base.get("weight_blocks")
    if mine and theirs:
        out["expert_block_slack"] = expert_block_slack(mine)
        out["unpatched_expert_block_slack"] = expert_block_slack(theirs)
    return out


def vram_saved_lines(doc: dict) -> list[str]:
    """One line per configuration with experts on host: the VRAM it saved against the
    bytes it placed there (the target is within 2%), and the block slack where
    recorded."""
    lines = []
    for r in doc["runs"]:
        saved = r.get("vram_saved")
        if r["workload"] != "fresh" or not saved:
            continue
        host, pv = saved["host_bytes"], saved["process_vram"]
        parts = [f"{pv:,} B of the process's VRAM ({pv / host:.1%})"]
        if "torch_allocated" in saved:
            ta = saved["torch_allocated"]
            parts.append(f"{ta:,} B of torch's allocated bytes ({ta / host:.1%})")
        if "torch_reserved" in saved:
            tr = saved["torch_reserved"]
            parts.append(f"{tr:,} B of its reserved bytes ({tr / host:.1%})")
        line = (
            f"VRAM saved by {r.get('variant', r['config'])} for {host:,} B of experts on "
            f"host: {'; '.join(parts)}."
        )
        if "expert_block_slack" in saved:
            line += (
                f" Its expert weights' allocator blocks hold {saved['expert_block_slack']:,} B "
                f"more than their tensors asked for (unpatched: "
                f"{saved['unpatched_expert_block_slack']:,} B)."
            )
        if "stranded_free" in saved:
            line += (
                f" Free memory the allocator holds in segments it cannot give back: "
                f"{saved['stranded_free']:,} B (unpatched: "
                f"{saved['unpatched_stranded_free']:,} B)."
            )
        worst = saved.get("stranded_worst_segment")
        if worst:
            beside = ", ".join(
                f"{b['name'] or 'a tensor'} ({b['bytes']:,} B)" for b in worst["live"]
            )
            line += (
                f" The worst segment, {worst['segment_bytes']:,} B, has "
                f"{worst['free_bytes']:,} B free beside {beside}."
            )
        lines += ["", line]
    return lines


def census_diff(mine: dict | None, base: dict | None, top: int = 8) -> dict | None:
    """What an engine holds on the GPU beside its weights that its unpatched engine does
    not (both from the probe's census): the difference of the totals, and the tensor
    groups (shape, dtype) of which it holds more, largest first."""
    return _groups_diff(mine, base, lambda g: (tuple(g["shape"]), g["dtype"]), top)


def sites_diff(mine: dict | None, base: dict | None, top: int = 8) -> dict | None:
    """The same for the allocation sites (EO_ALLOC_HISTORY=1): the code locations at which
    an engine holds more GPU memory beside its weights than its unpatched engine."""
    return _groups_diff(mine, base, lambda g: g["site"], top)


def _groups_diff(
    mine: dict | None, base: dict | None, key: Callable[[dict], Hashable], top: int
) -> dict | None:
    """The groups (by `key`) of which `mine` holds more bytes than `base`, largest first,
    and the difference of the bytes both hold beside their weights."""
    if not mine or not base or mine is base:
        return None
    theirs = {key(g): g for g in base["top"]}
    extra = []
    for g in mine["top"]:
        if _aliased(g):
            continue
        other = theirs.get(key(g), {"count": 0, "bytes": 0})
        if g["bytes"] > other["bytes"]:
            extra.append(
                {**g, "count": g["count"] - other["count"], "bytes": g["bytes"] - other["bytes"]}
            )
    extra.sort(key=lambda g: -g["bytes"])
    aliased = sum(g["bytes"] for g in mine["top"] if _aliased(g))
    delta = mine["other_bytes"] - aliased - base["other_bytes"]
    return {"other_bytes_delta": delta, "extra": extra[:top]}


def _aliased(group: dict) -> bool:
    """A census group that only alias ranges hold (prefill staging's second address of a
    one-table layer's VRAM): memory the table and the slots already count. The probe
    leaves these out since it learned of them; runs made before list them."""
    held = group.get("held_by") or []
    return bool(held) and all(h.startswith("AliasRange.") for h in held)


def census_lines(doc: dict, threshold: int = 1 << 20) -> list[str]:
    """One line per configuration that holds more than ``threshold`` bytes beside its
    weights over its unpatched engine, naming the largest extra tensor groups; one more
    naming the code that allocated them where the engines recorded it."""
    lines = []

    def tensors(g: dict) -> str:
        held = f", held by {', '.join(g['held_by'])}" if g.get("held_by") else ""
        return f"{g['count']} x {g['dtype']}{g['shape']} ({g['bytes'] / 1e6:.1f} MB{held})"

    def site(g: dict) -> str:
        return f"{g['site']} ({g['count']:+d} blocks, {g['bytes'] / 1e6:.1f} MB)"

    kinds = [
        (
            "census_vs_unpatched",
            tensors,
            "Beside its weights, {name} holds {mb:.1f} MB more GPU memory in tensors than "
            "its unpatched engine: {what}.",
            "no single group of tensors stands out",
        ),
        (
            "alloc_sites_vs_unpatched",
            site,
            "Allocated beside its weights, {name} holds {mb:.1f} MB more than its unpatched "
            "engine, made at: {what}.",
            "no single site stands out",
        ),
    ]
    for field, fmt, sentence, nothing in kinds:
        for r in doc["runs"]:
            diff = r.get(field)
            if r["workload"] != "fresh" or not diff or diff["other_bytes_delta"] <= threshold:
                continue
            what = "; ".join(fmt(g) for g in diff["extra"][:4]) or nothing
            name = r.get("variant", r["config"])
            lines += ["", sentence.format(name=name, mb=diff["other_bytes_delta"] / 1e6, what=what)]
    return lines
