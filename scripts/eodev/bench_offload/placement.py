# SPDX-License-Identifier: Apache-2.0
"""Where an engine really put its host experts, from its probe's memory figures, and the host
reads per token that makes on the tokens it decoded (the planted routing decides every pick)."""

from __future__ import annotations

import numpy as np

from ..testmodel.plant import Plan


def host_reads_per_token(
    plan: Plan,
    prompts: list[list[int]],
    outputs: list[list[int]],
    host: dict[int, set[int]],
    share: dict[int, float] | None = None,
) -> float:
    """Mean number of (layer, expert) picks per decode step that land on host experts (the
    steps that feed generated tokens back: positions len(prompt) .. end - 1). `share`
    weights a layer's picks by the part of each expert's bytes on host (vLLM's
    --cpu-offload-gb may offload only some of a layer's tensors): reads in whole rows."""
    reads = 0.0
    tokens = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        seq = np.array(prompt + out)
        start = len(prompt)
        for layer, cold in host.items():
            picks = plan.router_topk(layer, seq[:-1])[start:]
            reads += int(np.isin(picks, list(cold)).sum()) * (share or {}).get(layer, 1.0)
        tokens += len(out) - 1
    return reads / max(tokens, 1)


def uva_placement(
    mem: dict, num_layers: int, every: set[int]
) -> tuple[dict[int, set[int]], dict[int, float] | None]:
    """Where vLLM's --cpu-offload-gb put experts: it offloads parameter by parameter, first
    layers first, and may stop inside a layer (e.g. one layer's w13 but not its w2). From
    the probe's per-layer bytes: every layer with bytes on host, weighted by its host share.
    Runs made before the probe recorded them: whole layers, rounded."""
    host, total = mem.get("expert_host_bytes_by_layer"), mem.get("expert_bytes_by_layer")
    if host and total:
        placed = {x: every for x, h in enumerate(host) if h}
        return placed, {x: host[x] / total[x] for x in placed}
    layer_bytes = (mem["expert_gpu_bytes"] + mem["expert_host_bytes"]) / max(num_layers, 1)
    whole = round(mem["expert_host_bytes"] / max(layer_bytes, 1))
    return {x: every for x in range(num_layers) if x < whole}, None


def one_table_placement(memory: dict, placed: dict[int, set[int]]) -> dict[int, set[int]]:
    """The host experts an engine ran with: one table can keep a few more GPU experts in
    host rows than the cold file (to keep its VRAM within offload-02's), and its probe
    says which, per layer; other layers are as placed."""
    table = memory.get("one_table_host_experts") or {}
    return {**placed, **{int(k): set(v) for k, v in table.items()}}
