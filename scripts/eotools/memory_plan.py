# SPDX-License-Identifier: Apache-2.0
"""Per-card VRAM and host RAM of a Qwen4Exp / Qwen3-Next-style MoE model under a pipeline
topology, from its config.json and (when present) its safetensors headers, so that a user knows
before downloading whether a machine fits.

Sizes follow vLLM 0.29.0 as released (file:line in that tree):

- Stages: `get_pp_indices` (distributed/utils.py:127), honouring VLLM_PP_LAYER_PARTITION.
- Qwen4Exp builds `embed_tokens` and `lm_head` on every pipeline rank (models/qwen4_exp/nvidia/
  model.py:408,644; no PPMissingLayer), the final hyper-connection mixer on the last rank only
  (:432). Other architectures: embeddings on the first rank, LM head on the last.
- MTP weights (`mtp.*`) are dropped by `load_weights` (model.py:816-818) unless speculative
  decoding is on; the vision tower is not part of `*ForCausalLM`.
- The PLE n-gram table of a PLE layer: 16 heads (`(ngram_size-1) x heads_per_ngram`), rows = the
  sum of one prime per head above `ngram_vocab_size_base` (global head g of dense PLE layer d
  takes the (d*heads+g+1)-th prime), padded to `make_ngram_vocab_size_divisible_by`, width
  `ple_embed_dim / heads`, model dtype (nvidia/ple_layer.py:229-246,309-319). Upstream builds it
  in VRAM; `VLLM_PLE_TABLE=host` (the series) keeps it in host memory.
- KV per rank, for one request at --max-model-len (what vLLM checks against
  --kv-cache-memory-bytes at start-up, v1/core/kv_cache_utils.py:955): QSA main K/V is a
  `FullAttentionSpec` in VRAM (nvidia/qsa.py:331-339): 2 x kv_heads x head_dim x 2 B per token;
  its compressed index keys one BF16 row of indexer_head_dim per compress_ratio tokens
  (common/qsa_cache.py:784-796), its raw-key ring one block of compress_ratio rows per request
  (:763-781); Gated DeltaNet conv + SSM state and the PLE short-conv state are Mamba specs of
  2 pages each in `--mamba-cache-mode align` (v1/kv_cache_interface.py:883-895), every page
  padded to the attention page of the block size vLLM picks for the hybrid model
  (platforms/interface.py:767). The null block vLLM holds back (one page per layer of a KV
  group) is not counted: leave a margin.
- Activations, CUDA graphs, workspaces: no formula in vLLM; the allowance is the publisher's
  measurement (its 2x32GB write-up, sections 1 and 3.5): 1.6 GiB per card besides weights at
  prefill chunk 512, of which 0.34 GiB was KV, and 0.4-0.7 GiB more at chunk 2048 (the upper
  end is used, linear in the chunk), plus the model's own per-chunk buffers computed here.

Without safetensors files every tensor size is estimated from the config (and the output says
so); linear layers then count as quantized with the checkpoint's bits and group size, except
those vLLM 0.29.0 builds without a quant config (routers, hyper-connections, embeddings).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .compose import read_service
from .ple_table import _primes_after
from .selection import GiB, SelectionError, safetensors_header, stage_layers
from .topologies import TOPOLOGIES

MiB = 1 << 20

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2

# The publisher's non-weight VRAM per card (RTX 3090; its 2x32GB write-up, section 1):
# 1.6 GiB including 0.34 GiB of KV at chunk 512; chunk 2048 adds 0.4-0.7 GiB (section 3.5;
# upper end used).
ALLOWANCE_BASE_GIB = 1.6 - 0.34
ALLOWANCE_CHUNK_BASE = 512
ALLOWANCE_GIB_PER_CHUNK_TOKEN = 0.7 / (2048 - 512)
# What a card reports (nvidia-smi) and what is left after the driver: the publisher's
# RTX 5090 reports 32,607 MiB and counts ~31.4 GiB usable (its 2x32GB write-up, section 1);
# the same margin is taken from the RTX 3090/4090's 24,576 MiB.
REPORTED_MIB = {32: 32607, 24: 24576}
DRIVER_MARGIN_GIB = 32607 / 1024 - 31.4
# PCIe Gen5 x16 host-to-device copy bandwidth, for prefill staging's per-chunk copy (the H200
# reference host measured 55.3 GB/s, bench/results/2026-12-01-host-read-h200.md)
COPY_GBPS = 50.0
# vLLM's own processes besides the host experts (API server, one worker per GPU: CUDA context,
# torch, pinned staging buffers): the preflight's estimate (eotools/preflight.py).
HOST_RESERVE_GIB_BASE = 2.0
HOST_RESERVE_GIB_PER_GPU = 3.0
# One table (VLLM_EXPERT_ONE_TABLE=1) rounds each tensor's VRAM part to the driver's 2 MiB
# and gives up GPU rows until its VRAM is no more than the cold set's GPU experts: a few more
# experts per layer live on host, none more in VRAM (on the target geometry, measured on an
# H200: 2 per layer at 10% host, 3 at 26%).
ONE_TABLE_EXTRA_HOST_EXPERTS = 3
# The runtime swap's device state per MoE layer and expert: decayed pick counts (fp32), the
# expert -> row and row -> expert maps (int32 each).
SWAP_BYTES_PER_LAYER_EXPERT = 12
# VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS's default: smaller forwards are never staged
STAGING_MIN_TOKENS = 2048

TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class PlanError(ValueError):
    """An input the plan cannot use; the message names the fix."""


# --- the model ------------------------------------------------------------------------------


def primes_above(base: int, count: int) -> list[int]:
    """The first `count` primes >= base, in order (shared with the PLE table sizing)."""
    return _primes_after(base - 1, count)


def ngram_table_rows(vocab_base: int, heads: int, dense_layer_id: int, divisible_by: int) -> int:
    """Rows of one PLE layer's n-gram table: head g of dense PLE layer d has as many rows as the
    (d*heads+g+1)-th prime >= vocab_base, and the sum is padded (ple_layer.py:229-246,309)."""
    primes = primes_above(vocab_base, (dense_layer_id + 1) * heads)[dense_layer_id * heads :]
    total = sum(primes)
    return -(-total // divisible_by) * divisible_by


# The MoE families the plan can size: their layers, as vLLM 0.29.0 builds them.
QWEN3_MOE, QWEN3_NEXT, QWEN4EXP = "qwen3_moe", "qwen3_next", "qwen4_exp"
FAMILIES = {
    # model_type -> family; architectures name them too (Qwen3MoeForCausalLM, ...)
    "qwen3_moe": QWEN3_MOE,
    "qwen3_next": QWEN3_NEXT,
    "qwen4_exp": QWEN4EXP,
}
_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen3NextForCausalLM": QWEN3_NEXT,
    "Qwen4ExpForCausalLM": QWEN4EXP,
    "Qwen4ExpForConditionalGeneration": QWEN4EXP,
}
# the config fields each family's layers use beyond the common ones; the others are zero
_FAMILY_FIELDS = {
    QWEN3_MOE: set(),
    QWEN3_NEXT: {"linear", "shared_expert", "layer_types", "mtp"},
    QWEN4EXP: {"linear", "shared_expert", "layer_types", "mtp", "hc", "ple"},
}


def model_family(architecture: str, model_type: str) -> str:
    """The family of a config, or PlanError naming what the plan can size."""
    family = _ARCHITECTURES.get(architecture) or next(
        (f for t, f in FAMILIES.items() if model_type.startswith(t)), None
    )
    if family is None:
        raise PlanError(
            f"memory-plan cannot size {architecture} (model_type {model_type!r}): it knows "
            "the layers of Qwen3-MoE, Qwen3-Next and Qwen4Exp MoE models "
            f"({', '.join(_ARCHITECTURES)}); for another model, vLLM's own start-up "
            "profile is the measure"
        )
    return family


@dataclass
class ModelShape:
    """The config fields the plan needs, with the upstream default of each missing one."""

    architecture: str
    model_type: str
    dtype_bytes: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int
    decoder_sparse_step: int
    mlp_only_layers: list[int]
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: list[int]  # 1-based, as in the config
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_divisible_by: int
    indexer_n_heads: int | None
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    tie_word_embeddings: bool
    quant_bits: int | None
    quant_group_size: int
    quant_sym: bool
    quant_method: str | None
    mtp_layers: int
    family: str = QWEN4EXP
    defaulted: list[str] = field(default_factory=list)

    @property
    def is_qwen4exp(self) -> bool:
        return self.family == QWEN4EXP

    @property
    def gated_attention(self) -> bool:
        """Qwen3-Next's attention (and Qwen4Exp's) projects a gate beside each query."""
        return self.family != QWEN3_MOE

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def is_qsa_layer(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention" and self.indexer_n_heads is not None

    def ple_dense_id(self, i: int) -> int | None:
        """Index of layer i (0-based) among the sorted PLE layers, or None."""
        ids = sorted(set(self.ple_layer_ids))
        return ids.index(i + 1) if i + 1 in ids else None


# Qwen3NextConfig / Qwen4ExpTextConfig defaults in vLLM 0.29.0
# (transformers_utils/configs/qwen3_next.py:186-219, models/qwen4_exp/config.py:35-47)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "mlp_only_layers": [],
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [],
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 0,
}


# Qwen3MoeConfig's defaults where they differ (transformers' configuration_qwen3_moe.py)
_QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
}


def load_shape(config_path: pathlib.Path) -> ModelShape:
    """Read a config.json (top level, or its text_config) into a ModelShape."""
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {config_path}: {e}; give a model's config.json") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{config_path}: not a config object; give a model's config.json")
    text = cfg.get("text_config") or cfg
    defaulted: list[str] = []
    arch = str((cfg.get("architectures") or ["?"])[0])
    model_type = str(cfg.get("model_type", text.get("model_type", "")))
    family = model_family(arch, model_type)
    uses = _FAMILY_FIELDS[family]
    defaults = {**_DEFAULTS, **(_QWEN3_MOE_DEFAULTS if family == QWEN3_MOE else {})}

    def get(name: str, part: str | None = None) -> Any:
        """The config's value, else the family's default (listed); a field of a part
        this family's layers do not have is 0, and not listed."""
        if part is not None and part not in uses:
            return [] if isinstance(defaults[name], list) else 0
        for src in (text, cfg):
            if name in src and src[name] is not None:
                return src[name]
        defaulted.append(name)
        return defaults[name]

    hidden = int(get("hidden_size"))
    layers = int(get("num_hidden_layers"))
    layer_types = text.get("layer_types")
    if family == QWEN3_MOE:
        layer_types = ["full_attention"] * layers  # every layer full attention
    elif layer_types is None:
        # Qwen3-Next's config derives them: every full_attention_interval-th layer is full
        interval = text.get("full_attention_interval")
        if interval is None:
            defaulted.append("layer_types")
        every = int(interval or 4)
        layer_types = [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
    if len(layer_types) != layers:
        raise PlanError(
            f"{config_path}: layer_types has {len(layer_types)} entries for {layers} layers"
        )
    ple_embed = text.get("ple_embed_dim")
    if ple_embed is None:
        ple_embed = hidden
    q = cfg.get("quantization_config") or text.get("quantization_config") or {}
    method = q.get("quant_method")
    bits = q.get("bits") if method in ("gptq", "auto-round", "awq", "inc") else None
    torch_dtype = str(text.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16")
    shape = ModelShape(
        architecture=arch,
        model_type=model_type,
        family=family,
        dtype_bytes=TORCH_DTYPE_BYTES.get(torch_dtype, 2),
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        layer_types=list(layer_types),
        num_attention_heads=int(get("num_attention_heads")),
        num_kv_heads=int(get("num_key_value_heads")),
        head_dim=int(get("head_dim")),
        linear_num_key_heads=int(get("linear_num_key_heads", "linear")),
        linear_num_value_heads=int(get("linear_num_value_heads", "linear")),
        linear_key_head_dim=int(get("linear_key_head_dim", "linear")),
        linear_value_head_dim=int(get("linear_value_head_dim", "linear")),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", "linear")),
        num_experts=int(get("num_experts")),
        experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        shared_expert_intermediate_size=int(
            get("shared_expert_intermediate_size", "shared_expert")
        ),
        intermediate_size=int(get("intermediate_size")),
        decoder_sparse_step=int(get("decoder_sparse_step")),
        mlp_only_layers=[int(x) for x in get("mlp_only_layers")],
        hc_count=int(get("hc_count", "hc")),
        hc_lowrank=int(get("hc_lowrank", "hc")),
        ple_layer_ids=[int(x) for x in get("ple_layer_ids", "ple")],
        ple_embed_dim=int(ple_embed),
        ple_conv_kernel_size=int(get("ple_conv_kernel_size", "ple")),
        ngram_size=int(get("ngram_size", "ple")),
        heads_per_ngram=int(get("heads_per_ngram", "ple")),
        ngram_vocab_size_base=int(get("ngram_vocab_size_base", "ple")),
        ngram_divisible_by=int(get("make_ngram_vocab_size_divisible_by", "ple")) or 1,
        indexer_n_heads=text.get("indexer_n_heads") if family == QWEN4EXP else None,
        indexer_head_dim=int(text.get("indexer_head_dim") or 0),
        indexer_budget=int(text.get("indexer_budget") or 0),
        indexer_compress_ratio=int(text.get("indexer_compress_ratio") or 1),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        quant_bits=int(bits) if bits else None,
        quant_group_size=int(q.get("group_size", 128) or 128),
        quant_sym=bool(q.get("sym", True)),
        quant_method=method,
        mtp_layers=int(get("mtp_num_hidden_layers", "mtp")),
        defaulted=defaulted,
    )
    if "intermediate_size" in defaulted and all(map(shape.is_moe_layer, range(layers))):
        defaulted.remove("intermediate_size")  # no dense MLP uses it
    return shape


# --- weights --------------------------------------------------------------------------------

# Categories of weight bytes. Per layer: EXPERTS (routed), PLE_TABLE, LAYER (the rest);
# global: EMBED, LM_HEAD, FINAL (last rank), MTP and VISION (not loaded by *ForCausalLM).
EXPERTS, PLE_TABLE, LAYER = "experts", "ple_table", "layer"
EMBED, LM_HEAD, FINAL, MTP, VISION = "embed", "lm_head", "final", "mtp", "vision"


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


# --- serving settings -----------------------------------------------------------------------


@dataclass
class Serving:
    """What the plan is for: the topology and the vLLM arguments that decide memory."""

    name: str
    pp_size: int
    usable_vram_bytes: int | None  # per card; None: any size
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int | None
    mamba_cache_mode: str
    ple_table: str  # VLLM_PLE_TABLE: "gpu", "host", "file" or "auto"
    host_gib_per_card: float
    layer_partition: list[int] | None
    prefill_staging: bool = False  # VLLM_EXPERT_PREFILL_STAGING=1
    one_table: bool = False  # VLLM_EXPERT_ONE_TABLE=1: one table with the runtime swap


def usable_vram_bytes(vram_gib: float) -> int:
    """What a card of `vram_gib` nominal GB leaves to vLLM (seed: a 5090's 31.4 GiB)."""
    reported = REPORTED_MIB.get(round(vram_gib), vram_gib * 1000**3 / MiB)
    return int((reported / 1024 - DRIVER_MARGIN_GIB) * GiB)


def read_compose(path: pathlib.Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The serving settings of a compose file, its ${VAR:-default} taken from `environ` as
    Compose does (None: the defaults)."""
    svc = read_service(path, environ)
    args = svc.command
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, inline = arg.partition("=")
            nxt = args[i + 1] if i + 1 < len(args) else None
            flags[key] = inline if eq else (None if nxt is None or nxt.startswith("--") else nxt)
    return {
        "flags": flags,
        "env": svc.environment,
        "topology": svc.build_args.get("TOPOLOGY"),
        "model": args[0] if args else None,
    }


# --- the plan -------------------------------------------------------------------------------


@dataclass
class KV:
    """KV cache and recurrent state of one rank for one request at max_model_len."""

    qsa_kv: int  # main K/V of the QSA (or plain full-attention) layers
    qsa_index: int  # compressed index keys and raw-key rings
    gdn_state: int  # Gated DeltaNet conv + SSM state
    ple_state: int  # PLE short-conv state
    per_token: int  # bytes per context token on this rank
    fixed: int  # bytes per request that do not grow with the context

    @property
    def one_request(self) -> int:
        return self.qsa_kv + self.qsa_index + self.gdn_state + self.ple_state


def kv_for_rank(shape: ModelShape, layers: range, s: Serving) -> KV:
    """KV of one request at max_model_len on the rank holding `layers`, in whole pages: for a
    hybrid model vLLM picks the attention block size (a multiple of 16 tokens) whose page holds
    the largest Mamba state, and pads every Mamba page to it (platforms/interface.py:767-945);
    the smaller QSA index specs are scaled up to the same page (unify in kv_cache_utils.py)."""
    d = shape.dtype_bytes
    n_full = sum(1 for i in layers if shape.layer_types[i] == "full_attention")
    n_qsa = sum(1 for i in layers if shape.is_qsa_layer(i))
    n_gdn = sum(1 for i in layers if shape.layer_types[i] == "linear_attention")
    n_ple = sum(1 for i in layers if shape.ple_dense_id(i) is not None)
    attn_tok = 2 * shape.num_kv_heads * shape.head_dim * d  # one layer, one token
    kd = shape.linear_num_key_heads * shape.linear_key_head_dim
    vd = shape.linear_num_value_heads * shape.linear_value_head_dim
    gdn_page = (
        (2 * kd + vd) * (shape.linear_conv_kernel_dim - 1)
        + shape.linear_num_value_heads * shape.linear_value_head_dim * shape.linear_key_head_dim
    ) * d
    ple_page = (
        shape.hidden_size * shape.hc_count * (shape.ple_conv_kernel_size - 1) * shape.ngram_size * d
    )
    hybrid = "linear_attention" in shape.layer_types
    mamba_page = max(gdn_page if hybrid else 0, ple_page if shape.ple_layer_ids else 0)
    block = 16
    if mamba_page and attn_tok:
        block = 16 * -(-mamba_page // (16 * attn_tok))
    page = block * attn_tok if mamba_page else 0
    qsa_kv = n_full * -(-s.max_model_len // block) * block * attn_tok
    cr = max(shape.indexer_compress_ratio, 1)
    idx_row = shape.indexer_head_dim * d
    idx_bytes = -(-s.max_model_len // cr) * idx_row  # compressed keys of one layer
    ring = cr * idx_row
    if page:
        idx_bytes = -(-idx_bytes // page) * page
        ring = page
    pages = 2 if s.mamba_cache_mode == "align" else 1
    gdn = n_gdn * pages * (page or gdn_page)
    ple = n_ple * pages * (page or ple_page)
    return KV(
        qsa_kv=qsa_kv,
        qsa_index=n_qsa * (idx_bytes + ring),
        gdn_state=gdn,
        ple_state=ple,
        per_token=n_full * attn_tok + n_qsa * idx_row // cr,
        fixed=n_qsa * ring + gdn + ple,
    )


def model_buffers(shape: ModelShape, layers: range, s: Serving) -> int:
    """Buffers the model allocates per prefill chunk: QSA top-k indices (qsa.py:311-320), the
    PLE padded-id and position buffers (ple_layer.py:320-335)."""
    t = s.max_num_batched_tokens
    out = 0
    for i in layers:
        if shape.is_qsa_layer(i):
            out += t * (shape.indexer_budget + shape.indexer_compress_ratio - 1) * 4
        if shape.ple_dense_id(i) is not None:
            out += (s.max_num_seqs * t + t) * 8
    return out


def allowance_bytes(s: Serving) -> int:
    extra = max(s.max_num_batched_tokens - ALLOWANCE_CHUNK_BASE, 0)
    return int((ALLOWANCE_BASE_GIB + extra * ALLOWANCE_GIB_PER_CHUNK_TOKEN) * GiB)


@dataclass
class Card:
    rank: int
    layers: str  # "0-23"
    holds: list[str]  # embeddings, PLE layers, LM head, MTP
    weights: int  # every weight of the stage that vLLM loads, host experts included
    experts: int  # routed experts of the stage
    host_experts: int
    ple_table: int  # of this stage's PLE layers
    ple_table_in_vram: int
    kv_budget: int  # what vLLM allocates: --kv-cache-memory-bytes, or one request per seq
    kv: KV
    buffers: int
    allowance: int
    vram: int
    usable: int | None
    min_host_gib: float  # routed experts that must leave VRAM for this card to fit
    staging: int = 0  # prefill staging's two VRAM slots
    swap: int = 0  # the runtime swap's counters and maps
    one_table_host: int = 0  # experts one table keeps on host beyond the budget

    @property
    def fits(self) -> bool:
        return self.usable is None or self.vram <= self.usable

    @property
    def kv_fits(self) -> bool:
        return self.kv.one_request <= self.kv_budget

    @property
    def max_context(self) -> int:
        """The longest request the KV budget holds on this rank."""
        room = self.kv_budget - self.kv.fixed
        return max(room // self.kv.per_token, 0) if self.kv.per_token else 2**62


@dataclass
class Plan:
    model: str
    weights_source: str
    defaulted: list[str]
    serving: Serving
    expert_bytes: int
    cards: list[Card]
    host_experts: int
    host_ple_table: int  # page-locked (VLLM_PLE_TABLE=host)
    host_reserve: int
    host_total: int  # what must be resident: experts, pinned tables, reserve
    not_loaded: dict[str, int]
    notes: list[str]
    ple_page_cache: int = 0  # file/auto: page cache the table wants (not locked, not counted)
    host_total_pinned: int = 0  # auto: what it needs to pin the tables (+10% margin to choose)

    @property
    def fits(self) -> bool:
        return all(c.fits and c.kv_fits for c in self.cards)


def staging_bytes(host: int, moe_layers: int, expert_bytes: int, s: Serving) -> int:
    """Prefill staging's VRAM on one rank: two slots of the largest layer's host experts,
    the host budget spread evenly over the stage's MoE layers as a budget-only start
    spreads it (the slots hold the packed weights, not their scales; with one table they
    can be a few MiB larger: each weight's slot is rounded up to 2 MiB, and one table keeps
    about two more experts per layer on host)."""
    if not s.prefill_staging or not host or not moe_layers:
        return 0
    per_layer = -(-(host // expert_bytes) // moe_layers)
    return 2 * per_layer * expert_bytes


def host_needed(resident: int, usable: int, moe_layers: int, expert_bytes: int, s: Serving) -> int:
    """The routed-expert bytes a card must put on host to fit `usable`, when `resident` is
    its VRAM with every expert in it. Prefill staging's slots grow with what is on host (two
    of a layer's share), so the answer is the fixed point of host = resident + slots(host) -
    usable, reached from below in a few steps (the slots are 2/layers of the host bytes)."""
    need = max(resident - usable, 0)
    for _ in range(64):
        nxt = max(resident + staging_bytes(need, moe_layers, expert_bytes, s) - usable, 0)
        if nxt <= need:
            break
        need = nxt
    return need


def one_table_bytes(
    host: int, experts: int, moe_layers: int, expert_bytes: int, num_experts: int, s: Serving
) -> tuple[int, int]:
    """One table's cost on one rank: the runtime swap's VRAM, and the host bytes of the
    experts it keeps on host beyond the budget (VRAM rounding; none while nothing is on
    host, and never more than the stage has)."""
    if not s.one_table or not host or not moe_layers:
        return 0, 0
    swap = SWAP_BYTES_PER_LAYER_EXPERT * moe_layers * num_experts
    extra = min(ONE_TABLE_EXTRA_HOST_EXPERTS * moe_layers * expert_bytes, experts - host)
    return swap, extra


def path_line(s: Serving) -> str:
    """Which offload path the settings start, and what each part costs."""
    if not s.host_gib_per_card:
        return "offload path: none (no routed experts on host)"
    if not s.one_table:
        path = "split experts (offload-02, VLLM_EXPERT_ONE_TABLE=0): two tables per layer"
    else:
        path = (
            "one table with the runtime swap (offload-03, VLLM_EXPERT_ONE_TABLE=1): up to "
            f"{ONE_TABLE_EXTRA_HOST_EXPERTS} more experts per layer on host, the swap's "
            "counters in VRAM; where the driver refuses the host mapping, layers fall back to "
            "split experts (the preflight's host-mapping check says so before start-up)"
        )
    if s.prefill_staging and s.max_num_batched_tokens < STAGING_MIN_TOKENS:
        path += (
            f"; prefill staging is on, but chunks of {s.max_num_batched_tokens} tokens are "
            f"below its {STAGING_MIN_TOKENS}-token minimum, so its two VRAM slots buy "
            "nothing: set VLLM_EXPERT_PREFILL_STAGING=0 (PREFILL_STAGING=0)"
        )
    elif s.prefill_staging:
        path += (
            f"; prefill staging for chunks of {s.max_num_batched_tokens} tokens "
            "(VLLM_EXPERT_PREFILL_STAGING=1): two VRAM slots of a layer's host experts"
        )
    return "offload path: " + path


def make_plan(shape: ModelShape, weights: Weights, s: Serving, model: str = "") -> Plan:
    try:
        stages = stage_layers(shape.num_layers, s.pp_size, s.layer_partition)
    except SelectionError as e:
        raise PlanError(str(e)) from None
    cards: list[Card] = []
    notes: list[str] = []
    budget = int(s.host_gib_per_card * GiB)
    for rank, layers in enumerate(stages):
        first, last = rank == 0, rank == s.pp_size - 1
        per = [weights.per_layer[i] for i in layers]
        experts = sum(p[EXPERTS] for p in per)
        ple = sum(p[PLE_TABLE] for p in per)
        other = sum(p[LAYER] for p in per)
        holds = []
        if shape.is_qwen4exp:  # embed_tokens and lm_head on every rank in 0.29.0
            other += weights.outside[EMBED] + weights.outside[LM_HEAD]
            holds += ["embeddings", "LM head"]
        else:
            if first:
                other += weights.outside[EMBED]
                holds.append("embeddings")
            if last:
                other += weights.outside[LM_HEAD]
                holds.append("LM head")
        if last:
            other += weights.outside[FINAL]
        ple_ids = [i + 1 for i in layers if shape.ple_dense_id(i) is not None]
        if ple_ids:
            holds.append("PLE layer " + ",".join(map(str, ple_ids)))
        if last and shape.mtp_layers:
            holds.append("MTP (loaded only with speculative decoding)")
        eb = max(weights.expert_bytes, 1)
        host = min(budget // eb * eb, experts) if weights.expert_bytes else 0
        ple_vram = ple if s.ple_table == "gpu" else 0
        kv = kv_for_rank(shape, layers, s)
        kv_budget = (
            s.kv_cache_memory_bytes
            if s.kv_cache_memory_bytes is not None
            else kv.one_request * s.max_num_seqs
        )
        buffers = model_buffers(shape, layers, s)
        allowance = allowance_bytes(s)
        moe_layers = sum(1 for p in per if p[EXPERTS])
        staging = staging_bytes(host, moe_layers, eb, s)
        swap, extra = one_table_bytes(host, experts, moe_layers, eb, shape.num_experts, s)
        resident = experts + other + ple_vram + kv_budget + buffers + allowance + swap
        vram = resident - host + staging
        usable = s.usable_vram_bytes
        need_host = (
            0.0 if usable is None else host_needed(resident, usable, moe_layers, eb, s) / GiB
        )
        cards.append(
            Card(
                rank=rank,
                layers=f"{layers.start}-{layers.stop - 1}",
                holds=holds,
                weights=experts + other + ple,
                experts=experts,
                host_experts=host,
                ple_table=ple,
                ple_table_in_vram=ple_vram,
                kv_budget=kv_budget,
                kv=kv,
                buffers=buffers,
                allowance=allowance,
                vram=vram,
                usable=usable,
                min_host_gib=need_host,
                staging=staging,
                swap=swap,
                one_table_host=extra,
            )
        )
    host_experts = sum(c.host_experts + c.one_table_host for c in cards)
    all_ple = sum(c.ple_table for c in cards)
    host_ple = all_ple if s.ple_table == "host" else 0
    page_cache = 0
    if s.ple_table in ("file", "auto") and shape.ple_layer_ids:
        page_cache = min(
            all_ple, len(set(shape.ple_layer_ids)) * s.max_model_len * shape.ngram_heads * 4096
        )
    reserve = int((HOST_RESERVE_GIB_BASE + HOST_RESERVE_GIB_PER_GPU * s.pp_size) * GiB)
    if budget and not weights.expert_bytes:
        notes.append("no routed experts found: the host budget places nothing")
    if shape.is_qwen4exp and shape.ple_layer_ids and s.pp_size > 1:
        notes.append(
            "vLLM 0.29.0 refuses PP > 1 with PLE (model_executor/models/config.py:877); the "
            "series' PP-with-PLE patch is needed"
        )
    most = max((c.host_experts for c in cards), default=0)
    notes.append(path_line(s))
    if s.prefill_staging and most:
        ms = most / (COPY_GBPS * 1e9) * 1e3
        notes.append(
            f"prefill staging copies a card's host experts ({most / GiB:.2f} GiB) once per "
            f"chunk of {s.max_num_batched_tokens} tokens: about {ms:.0f} ms at "
            f"{COPY_GBPS:g} GB/s (PCIe Gen5 x16), hidden only while the chunk computes longer; "
            "a longer chunk (--max-num-batched-tokens) copies less often per prompt"
        )
    if s.kv_cache_memory_bytes is None:
        notes.append(
            "no --kv-cache-memory-bytes: KV counted as max-num-seqs requests at max-model-len"
        )
    return Plan(
        model=model,
        weights_source=weights.source,
        defaulted=shape.defaulted,
        serving=s,
        expert_bytes=weights.expert_bytes,
        cards=cards,
        host_experts=host_experts,
        host_ple_table=host_ple,
        host_reserve=reserve,
        host_total=host_experts + host_ple + reserve,
        ple_page_cache=page_cache,
        host_total_pinned=host_experts + all_ple + reserve if s.ple_table == "auto" else 0,
        not_loaded={k: v for k, v in weights.outside.items() if k in (MTP, VISION) and v},
        notes=notes,
    )


# --- output ---------------------------------------------------------------------------------


def _g(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def render_markdown(p: Plan) -> str:
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


# --- command line ---------------------------------------------------------------------------

REPO = pathlib.Path(__file__).resolve().parents[2]


def build_serving(args: argparse.Namespace) -> Serving:
    compose: dict[str, Any] = {"flags": {}, "env": {}, "topology": None}
    compose_path = args.compose
    if compose_path is None and args.topology:
        candidate = REPO / "compose" / f"{args.topology}.yml"
        compose_path = candidate if candidate.exists() else None
    if compose_path is not None:
        try:
            # the shell's variables, as `docker compose up` would see them
            compose = read_compose(compose_path, os.environ)
        except (OSError, KeyError, ValueError) as e:
            raise PlanError(f"cannot read the compose file {compose_path}: {e}") from None
    fl, env = compose["flags"], compose["env"]
    name = args.topology or compose["topology"]
    topo = TOPOLOGIES.get(name) if name else None
    if name and topo is None:
        raise PlanError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")

    def pick(cli: Any, flag: str, default: Any, cast: Any = int) -> Any:
        if cli is not None:
            return cli
        if fl.get(flag) is not None:
            return cast(fl[flag])
        return default

    pp = pick(args.pp_size, "--pipeline-parallel-size", topo.pipeline_parallel_size if topo else 1)
    if args.vram_gib is not None:
        usable = int(args.vram_gib * GiB)
    elif topo is not None and topo.vram_gib is not None:
        usable = usable_vram_bytes(topo.vram_gib)
    else:
        usable = None
    partition = (
        args.layer_partition
        or env.get("VLLM_PP_LAYER_PARTITION")
        or os.environ.get("VLLM_PP_LAYER_PARTITION")
    )
    try:
        parts = [int(x) for x in partition.split(",")] if partition else None
    except ValueError:
        raise PlanError(f"layer partition {partition!r}: give comma-separated counts") from None
    host = args.host_gib_per_card
    if host is None:
        host = float(env.get("EO_HOST_BUDGET_GIB") or 0)
    kv = pick(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes", None)
    return Serving(
        name=name or f"{pp} card(s)",
        pp_size=int(pp),
        usable_vram_bytes=usable,
        max_model_len=pick(args.max_model_len, "--max-model-len", None),
        max_num_seqs=pick(args.max_num_seqs, "--max-num-seqs", 256),
        max_num_batched_tokens=pick(args.max_num_batched_tokens, "--max-num-batched-tokens", 2048),
        kv_cache_memory_bytes=kv,
        mamba_cache_mode=pick(args.mamba_cache_mode, "--mamba-cache-mode", "none", str),
        ple_table=args.ple_table or env.get("VLLM_PLE_TABLE") or "gpu",
        host_gib_per_card=host,
        layer_partition=parts,
        prefill_staging=_on(args.prefill_staging, env.get("VLLM_EXPERT_PREFILL_STAGING")),
        one_table=_on(args.one_table, env.get("VLLM_EXPERT_ONE_TABLE")),
    )


def _on(flag: bool | None, env_value: str | None) -> bool:
    """A switch from its flag (--x / --no-x), else the compose file's variable."""
    if flag is not None:
        return flag
    return (env_value or "0") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="memory-plan",
        description="Per-card VRAM and host RAM of a MoE model under a topology, from its "
        "config.json and safetensors headers (no tensor data is read; without safetensors "
        "files every size is estimated from the config). It sizes the layers of Qwen3-MoE "
        "(Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, ...), Qwen3-Next and Qwen4Exp "
        "models, and refuses other architectures. Settings come from compose/"
        "<topology>.yml (or --compose FILE), its ${VAR:-default} taken from the environment "
        "as docker compose takes them (e.g. PREFILL_STAGING=1 MAX_NUM_BATCHED_TOKENS=8192 "
        "HOST_BUDGET_GIB=10.5); each flag overrides them.",
        epilog="Exit codes: 0 every card fits and the KV cache holds one request at "
        "--max-model-len; 1 some card or KV cache does not (the table says which, and what "
        "to change); 2 bad input.",
    )
    ap.add_argument("model", type=pathlib.Path, help="checkpoint folder, or its config.json")
    ap.add_argument("--topology", help=f"one of {', '.join(TOPOLOGIES)}")
    ap.add_argument("--compose", type=pathlib.Path, help="read the settings of this compose file")
    ap.add_argument("--pp-size", type=int)
    ap.add_argument("--vram-gib", type=float, help="usable VRAM per card (GiB)")
    ap.add_argument(
        "--host-gib-per-card",
        type=float,
        help="cold set size: GiB of routed "
        "experts per card on host (default: the compose file's EO_HOST_BUDGET_GIB)",
    )
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--kv-cache-memory-bytes", type=int)
    ap.add_argument("--mamba-cache-mode", choices=["none", "align", "all"])
    ap.add_argument(
        "--ple-table",
        choices=["gpu", "host", "file", "auto"],
        help="where the PLE n-gram table "
        "lives (VLLM_PLE_TABLE; default: the compose file's, else gpu as upstream): host "
        "counts it page-locked, file counts the page cache it wants apart (not locked), auto "
        "counts file and says what pinning would need",
    )
    ap.add_argument("--layer-partition", help="VLLM_PP_LAYER_PARTITION, e.g. 25,23")
    ap.add_argument(
        "--prefill-staging",
        action=argparse.BooleanOptionalAction,
        help="count prefill staging's VRAM (VLLM_EXPERT_PREFILL_STAGING=1; default: the "
        "compose file's)",
    )
    ap.add_argument(
        "--one-table",
        action=argparse.BooleanOptionalAction,
        help="count one table with the runtime swap (VLLM_EXPERT_ONE_TABLE=1; default: the "
        "compose file's)",
    )
    ap.add_argument("--config-only", action="store_true", help="ignore safetensors files")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    try:
        path = args.model
        config = path if path.is_file() else path / "config.json"
        shape = load_shape(config)
        files = [] if args.config_only or path.is_file() else safetensors_files(path)
        weights = header_weights(shape, files) if files else estimate_weights(shape)
        serving = build_serving(args)
        if serving.max_model_len is None:
            raise PlanError("no --max-model-len (and none in the compose file): give one")
        plan = make_plan(shape, weights, serving, model=config.parent.name)
    except PlanError as e:
        print(f"memory-plan: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(to_json(plan), indent=1))
    else:
        print(render_markdown(plan), end="")
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


__all__ = ["PlanError", "main", "make_plan", "ngram_table_rows"]
