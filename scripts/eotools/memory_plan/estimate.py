# SPDX-License-Identifier: Apache-2.0
"""The plan: each pipeline rank's VRAM (its stage's weights, KV, buffers and the activation
allowance, less the routed experts put on host) and the host RAM of all ranks, with how many
routed experts must leave VRAM for each card to fit.

Placement follows vLLM 0.29.0 as released (file:line in that tree):

- Stages: `get_pp_indices` (distributed/utils.py:127), honouring VLLM_PP_LAYER_PARTITION.
- Qwen4Exp builds `embed_tokens` and `lm_head` on every pipeline rank (models/qwen4_exp/nvidia/
  model.py:408,644; no PPMissingLayer), the final hyper-connection mixer on the last rank only
  (:432). Other architectures: embeddings on the first rank, LM head on the last.
- Activations, CUDA graphs, workspaces: no formula in vLLM; the allowance is the publisher's
  measurement (its 2x32GB write-up, sections 1 and 3.5): 1.6 GiB per card besides weights at
  prefill chunk 512, of which 0.34 GiB was KV, and 0.4-0.7 GiB more at chunk 2048 (the upper
  end is used, linear in the chunk), plus the model's own per-chunk buffers computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..selection import GiB, SelectionError, stage_layers
from .errors import PlanError
from .kv_cache import KV, kv_for_rank
from .model_shape import ModelShape
from .serving import Serving
from .weights import EMBED, EXPERTS, FINAL, LAYER, LM_HEAD, MTP, PLE_TABLE, VISION, Weights

# The publisher's non-weight VRAM per card (RTX 3090; its 2x32GB write-up, section 1):
# 1.6 GiB including 0.34 GiB of KV at chunk 512; chunk 2048 adds 0.4-0.7 GiB (section 3.5;
# upper end used).
ALLOWANCE_BASE_GIB = 1.6 - 0.34
ALLOWANCE_CHUNK_BASE = 512
ALLOWANCE_GIB_PER_CHUNK_TOKEN = 0.7 / (2048 - 512)
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
    """Activations, CUDA graphs and workspaces of one card: the publisher's measurement at
    chunk 512, grown linearly with the prefill chunk (vLLM has no formula for them)."""
    extra = max(s.max_num_batched_tokens - ALLOWANCE_CHUNK_BASE, 0)
    return int((ALLOWANCE_BASE_GIB + extra * ALLOWANCE_GIB_PER_CHUNK_TOKEN) * GiB)


@dataclass
class Card:
    """One pipeline rank's card: what its VRAM holds, and whether that fits."""

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
    """Every card of the topology, the host RAM they need together, and the notes the
    output gives with them."""

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
    """The plan of `shape` with `weights` served as `s`: the layers split into stages as vLLM
    splits them, each stage's routed experts up to the host budget moved to host."""
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
