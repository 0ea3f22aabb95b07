# SPDX-License-Identifier: Apache-2.0
"""A plan as the user reads it: a Markdown table per card and for the host, followed by what
to change where something does not fit; or JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..selection import GiB, MiB
from .estimate import Plan


def _g(n: int | float) -> str:
    """Bytes as the tables give them: GiB with two decimals."""
    return f"{n / GiB:.2f}"


def render_markdown(p: Plan) -> str:
    """The plan's tables, then one line per card that does not fit saying what to change,
    then the notes and where the allowance comes from."""
    s = p.serving
    lines = [
        f"Memory plan: {p.model or 'model'} on {s.name} (PP={s.pp_size}), "
        f"--max-model-len {s.max_model_len}, --max-num-seqs {s.max_num_seqs}, "
        f"--max-num-batched-tokens {s.max_num_batched_tokens}, --kv-cache-memory-bytes "
        f"{s.kv_cache_memory_bytes if s.kv_cache_memory_bytes is not None else 'unset'}, "
        f"PLE table on {s.ple_table}, {s.host_gib_per_card:g} GiB of routed experts per card "
        "on host.",
        f"Weights: {p.weights_source}; one routed expert = {p.expert_bytes / MiB:.3f} MiB.",
        "",
        "| GiB per card | " + " | ".join(f"rank {c.rank}" for c in p.cards) + " |",
        "|---|" + "---:|" * len(p.cards),
    ]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("layers", [c.layers for c in p.cards])
    row("also holds", [", ".join(c.holds) or "-" for c in p.cards])
    row("weights of the stage (PLE table apart)", [_g(c.weights - c.ple_table) for c in p.cards])
    row("- routed experts on host", [_g(c.host_experts) for c in p.cards])
    row("+ PLE n-gram table in VRAM", [_g(c.ple_table_in_vram) for c in p.cards])
    row("+ KV cache allocated", [_g(c.kv_budget) for c in p.cards])
    row("  (one max-len request needs)", [_g(c.kv.one_request) for c in p.cards])
    row("+ model buffers per chunk", [_g(c.buffers) for c in p.cards])
    row("+ activations, CUDA graphs, workspace", [_g(c.allowance) for c in p.cards])
    if s.prefill_staging:
        row("+ prefill staging slots", [_g(c.staging) for c in p.cards])
    if s.one_table:
        row("+ runtime swap counters", [_g(c.swap) for c in p.cards])
    row("**VRAM**", [f"**{_g(c.vram)}**" for c in p.cards])
    row(
        "usable VRAM",
        [_g(c.usable) if c.usable is not None else "any" for c in p.cards],
    )
    row("fits", ["yes" if c.fits else f"NO (+{_g(c.vram - c.usable)})" for c in p.cards])
    row("host experts needed to fit", [f"{c.min_host_gib:.2f}" for c in p.cards])
    row(
        "longest request the KV holds (tokens)",
        [f"{min(c.max_context, 10**9):,}" for c in p.cards],
    )
    lines += [
        "",
        "| host RAM | GiB |",
        "|---|---:|",
        f"| routed experts on host (all cards{', one table included' if s.one_table else ''})"
        f" | {_g(p.host_experts)} |",
        f"| PLE n-gram table, page-locked | {_g(p.host_ple_table)} |",
        f"| vLLM's processes, pinned staging (preflight estimate) | {_g(p.host_reserve)} |",
        f"| **total** | **{_g(p.host_total)}** |",
    ]
    if s.ple_table in ("file", "auto"):
        lines.append(
            f"| page cache for the PLE table read from file (not locked, not in the total) "
            f"| {_g(p.ple_page_cache)} |"
        )
    lines.append("")
    if s.ple_table == "auto":
        lines += [
            f"VLLM_PLE_TABLE=auto page-locks the PLE table when MemAvailable and the "
            f"container's room cover {_g(p.host_total_pinned * 1.1)} GiB (experts, table and "
            f"reserve, +10%; total if pinned {_g(p.host_total_pinned)}); otherwise it reads "
            f"the table from the checkpoint file and needs the total above.",
            "",
        ]
    for c in p.cards:
        if not c.kv_fits:
            lines.append(
                f"- rank {c.rank}: one request at --max-model-len {s.max_model_len} needs "
                f"{_g(c.kv.one_request)} GiB of KV (QSA K/V {_g(c.kv.qsa_kv)}, index keys "
                f"{_g(c.kv.qsa_index)}, GDN state {_g(c.kv.gdn_state)}, PLE state "
                f"{_g(c.kv.ple_state)}), more than the {_g(c.kv_budget)} GiB allocated: vLLM "
                "refuses to start. Raise --kv-cache-memory-bytes or lower --max-model-len to "
                f"{c.max_context}."
            )
        if not c.fits:
            if c.ple_table_in_vram:
                fix = "keep the PLE n-gram table in host memory (VLLM_PLE_TABLE=host)"
            elif c.min_host_gib * GiB > c.experts:
                fix = "no host budget is enough (all routed experts would leave); use more cards"
            else:
                fix = (
                    f"put at least {c.min_host_gib:.2f} GiB of routed experts per card on "
                    "host, or lower the KV cache"
                )
            lines.append(
                f"- rank {c.rank}: needs {_g(c.vram)} GiB of {_g(c.usable or 0)} GiB usable: {fix}."
            )
    for k, v in p.not_loaded.items():
        lines.append(f"- not loaded: {k} weights ({_g(v)} GiB) of the checkpoint")
    if p.defaulted:
        lines.append(
            "- config.json lacks " + ", ".join(p.defaulted) + ": vLLM 0.29.0's defaults used"
        )
    lines += [f"- {n}" for n in p.notes]
    beyond = (
        f", carried on in a straight line to chunk {s.max_num_batched_tokens} (not measured)"
        if s.max_num_batched_tokens > 2048
        else ""
    )
    lines.append(
        "- allowance: the publisher's measurement (1.26 GiB besides weights and KV at "
        "chunk 512, "
        f"+0.7 GiB at chunk 2048{beyond}); usable VRAM: the publisher's 31.4 GiB of a "
        "32,607 MiB "
        "card, same margin for others."
    )
    return "\n".join(lines) + "\n"


def to_json(p: Plan) -> dict[str, Any]:
    """The plan's fields, and the verdicts the Markdown derives (fits, kv_fits, max_context)
    stored beside them so that scripts need not recompute them."""
    doc = asdict(p)
    for c, card in zip(doc["cards"], p.cards, strict=True):
        c.update(
            fits=card.fits,
            kv_fits=card.kv_fits,
            kv_one_request=card.kv.one_request,
            max_context=card.max_context,
        )
    doc["fits"] = p.fits
    return doc
