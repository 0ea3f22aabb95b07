# SPDX-License-Identifier: Apache-2.0
"""Tensors of the synthetic Qwen3-MoE checkpoint, built from a Plan (see plant.py).

Only the embedding, layer 0's attention, the router gates and the language-model head carry the
planted structure; the experts are random INT4 (or their BF16 dequantisation) whose outputs
write only the token subspace, with a size (MOE_OUTPUT_NORM per layer) large enough that a wrong
expert visibly changes the next-token logprobs, which is what the offload correctness tests need.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from . import gptq
from .plant import (
    CONST_VALUE,
    CONTEXT_VALUE,
    DOMAIN_LOGIT,
    MOE_OUTPUT_NORM,
    NOISE_NORM,
    PAIR_LOGIT_SIGMA,
    SUCCESSOR_LOGIT,
    TOKEN_NORM,
    TOPIC_VALUE,
    Plan,
)

GROUP = 128


def gptq_config() -> dict:
    """config.json's quantization_config for the INT4 experts: GPTQ v1 packing, symmetric,
    group GROUP, which vLLM 0.29.0 sends to Marlin."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }


NIBBLE_STD = math.sqrt(sum(v * v for v in range(-7, 8)) / 15)  # nibbles 1..15 -> values -7..7
DTYPE = torch.bfloat16
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _silu_sq_mean() -> float:
    """E[silu(g)^2] for g ~ N(0, 1), by quadrature (what one expert unit's square averages)."""
    g = np.linspace(-12, 12, 200001)
    pdf = np.exp(-g * g / 2) / math.sqrt(2 * math.pi)
    silu = g / (1 + np.exp(-g))
    return float(np.sum(silu * silu * pdf) * (g[1] - g[0]))


