# SPDX-License-Identifier: Apache-2.0
"""The `--cpu-offload-gb` budget that puts the bytes nearest a target on host.

vLLM's UVA offloader (0.29.0, `model_executor/offloader/uva.py`) walks the parameters
in model order, first layers first. It offloads whole parameters while the bytes
offloaded so far are below the budget. So it stops at the first parameter boundary at or
above the budget, up to one parameter past it: with the reference geometry an INT4
layer's w13 is 0.84 GB. In one sweep of 2026-12-01 the 20% point asked for 4.21 GB and got 4.76 GB,
17% more host bytes than the swap it was compared with. A budget inside the parameter
that ends at the boundary nearest the target stops it there instead.

The boundaries come from the checkpoint's headers (no weights are read). vLLM registers
a layer's expert parameters as w13 (the gate and up projections' weights), w2 (the down
projection's), then small tensors (scales, zero points, g_idx, their sort indices, biases).
The small tensors' sizes depend on the quantisation method, and the checkpoint only
approximates them (5 MB per layer short for GPTQ). So the candidate stops are the ends of
each layer's w13 and w2, and the budget sits in the middle of the parameter before the
stop (hundreds of MB either side), where such an error cannot move it to another stop.
"""

from __future__ import annotations

import pathlib

from eotools.selection import expert0_tensor_bytes


def _expert0_bytes(model_dir: pathlib.Path) -> dict[str, int] | None:
    """Bytes of expert 0 of the first MoE layer by part: "w13" (gate_proj and up_proj
    weights or qweights), "w2" (down_proj's), "rest" (every other tensor of the expert).
    None for a checkpoint without safetensors files (a weightless test model)."""
    parts = {"w13": 0, "w2": 0, "rest": 0}
    for name, size in expert0_tensor_bytes(model_dir).items():
        proj, _, tensor = name.partition(".")
        if tensor in ("weight", "qweight") and proj in ("gate_proj", "up_proj"):
            parts["w13"] += size
        elif tensor in ("weight", "qweight") and proj == "down_proj":
            parts["w2"] += size
        else:
            parts["rest"] += size
    return parts if parts["w13"] and parts["w2"] else None


def offload_boundaries(
    model_dir: pathlib.Path, num_layers: int, num_experts: int
) -> list[tuple[int, int]] | None:
    """Where the offloader can stop, in order, as (cumulative expert bytes, bytes of the
    parameter that ends there): after each layer's w13 and after its w2. None where the
    checkpoint cannot say."""
    parts = _expert0_bytes(model_dir)
    if parts is None:
        return None
    w13, w2 = parts["w13"] * num_experts, parts["w2"] * num_experts
    layer = w13 + w2 + parts["rest"] * num_experts
    out = []
    for x in range(num_layers):
        out += [(x * layer + w13, w13), (x * layer + w13 + w2, w2)]
    return out


def budget_for(target: int, boundaries: list[tuple[int, int]]) -> tuple[int, int]:
    """(budget in bytes, the stop it aims at): the stop nearest ``target`` (the lower one
    on a tie), and a budget half a parameter before it."""
    if target <= 0 or not boundaries:
        return 0, 0
    stop, size = min(boundaries, key=lambda b: (abs(b[0] - target), b[0]))
    return stop - size // 2, stop
