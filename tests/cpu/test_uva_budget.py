# SPDX-License-Identifier: Apache-2.0
"""The --cpu-offload-gb budget that bench-offload gives vLLM for "the same host bytes":
vLLM's offloader stops at the first parameter boundary at or above its budget, so the
bench aims at the boundary nearest the bytes (scripts/eodev/bench/uva_budget.py).

    scripts/test tests/cpu/test_uva_budget.py
"""

from __future__ import annotations

import json
import struct

from eodev.bench.uva_budget import budget_for, offload_boundaries

# the reference geometry (make-test-model, INT4): hidden 2560, expert width 640, group 128
SIZES = {  # bytes of expert 0's tensors, per projection
    "gate_proj": {"qweight": 819_200, "scales": 25_600, "qzeros": 6_400, "g_idx": 10_240},
    "up_proj": {"qweight": 819_200, "scales": 25_600, "qzeros": 6_400, "g_idx": 10_240},
    "down_proj": {"qweight": 819_200, "scales": 25_600, "qzeros": 6_400, "g_idx": 2_560},
}
LAYER = 512 * 2_576_640  # every expert tensor of one layer


def _header_only_checkpoint(folder, layers=2, experts=2):
    """A safetensors file whose header names the tensors of make-test-model's INT4 layout
    (the data is never read)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for layer in range(layers):
        header[f"model.layers.{layer}.self_attn.q_proj.weight"] = {
            "dtype": "BF16",
            "shape": [1],
            "data_offsets": [offset, offset + 2],
        }
        offset += 2
        for e in range(experts):
            for proj, tensors in SIZES.items():
                for tensor, size in tensors.items():
                    key = f"model.layers.{layer}.mlp.experts.{e}.{proj}.{tensor}"
                    header[key] = {
                        "dtype": "I32",
                        "shape": [size // 4],
                        "data_offsets": [offset, offset + size],
                    }
                    offset += size
    blob = json.dumps(header).encode()
    (folder / "model-00001-of-00001.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_boundaries_follow_vllms_parameter_order(tmp_path):
    """Stops after each layer's w13 (gate and up) and w2 (down), with the size of the
    parameter that ends there; a layer is every expert tensor of the checkpoint."""
    _header_only_checkpoint(tmp_path)
    bounds = offload_boundaries(tmp_path, 16, 512)
    w13, w2 = 838_860_800, 419_430_400
    assert bounds[:4] == [(w13, w13), (w13 + w2, w2), (LAYER + w13, w13), (LAYER + w13 + w2, w2)]
    assert len(bounds) == 32 and bounds == sorted(bounds)
    assert offload_boundaries(tmp_path / "missing", 16, 512) is None


def test_the_budget_stops_vllm_at_the_boundary_nearest_the_bytes(tmp_path):
    """A sweep of 2026-12-01 on an H200: only the 20% point changes. It asked for 4.21 GB
    and vLLM stopped at 4.80 GB (3 layers and a w13), 17% over the target; the nearest stop
    is 0.31 GB under it (2 layers and layer 2's w13 and w2). The budget sits half a
    parameter before its stop, so that the checkpoint's approximation of the small tensors
    (5 MB per layer short for GPTQ: 80 MB by layer 16) cannot move it to another stop."""
    _header_only_checkpoint(tmp_path)
    bounds = offload_boundaries(tmp_path, 16, 512)
    w13, w2 = 838_860_800, 419_430_400
    cases = {  # target bytes (that sweep) -> where vLLM should stop
        4_205_051_904: 2 * LAYER + w13 + w2,  # 20%: was 3 * LAYER + w13
        2_083_737_600: LAYER + w13,  # 10%, as before
        8_451_379_200: 6 * LAYER + w13,  # 40%, as before
        1_071_882_240: w13 + w2,  # 5%, as before
    }
    for target, stop in cases.items():
        budget, at = budget_for(target, bounds)
        size = dict(bounds)[at]
        assert at == stop, target
        assert at - size + 100_000_000 < budget < at - 100_000_000
    assert budget_for(0, bounds) == (0, 0)
    assert budget_for(1, bounds) == (w13 // 2, w13)
