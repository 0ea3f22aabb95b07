# SPDX-License-Identifier: Apache-2.0
"""A plain-PyTorch forward pass of a Qwen3-MoE checkpoint (GPTQ INT4 or BF16 experts), written
from the architecture, not from vLLM, so tests can check what a checkpoint computes and which
experts its routers pick without a GPU. Float32 throughout; slow but exact enough."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
from safetensors import safe_open

from . import gptq


@dataclass
class ForwardResult:
    logits: torch.Tensor  # (T, V) float32
    topk_ids: torch.Tensor  # (T, layers, top_k) int64, sorted by router weight (desc)


class ReferenceModel:
    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.cfg = json.loads((self.path / "config.json").read_text())
        index = json.loads((self.path / "model.safetensors.index.json").read_text())
        self._where = index["weight_map"]
        self._handles: dict[str, object] = {}
        q = self.cfg.get("quantization_config")
        self.group = q["group_size"] if q else None
        self._experts: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def tensor(self, name: str) -> torch.Tensor:
        shard = self._where[name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._handles[shard].get_tensor(name)

    def _linear_weight(self, prefix: str) -> torch.Tensor:
        """(out, in) float32 weight of a projection, dequantising GPTQ layers."""
        if f"{prefix}.qweight" in self._where:
            w = gptq.dequantize(
                self.tensor(f"{prefix}.qweight"), self.tensor(f"{prefix}.scales"), self.group
            )
            return w.t()
        return self.tensor(f"{prefix}.weight").float()

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        key = (layer, e)
        if key not in self._experts:
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            self._experts[key] = tuple(
                self._linear_weight(f"{pre}.{p}") for p in ("gate_proj", "up_proj", "down_proj")
            )
        return self._experts[key]

    def _rms(self, x: torch.Tensor, weight_name: str) -> torch.Tensor:
        eps = self.cfg["rms_norm_eps"]
        w = self.tensor(weight_name).float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = positions[:, None].float() * inv[None, :]
        cos, sin = ang.cos().repeat(1, 2)[:, None, :], ang.sin().repeat(1, 2)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _attention(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        c, pre = self.cfg, f"model.layers.{layer}.self_attn"
        t, nh, nkv, hd = (
            h.shape[0],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        q = (h @ self._linear_weight(f"{pre}.q_proj").t()).view(t, nh, hd)
        k = (h @ self._linear_weight(f"{pre}.k_proj").t()).view(t, nkv, hd)
        v = (h @ self._linear_weight(f"{pre}.v_proj").t()).view(t, nkv, hd)
        q, k = self._rms(q, f"{pre}.q_norm.weight"), self._rms(k, f"{pre}.k_norm.weight")
        pos = torch.arange(t)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", scores, v).reshape(t, nh * hd)
        return out @ self._linear_weight(f"{pre}.o_proj").t()

    def _moe(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.cfg["num_experts_per_tok"]
        gate = self.tensor(f"model.layers.{layer}.mlp.gate.weight")
        # the router GEMM in the checkpoint's dtype, as inference engines run it
        logits = (h.to(gate.dtype) @ gate.t()).float()
        probs = logits.softmax(-1)
        w, ids = probs.topk(k, dim=-1)
        if self.cfg.get("norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            g, u, d = self.expert(layer, e)
            x = h[rows]
            y = (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()
            out.index_add_(0, rows, y * w[rows, slot, None])
        return out, ids

    @torch.no_grad()
    def forward(self, token_ids: list[int]) -> ForwardResult:
        ids = torch.as_tensor(token_ids)
        x = self.tensor("model.embed_tokens.weight").float()[ids]
        picks = []
        for layer in range(self.cfg["num_hidden_layers"]):
            pre = f"model.layers.{layer}"
            x = x + self._attention(layer, self._rms(x, f"{pre}.input_layernorm.weight"))
            moe, topk = self._moe(layer, self._rms(x, f"{pre}.post_attention_layernorm.weight"))
            x = x + moe
            picks.append(topk)
        x = self._rms(x, "model.norm.weight")
        logits = x @ self.tensor("lm_head.weight").float().t()
        return ForwardResult(logits, torch.stack(picks, dim=1))

    def greedy(self, token_ids: list[int], n: int) -> tuple[list[int], ForwardResult]:
        """Greedy decode of n tokens (recomputing the prefix each step: fine for tiny models).
        Returns the new tokens and the forward result over prompt + all but the last token."""
        seq = list(token_ids)
        for _ in range(n):
            seq.append(int(self.forward(seq).logits[-1].argmax()))
        return seq[len(token_ids) :], self.forward(seq[:-1])
