# SPDX-License-Identifier: Apache-2.0
"""A synthetic Qwen4Exp checkpoint (vLLM `Qwen4ExpForCausalLM`, model_type `qwen4_exp`) with the
routing of plant.py: every feature of the real model is on, none disturbs the planted routers.

Qwen4Exp keeps `hc_count` copies ("streams") of the hidden state. Each block reads
`mix(x) = mean_s(sigmoid(gate_s) * rmsnorm_s(x_s) * (1 + w_s))` and its output is added to every
stream times `2 * sigmoid(inject_s / hc_count)`; PLE layers add an n-gram embedding term to the
streams before their block. The planted routers keep working because:

- the embedding is repeated into every stream, and only layer 0's attention (a QSA layer with
  zero queries: a uniform causal mean, as in the Qwen3-MoE model) writes the reserved
  dimensions, with zero injection weights (factor 1 in every stream): the reserved part of every
  stream stays identical;
- every other writer writes the token subspace only: expert and shared-expert down projections,
  attention and Gated DeltaNet output projections, and PLE's value projection (its short
  convolution is per channel, so zero input channels stay zero) have zero rows there;
- the hyper-connection gates of the reserved dimensions are constant (zero rows in
  `input_mix_weight_up`: sigmoid(0) = 1/2) and so are the norm weights there (zero), so a
  router sees the reserved dimensions times one positive factor per token, which does not
  change its top-k. The router gates and the LM head are the Qwen3-MoE model's, doubled to undo
  the 1/2 of the gates.

Layer 0 is therefore a full-attention (QSA) layer; the real model's layer mix (one QSA layer
in four, the others Gated DeltaNet) is kept by putting the QSA layer first in each group.
The MTP module (`mtp.*`, one decoder layer numbered `num_hidden_layers`) has random weights and
a random router: vLLM's target model never runs it, and cold files never name its layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from eotools.ple_table import _primes_after

from .plant import CONTEXT_VALUE, EOS_ID, TOPIC_VALUE, Plan
from .weights import TensorFactory, gptq_config

ARCHITECTURE = "Qwen4ExpForCausalLM"
# What each non-planted writer (attention or Gated DeltaNet output, shared expert, PLE) adds
# to the token subspace of the residual stream, about; small next to the experts' share.
EXTRA_OUTPUT_NORM = 0.05
HC_GATE = 0.5  # sigmoid(0): the hyper-connection gate of every reserved dimension
LM_PREFIX = "model.language_model"


@dataclass(frozen=True)
class Qwen4ExpShape:
    """What a Qwen4Exp checkpoint has beyond the MoE geometry (plant.Geometry)."""

    full_attention_every: int = 4  # one QSA layer per group of this many (the first)
    hc_count: int = 4
    hc_lowrank: int = 320
    shared_expert_width: int = 640
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel: int = 4
    indexer_n_heads: int = 16
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 4099  # rows per n-gram head, about (the real model: 20M)
    ngram_divisible_by: int = 128
    ple_conv_kernel: int = 4
    partial_rotary_factor: float = 0.25
    mtp_layers: int = 1

    def layer_types(self, num_layers: int) -> list[str]:
        return [
            "full_attention" if i % self.full_attention_every == 0 else "linear_attention"
            for i in range(num_layers)
        ]

    def ple_layers(self, num_layers: int) -> list[int]:
        """0-based layers with a PLE module: the second layer of each stage of a PP=2 split
        (vLLM gives the first stage num_layers // 2 layers), never layer 0, whose attention
        must see the bare embedding to plant the context."""
        if num_layers < 4:
            raise ValueError("a Qwen4Exp test model needs at least 4 layers (2 per PP stage)")
        return [1, num_layers // 2 + 1]

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


def ngram_rows(shape: Qwen4ExpShape, dense_id: int) -> int:
    """Rows of one PLE layer's n-gram table as vLLM sizes it (nvidia/ple_layer.py): head h of
    PLE layer d holds the (d * heads + h + 1)-th prime >= ngram_vocab_size_base rows; the sum
    is padded to a multiple of ngram_divisible_by."""
    wanted = (dense_id + 1) * shape.ngram_heads
    primes = _primes_after(shape.ngram_vocab_size_base - 1, wanted)
    total = sum(primes[dense_id * shape.ngram_heads :])
    d = shape.ngram_divisible_by
    return -(-total // d) * d


def ple_table_bytes(shape: Qwen4ExpShape, num_layers: int, hidden_size: int) -> int:
    """Bytes of every PLE layer's n-gram table in the checkpoint (BF16, width hidden over
    the n-gram heads)."""
    width = hidden_size // shape.ngram_heads
    layers = len(shape.ple_layers(num_layers))
    return sum(ngram_rows(shape, d) * width * 2 for d in range(layers))


def hf_config(plan: Plan, shape: Qwen4ExpShape, quant: str, max_positions: int) -> dict:
    g = plan.geometry
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": 4 * g.moe_intermediate_size,  # dense MLP size; no layer uses one
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "layer_types": shape.layer_types(g.num_layers),
        "linear_conv_kernel_dim": shape.linear_conv_kernel,
        "linear_key_head_dim": shape.linear_head_dim,
        "linear_value_head_dim": shape.linear_head_dim,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "moe_intermediate_size": g.moe_intermediate_size,
        "shared_expert_intermediate_size": shape.shared_expert_width,
        "num_experts": g.num_experts,
        "num_experts_per_tok": g.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hc_count": shape.hc_count,
        "hc_lowrank": shape.hc_lowrank,
        "ple_layer_ids": [i + 1 for i in shape.ple_layers(g.num_layers)],  # 1-based
        "ple_embed_dim": g.hidden_size,
        "ple_conv_kernel_size": shape.ple_conv_kernel,
        "ngram_size": shape.ngram_size,
        "heads_per_ngram": shape.heads_per_ngram,
        "ngram_vocab_size_base": shape.ngram_vocab_size_base,
        "make_ngram_vocab_size_divisible_by": shape.ngram_divisible_by,
        "indexer_n_heads": shape.indexer_n_heads,
        "indexer_kv_heads": 1,
        "indexer_head_dim": shape.indexer_head_dim,
        "indexer_budget": shape.indexer_budget,
        "indexer_compress_ratio": shape.indexer_compress_ratio,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": shape.partial_rotary_factor,
        },
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mtp_num_hidden_layers": shape.mtp_layers,
        "mamba_ssm_dtype": "float32",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen4_exp",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    if quant == "int4":
        # vLLM infers the quantised modules from the safetensors dtypes: the routed experts
        # (model and MTP) only; everything else is BF16 and stays unquantised
        cfg["quantization_config"] = gptq_config()
    return cfg


class Qwen4ExpTensors(TensorFactory):
    """The Qwen4Exp checkpoint's tensors (Hugging Face names, `model.language_model.*` and
    `mtp.*`), planted as the module docstring says."""

    def __init__(self, plan: Plan, shape: Qwen4ExpShape, quant: str, device: str = "cpu"):
        super().__init__(plan, quant, device)
        self.shape = shape
        self.ple = shape.ple_layers(plan.geometry.num_layers)
        h = plan.geometry.hidden_size
        if h % shape.ngram_heads:
            raise ValueError(f"hidden_size {h} must be a multiple of {shape.ngram_heads}")
        # the reserved dimensions of every stream of the [hc_count * hidden] state
        reserved = torch.arange(plan.token_dims, h, device=self.device)
        self.reserved_all = torch.cat([reserved + s * h for s in range(shape.hc_count)])

    # ---- scales ------------------------------------------------------------------------------
    def residual_norm(self, layers_done: int) -> float:
        base = super().residual_norm(layers_done)
        ple = sum(1 for p in self.ple if p < layers_done)
        extra = (2 * layers_done + ple) * EXTRA_OUTPUT_NORM**2
        return math.sqrt(base**2 + extra)

    def expert_scales(self) -> tuple[float, float]:
        # the experts read a mix whose gates are about 1/2: double the input scale
        s_in, s_out = super().expert_scales()
        return s_in / HC_GATE, s_out

    def _rand(self, *shape: int, std: float) -> torch.Tensor:
        return std * self._randn(*shape)

    def _writer(self, out_dim: int, in_dim: int, norm: float) -> torch.Tensor:
        """(out, in) output projection adding about `norm` to the token subspace only
        (input of unit RMS); rows of the reserved dimensions are zero."""
        w = self._rand(out_dim, in_dim, std=norm / math.sqrt(self.plan.token_dims * in_dim))
        w[self.plan.token_dims :] = 0.0
        return w

    # ---- hyper-connections ---------------------------------------------------------------------
    def hyper_connection(self, pre: str, inject: bool, final: bool = False) -> dict:
        """One GatedResidual: random low-rank gates for the token subspace, constant 1/2 for
        the reserved dimensions; random injection weights unless `inject` is False (then
        every stream adds the block's output once). The final mixer has constant gates."""
        s, h = self.shape, self.plan.geometry.hidden_size
        wide, r = s.hc_count * h, s.hc_lowrank
        norm = self._rand(wide, std=0.1)
        norm[self.reserved_all] = 0.0
        up = self._rand(wide, r, std=1.0 / math.sqrt(r))
        up[self.reserved_all] = 0.0
        out = {
            f"{pre}.hc_norm.weight": torch.zeros(wide, device=self.device) if final else norm,
            f"{pre}.input_mix_weight_down.weight": self._rand(r, wide, std=1 / math.sqrt(wide)),
            f"{pre}.input_mix_weight_up.weight": torch.zeros_like(up) if final else up,
        }
        if not final:
            inj = self._rand(s.hc_count, wide, std=1.0 / math.sqrt(wide))
            out[f"{pre}.block_inject_weight.weight"] = inj if inject else torch.zeros_like(inj)
        return out

    # ---- dense tensors -------------------------------------------------------------------------
    def dense(self) -> dict[str, torch.Tensor]:
        base = super().dense()
        out = {
            f"{LM_PREFIX}.embed_tokens.weight": base["model.embed_tokens.weight"],
            "lm_head.weight": base["lm_head.weight"] / HC_GATE,
        }
        out.update(self.hyper_connection(f"{LM_PREFIX}.hyper_connection_mixer", False, True))
        return out

    # ---- one decoder layer ---------------------------------------------------------------------
    def qsa(self, pre: str, planted: bool) -> dict[str, torch.Tensor]:
        """A QSA attention layer (queries packed with their sigmoid output gate, plus the
        indexer). `planted`: layer 0, zero queries and keys (uniform attention over the
        prefix) whose value reads the word's topic and whose output writes the context."""
        plan, g, s = self.plan, self.plan.geometry, self.shape
        h, hd, nh, nkv = g.hidden_size, g.head_dim, g.num_attention_heads, g.num_key_value_heads
        std_in = 1.0 / (HC_GATE * math.sqrt(h))
        if planted:
            q = torch.zeros(2 * nh * hd, h, device=self.device)
            k = torch.zeros(nkv * hd, h, device=self.device)
            v = torch.zeros(nkv * hd, h, device=self.device)
            o = torch.zeros(h, nh * hd, device=self.device)
            t = plan.planting.num_topics
            idx = torch.arange(t, device=self.device)
            # the attention input's topic dims: HC_GATE * TOPIC_VALUE * rms gain of the embedding
            v[idx, plan.own_slice.start + idx] = 1.0 / (
                HC_GATE * TOPIC_VALUE * self._rms_gain(self.embed_norm)
            )
            o[plan.context_slice.start + idx, idx] = CONTEXT_VALUE / HC_GATE  # output gate 1/2
        else:
            q = self._rand(2 * nh * hd, h, std=std_in)
            k = self._rand(nkv * hd, h, std=std_in)
            v = self._rand(nkv * hd, h, std=std_in)
            o = self._writer(h, nh * hd, EXTRA_OUTPUT_NORM / HC_GATE)
        ih = s.indexer_head_dim
        zeros = torch.zeros
        return {
            f"{pre}.q_proj.weight": q,
            f"{pre}.k_proj.weight": k,
            f"{pre}.v_proj.weight": v,
            f"{pre}.o_proj.weight": o,
            f"{pre}.q_norm.weight": zeros(hd, device=self.device),  # GemmaRMSNorm: 1 + w
            f"{pre}.k_norm.weight": zeros(hd, device=self.device),
            f"{pre}.indexer.index_qk_proj.weight": self._rand(
                (s.indexer_n_heads + 1) * ih, h, std=std_in
            ),
            f"{pre}.indexer.q_layernorm.weight": zeros(ih, device=self.device),
            f"{pre}.indexer.k_layernorm.weight": zeros(ih, device=self.device),
        }

    def gated_deltanet(self, pre: str) -> dict[str, torch.Tensor]:
        g, s = self.plan.geometry, self.shape
        h, nk, nv, d = (
            g.hidden_size,
            s.linear_num_key_heads,
            s.linear_num_value_heads,
            (s.linear_head_dim),
        )
        conv_dim = 2 * nk * d + nv * d
        std_in = 1.0 / (HC_GATE * math.sqrt(h))
        return {
            f"{pre}.in_proj_qkv.weight": self._rand(conv_dim, h, std=std_in),
            f"{pre}.in_proj_z.weight": self._rand(nv * d, h, std=std_in),
            f"{pre}.in_proj_b.weight": self._rand(nv, h, std=std_in),
            f"{pre}.in_proj_a.weight": self._rand(nv, h, std=std_in),
            f"{pre}.conv1d.weight": self._rand(conv_dim, 1, s.linear_conv_kernel, std=0.5),
            f"{pre}.dt_bias": torch.ones(nv, device=self.device),
            f"{pre}.A_log": torch.log(
                1 + 15 * torch.rand(nv, generator=self.gen, device=self.device)
            ),
            f"{pre}.norm.weight": torch.ones(d, device=self.device),
            f"{pre}.out_proj.weight": self._writer(h, nv * d, EXTRA_OUTPUT_NORM),
        }

    def ple_module(self, pre: str, dense_id: int) -> dict[str, torch.Tensor]:
        """PLE: a random n-gram table; the value projection (and so the gated value and its
        short convolution) writes the token subspace only."""
        s, h = self.shape, self.plan.geometry.hidden_size
        wide, e = s.hc_count * h, h  # ple_embed_dim = hidden
        conv = self._rand(wide, 1, s.ple_conv_kernel, std=EXTRA_OUTPUT_NORM / math.sqrt(wide))
        conv[self.reserved_all] = 0.0
        rows = ngram_rows(s, dense_id)
        return {
            f"{pre}.ple_embedding.ngram_embedding.weight": self._randn(rows, e // s.ngram_heads),
            f"{pre}.key_proj.weight": self._rand(wide, e, std=1.0 / math.sqrt(e)),
            f"{pre}.value_proj.weight": self._writer(h, e, EXTRA_OUTPUT_NORM),
            f"{pre}.norm_key.weight": torch.zeros(wide, device=self.device),
            f"{pre}.norm_query.weight": torch.zeros(wide, device=self.device),
            f"{pre}.norm_conv.weight": torch.zeros(wide, device=self.device),
            f"{pre}.conv1d.weight": conv,
        }

    def shared_expert(self, pre: str) -> dict[str, torch.Tensor]:
        h, n = self.plan.geometry.hidden_size, self.shape.shared_expert_width
        std_in = 1.0 / (HC_GATE * math.sqrt(h))
        return {
            f"{pre}.shared_expert.gate_proj.weight": self._rand(n, h, std=std_in),
            f"{pre}.shared_expert.up_proj.weight": self._rand(n, h, std=std_in),
            f"{pre}.shared_expert.down_proj.weight": self._writer(h, n, 4 * EXTRA_OUTPUT_NORM),
            f"{pre}.shared_expert_gate.weight": self._rand(1, h, std=std_in),
        }

    def decoder_layer(self, pre: str, layer: int, kind: str, gate: torch.Tensor) -> dict:
        out: dict[str, torch.Tensor] = {}
        if layer in self.ple:
            out.update(self.ple_module(f"{pre}.ple", self.ple.index(layer)))
        if kind == "full_attention":
            out.update(self.qsa(f"{pre}.self_attn", planted=layer == 0))
        else:
            out.update(self.gated_deltanet(f"{pre}.linear_attn"))
        out.update(self.hyper_connection(f"{pre}.attn_hyper_connection", inject=layer != 0))
        out.update(self.hyper_connection(f"{pre}.mlp_hyper_connection", inject=True))
        out[f"{pre}.mlp.gate.weight"] = gate
        out.update(self.shared_expert(f"{pre}.mlp"))
        return out

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        kind = self.shape.layer_types(self.plan.geometry.num_layers)[layer]
        pre = f"{LM_PREFIX}.layers.{layer}"
        # the planted router, doubled: it reads the reserved dims through gates of 1/2
        out = self.decoder_layer(pre, layer, kind, self.gate(layer) / HC_GATE)
        out.update(self.experts(layer, f"{pre}.mlp.experts"))
        return out

    def mtp(self) -> dict[str, torch.Tensor]:
        """The MTP module: one full-attention decoder layer with random weights and router."""
        g, s = self.plan.geometry, self.shape
        h = g.hidden_size
        n = g.num_layers  # the MTP layer's number in vLLM; its checkpoint index is 0
        out = {
            "mtp.fc_embedding.weight": self._rand(h, h, std=1.0 / math.sqrt(h)),
            "mtp.fc_hidden.weight": self._rand(h, h, std=1.0 / math.sqrt(h)),
            "mtp.pre_fc_norm_embedding.weight": torch.zeros(h, device=self.device),
            "mtp.pre_fc_norm_hidden.weight": torch.zeros(s.hc_count * h, device=self.device),
        }
        out.update(self.hyper_connection("mtp.hyper_connection_mixer", False, True))
        gate = self._rand(g.num_experts, h, std=1.0 / math.sqrt(h))
        out.update(self.decoder_layer("mtp.layers.0", n, "full_attention", gate))
        out.update(self.experts(n, "mtp.layers.0.mlp.experts"))
        return out


PRESETS: dict[str, Qwen4ExpShape] = {
    # the target's per-stage geometry (24 layers: 6 QSA, 18 Gated DeltaNet)
    "target-stage": Qwen4ExpShape(),
    # CPU tests and quick GPU runs: 6 layers (QSA, GDN, GDN per PP stage)
    "tiny": Qwen4ExpShape(
        full_attention_every=3,
        hc_lowrank=16,
        shared_expert_width=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_head_dim=32,
        indexer_n_heads=4,
        indexer_head_dim=64,
        ngram_vocab_size_base=1021,
    ),
}
