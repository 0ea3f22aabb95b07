# SPDX-License-Identifier: Apache-2.0
"""GPTQ 4-bit symmetric packing, the layout AutoGPTQ writes and vLLM's gptq_marlin path reads.

For a linear layer y = x @ W with W of shape (in, out):
- qweight (in/8, out) int32: 8 consecutive input rows per word, row i in bits 4*(i%8)..+3;
- scales (in/group, out) float16; qzeros (in/group, out/8) int32 holding zero-1 = 7 per nibble
  (GPTQ v1 format stores zero - 1; symmetric 4-bit has zero 8);
- g_idx (in,) int32 = i // group (no activation reordering).
A stored nibble q means the weight (q - 8) * scale.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS
ZERO = 1 << (BITS - 1)  # 8
QZERO_WORD = 0x77777777  # eight nibbles of (ZERO - 1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """(in, out) nibbles in 0..15 (any integer dtype) -> (in/8, out) int32 GPTQ qweight."""
    rows, cols = q.shape
    if rows % PACK:
        raise ValueError(f"input size {rows} is not a multiple of {PACK}")
    q = q.to(torch.int64).reshape(rows // PACK, PACK, cols)
    shifts = (torch.arange(PACK, device=q.device, dtype=torch.int64) * BITS).view(1, PACK, 1)
    words = (q << shifts).sum(dim=1)  # < 2**32, fits int64
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_rows: (in/8, out) int32 -> (in, out) int64 nibbles."""
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(PACK, device=w.device, dtype=torch.int64) * BITS).view(1, PACK, 1)
    q = (w.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(-1, w.shape[-1])


def qzeros(in_features: int, out_features: int, group: int, device=None) -> torch.Tensor:
    word = QZERO_WORD - 2**32 if QZERO_WORD >= 2**31 else QZERO_WORD
    return torch.full(
        (in_features // group, out_features // PACK), word, dtype=torch.int32, device=device
    )


def g_idx(in_features: int, group: int, device=None) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int32, device=device) // group


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """(in, out) float32 weights of a GPTQ symmetric 4-bit layer."""
    q = unpack_rows(qweight).to(torch.float32) - ZERO
    s = scales.to(torch.float32).repeat_interleave(group, dim=0)
    return q * s
