# SPDX-License-Identifier: Apache-2.0
"""Weight bytes of each layer and of the tensors outside the layers, from a checkpoint's
safetensors headers (no tensor data is read) or, without safetensors files, estimated from the
config, so that the plan can place them on pipeline stages and on host.

Sizes follow vLLM 0.29.0 as released (file:line in that tree):

- MTP weights (`mtp.*`) are dropped by `load_weights` (models/qwen4_exp/nvidia/model.py:816-818)
  unless speculative decoding is on; the vision tower is not part of `*ForCausalLM`.
- The PLE n-gram table of a PLE layer: 16 heads (`(ngram_size-1) x heads_per_ngram`), rows = the
  sum of one prime per head above `ngram_vocab_size_base` (global head g of dense PLE layer d
  takes the (d*heads+g+1)-th prime), padded to `make_ngram_vocab_size_divisible_by`, width
  `ple_embed_dim / heads`, model dtype (nvidia/ple_layer.py:229-246,309-319). Upstream builds
  it in VRAM; `VLLM_PLE_TABLE=host` (the series) keeps it in host memory.
- Estimated from the config (the plan's output says so), linear layers count as quantized with
  the checkpoint's bits and group size, except those vLLM 0.29.0 builds without a quant config
  (routers, hyper-connections, embeddings).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..ple_table import _primes_after
from ..selection import SelectionError, safetensors_header
from .errors import PlanError
from .model_shape import ModelShape

# Categories of weight bytes. Per layer: EXPERTS (routed), PLE_TABLE, LAYER (the rest);
# global: EMBED, LM_HEAD, FINAL (last rank), MTP and VISION (not loaded by *ForCausalLM).
EXPERTS, PLE_TABLE, LAYER = "experts", "ple_table", "layer"
EMBED, LM_HEAD, FINAL, MTP, VISION = "embed", "lm_head", "final", "mtp", "vision"


def primes_above(base: int, count: int) -> list[int]:
    """The first `count` primes >= base, in order (shared with the PLE table sizing)."""
    return _primes_after(base - 1, count)


def ngram_table_rows(vocab_base: int, heads: int, dense_layer_id: int, divisible_by: int) -> int:
    """Rows of one PLE layer's n-gram table: head g of dense PLE layer d has as many rows as the
    (d*heads+g+1)-th prime >= vocab_base, and the sum is padded (ple_layer.py:229-246,309)."""
    primes = primes_above(vocab_base, (dense_layer_id + 1) * heads)[dense_layer_id * heads :]
    total = sum(primes)
    return -(-total // divisible_by) * divisible_by


@dataclass
class Weights:
    """Weight bytes per layer and category, and of the tensors outside the layers."""

    source: str  # "safetensors headers (N files)" or "estimated from config.json"
    per_layer: list[dict[str, int]]
    outside: dict[str, int]
    expert_bytes: int  # one routed expert as it sits in memory


def _linear_bytes(shape: ModelShape, n_out: int, n_in: int, quantized: bool = True) -> int:
    """One [n_out, n_in] linear weight: BF16, or packed INT-b with BF16 group scales (and
    packed zero points for asymmetric quantization)."""
    if not quantized or shape.quant_bits is None:
        return n_out * n_in * shape.dtype_bytes
    groups = -(-n_in // shape.quant_group_size)
    packed = n_out * n_in * shape.quant_bits // 8
    scales = groups * n_out * 2
    zeros = 0 if shape.quant_sym else groups * n_out * shape.quant_bits // 8
    return packed + scales + zeros


def estimate_weights(shape: ModelShape) -> Weights:
    """Every tensor's size from the config alone (no checkpoint at hand)."""
    h, d = shape.hidden_size, shape.dtype_bytes
    expert = _linear_bytes(shape, 2 * shape.moe_intermediate_size, h) + _linear_bytes(
        shape, h, shape.moe_intermediate_size
    )
    hh = h * shape.hc_count
    pad = (-(shape.hc_lowrank + shape.hc_count)) % 16
    hc_module = (hh * (shape.hc_lowrank + shape.hc_count + pad) + shape.hc_lowrank * hh + hh) * d
    per_layer: list[dict[str, int]] = []
    for i in range(shape.num_layers):
        layer = 2 * h * d + 2 * hc_module  # norms, two hyper-connection modules
        if shape.layer_types[i] == "linear_attention":
            kd = shape.linear_num_key_heads * shape.linear_key_head_dim
            vd = shape.linear_num_value_heads * shape.linear_value_head_dim
            layer += _linear_bytes(shape, 2 * kd + 2 * vd, h)  # in_proj_qkvz
            layer += 2 * shape.linear_num_value_heads * h * d  # in_proj_ba
            layer += (2 * kd + vd) * shape.linear_conv_kernel_dim * d  # conv1d
            layer += 2 * shape.linear_num_value_heads * 4 + shape.linear_value_head_dim * d
            layer += _linear_bytes(shape, h, vd)  # out_proj
        else:
            heads, hd = shape.num_attention_heads, shape.head_dim
            q = (2 if shape.gated_attention else 1) * heads * hd  # query (and its gate)
            layer += _linear_bytes(shape, q + 2 * shape.num_kv_heads * hd, h)
            layer += _linear_bytes(shape, h, heads * hd) + 2 * hd * d
            if shape.is_qsa_layer(i):
                idx = (int(shape.indexer_n_heads or 0) + 1) * shape.indexer_head_dim
                layer += _linear_bytes(shape, idx, h) + 2 * shape.indexer_head_dim * d
        entry = {EXPERTS: 0, PLE_TABLE: 0, LAYER: 0}
        if shape.is_moe_layer(i):
            entry[EXPERTS] = shape.num_experts * expert
            layer += shape.num_experts * h * d  # router gate
            if shape.shared_expert_intermediate_size:
                si = shape.shared_expert_intermediate_size
                layer += _linear_bytes(shape, 2 * si, h) + _linear_bytes(shape, h, si) + h * d
        else:
            layer += _linear_bytes(shape, 2 * shape.intermediate_size, h)
            layer += _linear_bytes(shape, h, shape.intermediate_size)
        dense_id = shape.ple_dense_id(i)
        if dense_id is not None:
            rows = ngram_table_rows(
                shape.ngram_vocab_size_base, shape.ngram_heads, dense_id, shape.ngram_divisible_by
            )
            entry[PLE_TABLE] = rows * (shape.ple_embed_dim // shape.ngram_heads) * d
            layer += _linear_bytes(shape, hh, shape.ple_embed_dim)  # key_proj
            layer += _linear_bytes(shape, h, shape.ple_embed_dim)  # value_proj
            layer += 3 * hh * d + hh * shape.ple_conv_kernel_size * d  # norms, conv1d
        entry[LAYER] = layer
        per_layer.append(entry)
    embed = shape.vocab_size * h * d
    outside = {
        EMBED: embed,
        LM_HEAD: 0 if shape.tie_word_embeddings else embed,
        FINAL: h * d + (hh * shape.hc_lowrank * 2 + hh) * d,  # norm, final HC mixer
        MTP: shape.mtp_layers * (per_layer[-1][EXPERTS] + per_layer[-1][LAYER]),
        VISION: 0,
    }
    return Weights("estimated from config.json (no safetensors files)", per_layer, outside, expert)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _classify(name: str) -> tuple[str, int | None]:
    """(category, layer) of a checkpoint tensor name."""
    if name.startswith("mtp.") or ".mtp." in name:
        return MTP, None
    if "visual." in name or name.startswith("vision"):
        return VISION, None
    if name.startswith("lm_head."):
        return LM_HEAD, None
    if "embed_tokens." in name:
        return EMBED, None
    m = _LAYER_RE.search(name)
    if m is None:
        return FINAL, None
    layer = int(m.group(1))
    if ".ngram_embedding" in name:
        return PLE_TABLE, layer
    if ".mlp.experts." in name:
        return EXPERTS, layer
    return LAYER, layer


def _resident_expert_tensor(name: str, shape: ModelShape) -> bool:
    """Whether a routed-expert checkpoint tensor stays in memory after the Marlin repack:
    symmetric INT4 needs no zero points, and act-order indices are empty without desc_act."""
    if name.endswith(".g_idx"):
        return False
    return not (name.endswith(".qzeros") and shape.quant_sym and shape.quant_bits is not None)


def safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those its index names, else every one in the folder."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
        return [model_dir / n for n in sorted(set(where.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def read_header(path: pathlib.Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (its first 8 + N bytes; no tensor data)."""
    try:
        return safetensors_header(path)
    except SelectionError as e:
        raise PlanError(str(e)) from None


def header_weights(shape: ModelShape, files: Sequence[pathlib.Path]) -> Weights:
    """Weight bytes from the safetensors headers: each tensor's data_offsets."""
    per_layer = [{EXPERTS: 0, PLE_TABLE: 0, LAYER: 0} for _ in range(shape.num_layers)]
    outside = dict.fromkeys((EMBED, LM_HEAD, FINAL, MTP, VISION), 0)
    expert0: dict[str, int] = {}
    expert0_prefix: str | None = None
    for path in files:
        for name, meta in read_header(path).items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            size = end - start
            cat, layer = _classify(name)
            if layer is None:
                outside[cat] += size
                continue
            if shape.num_layers <= layer < shape.num_layers + shape.mtp_layers:
                outside[MTP] += size  # MTP stored as the layers after the last one
                continue
            if layer >= shape.num_layers:
                raise PlanError(
                    f"{path.name}: tensor {name} names layer {layer}, but config.json has "
                    f"{shape.num_layers} layers; the folder mixes two models"
                )
            if cat == EXPERTS:
                if not _resident_expert_tensor(name, shape):
                    continue
                prefix, _, rest = name.partition(".mlp.experts.")
                eid, _, tensor = rest.partition(".")
                if eid == "0" and expert0_prefix in (None, prefix):
                    expert0_prefix = prefix
                    expert0[tensor] = size
            per_layer[layer][cat] += size
    if shape.tie_word_embeddings:
        outside[LM_HEAD] = 0
    where = f"safetensors headers ({len(files)} file{'s' if len(files) != 1 else ''})"
    return Weights(where, per_layer, outside, sum(expert0.values()))
