# SPDX-License-Identifier: Apache-2.0
"""The model's shape as the plan sizes it: a config.json (top level or its text_config) read
into the fields the layers of Qwen3-MoE, Qwen3-Next and Qwen4Exp models use in vLLM 0.29.0,
each missing field taken from that family's upstream default and listed, so that the plan says
which of its figures rest on defaults."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from .errors import PlanError

TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

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