class TensorFactory:
    """Builds the checkpoint's tensors; `device` only speeds up random generation."""

    def __init__(self, plan: Plan, quant: str, device: str = "cpu") -> None:
        if quant not in ("int4", "bf16"):
            raise ValueError(f"unknown quantisation {quant!r}: expected int4 or bf16")
        g = plan.geometry
        for size, name in ((g.hidden_size, "hidden_size"), (g.moe_intermediate_size, "width")):
            if quant == "int4" and size % GROUP:
                raise ValueError(f"{name} {size} must be a multiple of the group size {GROUP}")
        self.plan, self.quant, self.device = plan, quant, torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(plan.planting.seed + 7)

    # ---- norms of the residual stream that the scales below compensate -------------------
    @property
    def embed_norm(self) -> float:
        return math.sqrt(TOKEN_NORM**2 + CONST_VALUE**2 + TOPIC_VALUE**2 + NOISE_NORM**2)

    def residual_norm(self, layers_done: int) -> float:
        """Typical norm of the residual stream after `layers_done` MoE layers."""
        ctx_sq = 0.6 * CONTEXT_VALUE**2  # a conversation's mean topic vector has |ctx|^2 ~ 0.6
        return math.sqrt(self.embed_norm**2 + ctx_sq + layers_done * MOE_OUTPUT_NORM**2)

    def _rms_gain(self, norm: float) -> float:
        return math.sqrt(self.plan.geometry.hidden_size) / norm

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device)

    # ---- dense tensors -----------------------------------------------------------------------
    def token_directions(self) -> torch.Tensor:
        """(V, token_dims) unit vectors: each token's identity, read by the LM head."""
        u = self._randn(self.plan.geometry.vocab_size, self.plan.token_dims)
        return u / u.norm(dim=1, keepdim=True)

    def dense(self) -> dict[str, torch.Tensor]:
        plan, g = self.plan, self.plan.geometry
        v, h, td = g.vocab_size, g.hidden_size, plan.token_dims
        u = self.token_directions()
        emb = torch.zeros(v, h, device=self.device)
        emb[:, :td] = TOKEN_NORM * u
        emb[:, plan.const_dim] = CONST_VALUE
        topics = torch.as_tensor(plan.word_topic, device=self.device)
        has = torch.nonzero(topics >= 0).squeeze(1)
        emb[has, plan.own_slice.start + topics[has]] = TOPIC_VALUE
        noise = torch.as_tensor(plan.word_noise, dtype=torch.float32, device=self.device)
        emb[:, plan.noise_slice] = NOISE_NORM * noise

        # LM head: the planted successor of token t gets SUCCESSOR_LOGIT from t's direction,
        # every pair a random logit, and every word DOMAIN_LOGIT times the share of its domain
        # in the conversation's context (this is what picks the first word after a role word).
        gain = self._rms_gain(self.residual_norm(g.num_layers))
        head = torch.zeros(v, h, device=self.device)
        head[:, :td] = PAIR_LOGIT_SIGMA * self._randn(v, td)
        succ = torch.as_tensor(plan.successor, device=self.device)
        src = torch.nonzero(succ >= 0).squeeze(1)
        head[succ[src], :td] += SUCCESSOR_LOGIT * u[src]
        head[:, :td] /= TOKEN_NORM * gain
        z = plan.planting.topics_per_domain
        word_domain = torch.where(topics >= 0, topics // z, -1)
        ctx_domain = torch.arange(plan.planting.num_topics, device=self.device) // z
        same = (word_domain[:, None] == ctx_domain[None, :]).float()
        head[:, plan.context_slice] = DOMAIN_LOGIT * same / (CONTEXT_VALUE * gain)
        head[0] = 0.0  # end-of-text: never the planted choice
        ones = torch.ones(h, device=self.device)
        return {
            "model.embed_tokens.weight": emb,
            "model.norm.weight": ones,
            "lm_head.weight": head,
        }

    # ---- one decoder layer -------------------------------------------------------------------
    def attention(self, layer: int) -> dict[str, torch.Tensor]:
        """Zero queries (uniform causal attention); layer 0 copies the mean topic one-hot of the
        prefix into the context dimensions, the other layers add nothing."""
        plan, g = self.plan, self.plan.geometry
        h, hd = g.hidden_size, g.head_dim
        q = torch.zeros(g.num_attention_heads * hd, h, device=self.device)
        k = torch.zeros(g.num_key_value_heads * hd, h, device=self.device)
        vproj = torch.zeros(g.num_key_value_heads * hd, h, device=self.device)
        o = torch.zeros(h, g.num_attention_heads * hd, device=self.device)
        if layer == 0:
            t = plan.planting.num_topics
            idx = torch.arange(t, device=self.device)
            # value = one-hot topic (input_layernorm scales the embedding by rms_gain)
            vproj[idx, plan.own_slice.start + idx] = 1.0 / (
                TOPIC_VALUE * self._rms_gain(self.embed_norm)
            )
            o[plan.context_slice.start + idx, idx] = CONTEXT_VALUE  # query head 0 -> context
        pre = f"model.layers.{layer}"
        return {
            f"{pre}.self_attn.q_proj.weight": q,
            f"{pre}.self_attn.k_proj.weight": k,
            f"{pre}.self_attn.v_proj.weight": vproj,
            f"{pre}.self_attn.o_proj.weight": o,
            f"{pre}.self_attn.q_norm.weight": torch.ones(hd, device=self.device),
            f"{pre}.self_attn.k_norm.weight": torch.ones(hd, device=self.device),
            f"{pre}.input_layernorm.weight": torch.ones(h, device=self.device),
            f"{pre}.post_attention_layernorm.weight": torch.ones(h, device=self.device),
        }

    def gate(self, layer: int) -> torch.Tensor:
        """(E, H) router weights whose logits are the plan's router_logits (up to RMSNorm)."""
        plan, p = self.plan, self.plan.planting
        r = plan.routers[layer]
        aff = r.topic_affinity(p.topics_per_domain)  # (D*Z, E)
        w = np.zeros((plan.geometry.num_experts, plan.geometry.hidden_size))
        w[:, plan.const_dim] = r.bias / CONST_VALUE
        w[:, plan.own_slice] = p.own_weight * aff.T / TOPIC_VALUE
        w[:, plan.context_slice] = p.context_weight * aff.T / CONTEXT_VALUE
        w[:, plan.noise_slice] = r.noise / NOISE_NORM
        w /= self._rms_gain(self.residual_norm(layer))
        return torch.as_tensor(w, dtype=torch.float32, device=self.device)

    def expert_scales(self) -> tuple[float, float]:
        """Mean GPTQ scales of gate/up and down projections giving unit pre-activations and
        a mixed expert output of norm MOE_OUTPUT_NORM in the residual stream."""
        g = self.plan.geometry
        s_in = 1.0 / (math.sqrt(g.hidden_size) * NIBBLE_STD)
        unit = math.sqrt(_silu_sq_mean() * g.moe_intermediate_size) * NIBBLE_STD
        s_out = MOE_OUTPUT_NORM * math.sqrt(g.top_k) / (math.sqrt(self.plan.token_dims) * unit)
        return s_in, s_out

    def _quantised(self, n_in: int, n_out: int, scale: float, live_out: int) -> tuple:
        """Random nibbles 1..15 and per-group scales (output channels >= live_out get 0)."""
        q = torch.randint(1, 16, (n_in, n_out), generator=self.gen, device=self.device)
        s = scale * (
            0.75 + 0.5 * torch.rand(n_in // GROUP, n_out, generator=self.gen, device=self.device)
        )
        s[:, live_out:] = 0.0
        return q, s

    def experts(self, layer: int, prefix: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Routed experts of one layer, named `<prefix>.E.<proj>.*` (default
        `model.layers.<layer>.mlp.experts`)."""
        g, plan = self.plan.geometry, self.plan
        prefix = prefix or f"model.layers.{layer}.mlp.experts"
        h, n = g.hidden_size, g.moe_intermediate_size
        s_in, s_out = self.expert_scales()
        shapes = {
            "gate_proj": (h, n, s_in, n),
            "up_proj": (h, n, s_in, n),
            "down_proj": (n, h, s_out, plan.token_dims),
        }
        for e in range(g.num_experts):
            pre = f"{prefix}.{e}"
            for proj in PROJECTIONS:
                n_in, n_out, scale, live = shapes[proj]
                q, s = self._quantised(n_in, n_out, scale, live)
                if self.quant == "int4":
                    yield f"{pre}.{proj}.qweight", gptq.pack_rows(q)
                    yield f"{pre}.{proj}.scales", s.to(torch.float16)
                    yield f"{pre}.{proj}.qzeros", gptq.qzeros(n_in, n_out, GROUP, self.device)
                    yield f"{pre}.{proj}.g_idx", gptq.g_idx(n_in, GROUP, self.device)
                else:
                    w = (q.float() - gptq.ZERO) * s.repeat_interleave(GROUP, dim=0)
                    yield f"{pre}.{proj}.weight", w.t().contiguous()

    def expert_bytes(self) -> int:
        """Checkpoint bytes of one routed expert (all tensors of its three projections)."""
        g = self.plan.geometry
        h, n = g.hidden_size, g.moe_intermediate_size
        total = 0
        for n_in, n_out in ((h, n), (h, n), (n, h)):
            if self.quant == "int4":
                total += n_in // 8 * n_out * 4  # qweight
                total += n_in // GROUP * n_out * 2  # fp16 scales
                total += n_in // GROUP * n_out // 8 * 4  # qzeros
                total += n_in * 4  # g_idx
            else:
                total += n_in * n_out * 2
        return total

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        out = self.attention(layer)
        out[f"model.layers.{layer}.mlp.gate.weight"] = self.gate(layer)
        out.update(self.experts(layer))
        return out


def to_checkpoint_dtype(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating tensors in BF16 (GPTQ scales stay FP16), all on the CPU and contiguous."""
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and not name.endswith(".scales"):
            t = t.to(DTYPE)
        out[name] = t.contiguous().cpu()
    return out
