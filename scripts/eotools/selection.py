# SPDX-License-Identifier: Apache-2.0
"""Choosing and evaluating cold sets (docs/cold-sets.md).

Counts of several data kinds are normalised (each set sums to 1) and added, optionally
weighted; then, per pipeline stage, the least-used (layer, expert) pairs of the stage's layers
are taken until the stage's byte budget is reached. A cold set is judged by the host reads per
token it causes on held-out counts, against a uniform-random cold set of the same size.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .counts import Counts

GiB = 1 << 30
MiB = 1 << 20


class SelectionError(ValueError):
    """A budget or input the selection cannot honour; the message names the fix."""


def stage_layers(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[range]:
    """Layers of each pipeline stage, as vLLM 0.29.0 splits them (get_pp_indices): an even
    split whose remainder goes to the stages before the last, or VLLM_PP_LAYER_PARTITION."""
    if partition:
        parts = list(partition)
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise SelectionError(
                f"layer partition {parts} does not split {num_layers} layers into {pp_size} stages"
            )
    else:
        if pp_size < 1 or pp_size > num_layers:
            raise SelectionError(f"cannot split {num_layers} layers into {pp_size} stages")
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    starts = np.cumsum([0] + parts[:-1])
    return [range(int(s), int(s) + p) for s, p in zip(starts, parts, strict=True)]


def normalised_usage(
    sets: Sequence[Counts], weights: Sequence[float] | None = None, phase: str = "all"
) -> np.ndarray:
    """Sum over data sets of weight x (counts / total counts of that set)."""
    if not sets:
        raise SelectionError("no counts given")
    weights = list(weights) if weights is not None else [1.0] * len(sets)
    if len(weights) != len(sets) or any(w < 0 for w in weights) or sum(weights) == 0:
        raise SelectionError("give one non-negative weight per counts file, not all zero")
    shape = sets[0].prefill.shape
    usage = np.zeros(shape, dtype=np.float64)
    for c, w in zip(sets, weights, strict=True):
        picks = c.picks(phase).astype(np.float64)
        if picks.shape != shape:
            raise SelectionError(
                f"data set {c.data.get('name')!r} has counts of shape "
                f"{picks.shape}, the others {shape}"
            )
        if picks.sum() == 0:
            raise SelectionError(f"data set {c.data.get('name')!r} has no {phase} picks")
        usage += w * picks / picks.sum()
    return usage


MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own cap


def safetensors_header_at(path: pathlib.Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its
    tensor data starts, read without the weights; SelectionError naming the file where it
    is not one."""
    bad = f"{path}: not a safetensors file"
    fix = "re-download the checkpoint (a file cut short or replaced)"
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SelectionError(f"{bad} (shorter than 8 bytes); {fix}")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise SelectionError(f"{bad} (a header of {n:,} bytes); {fix}")
            body = f.read(n)
    except OSError as e:
        raise SelectionError(f"{bad} ({e.strerror}); {fix}") from None
    try:
        header = json.loads(body) if len(body) == n else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise SelectionError(f"{bad} (its header is cut short or not a JSON object); {fix}")
    return 8 + n, header


def safetensors_header(path: pathlib.Path) -> dict[str, Any]:
    """The header alone (safetensors_header_at)."""
    return safetensors_header_at(path)[1]


def _span(path: pathlib.Path, key: str, meta: Any) -> int:
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SelectionError(
            f"{path}: tensor {key[:80]!r} has no valid data_offsets in the safetensors "
            "header; re-download the checkpoint"
        )
    return offsets[1] - offsets[0]


def expert0_tensor_bytes(model_dir: pathlib.Path) -> dict[str, int]:
    """Bytes of each tensor of expert 0 of the first MoE layer in the checkpoint, by its name
    after '.experts.0.' (e.g. 'gate_proj.qweight'), read from the safetensors headers (no
    weights are loaded); empty where the checkpoint has no safetensors files or experts."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            where = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            where = None
        if not isinstance(where, dict) or not all(isinstance(v, str) for v in where.values()):
            raise SelectionError(
                f"{index}: not a safetensors index with a 'weight_map' of tensor names to "
                "files; re-download the checkpoint"
            )
        files = sorted(set(where.values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    pattern = None
    sizes: dict[str, int] = {}
    for name in files:
        header = safetensors_header(model_dir / name)
        for key, meta in header.items():
            if key == "__metadata__" or ".experts.0." not in key:
                continue
            prefix, tensor = key.split(".experts.0.", 1)
            if pattern is None:
                pattern = prefix
            if prefix == pattern:
                sizes[tensor] = _span(model_dir / name, key, meta)
        if pattern is not None:
            break
    return sizes


def expert_bytes(model_dir: pathlib.Path) -> int:
    """Bytes of one routed expert in the checkpoint: every tensor of expert 0 of the first MoE
    layer, read from the safetensors headers (no weights are loaded). A make-test-model
    directory written without weights states it in synthetic_model.json."""
    desc = model_dir / "synthetic_model.json"
    if not any(model_dir.glob("*.safetensors")) and desc.exists():
        try:
            stated = json.loads(desc.read_text()).get("expert_bytes")
        except (OSError, ValueError, AttributeError):
            stated = None
        if not isinstance(stated, int) or isinstance(stated, bool) or stated <= 0:
            raise SelectionError(
                f"{desc}: no 'expert_bytes' as a whole number > 0; remake the test model "
                "with scripts/make-test-model"
            )
        return stated
    total = sum(expert0_tensor_bytes(model_dir).values())
    if not total:
        raise SelectionError(
            f"{model_dir}: found no routed expert tensors (names with "
            "'.experts.0.') in the checkpoint; give --expert-bytes"
        )
    return total


@dataclass(frozen=True)
class StagePick:
    stage: int
    layers: Sequence[int]
    budget_bytes: int
    experts: int  # how many (layer, expert) pairs were taken
    bytes: int


def select_cold(
    usage: np.ndarray,
    stages: Sequence[Sequence[int]],
    budgets_gib: Sequence[float],
    bytes_per_expert: int,
) -> tuple[dict[int, list[int]], list[StagePick]]:
    """Per stage, the least-used experts of its layers until the budget is reached."""
    if len(budgets_gib) == 1:
        budgets_gib = list(budgets_gib) * len(stages)
    if len(budgets_gib) != len(stages):
        raise SelectionError(
            f"{len(budgets_gib)} budgets for {len(stages)} pipeline stages: "
            "give one budget, or one per stage"
        )
    layers_, experts = usage.shape
    cold: dict[int, list[int]] = {}
    picks = []
    for s, (layers, gib) in enumerate(zip(stages, budgets_gib, strict=True)):
        budget = int(gib * GiB)
        n = budget // bytes_per_expert
        available = len(layers) * experts
        if gib < 0:
            raise SelectionError(f"stage {s}: a budget cannot be negative")
        if 0 < budget < bytes_per_expert:
            raise SelectionError(
                f"stage {s}: a budget of {gib} GiB is smaller than one expert "
                f"({bytes_per_expert / 2**20:.2f} MiB); give at least "
                f"{bytes_per_expert / GiB:.4f} GiB, or 0 for no host experts"
            )
        if n > available:
            raise SelectionError(
                f"stage {s}: a budget of {gib} GiB holds {n} experts, but the stage's "
                f"{len(layers)} layers have only {available} "
                f"({available * bytes_per_expert / GiB:.2f} GiB): lower the budget"
            )
        if n == available:
            raise SelectionError(
                f"stage {s}: a budget of {gib} GiB moves every expert of the stage to the "
                "host; use VLLM_EXPERT_HOST_LAYERS for whole layers, or lower the budget"
            )
        flat = [(usage[layer, e], layer, e) for layer in layers for e in range(experts)]
        flat.sort()
        for _, layer, e in flat[:n]:
            cold.setdefault(layer, []).append(e)
        picks.append(StagePick(s, layers, budget, n, n * bytes_per_expert))
    return {k: sorted(v) for k, v in sorted(cold.items())}, picks


@dataclass(frozen=True)
class Evaluation:
    data: str
    tokens: int
    host_reads_per_token: float
    uniform_reads_per_token: float

    @property
    def ratio(self) -> float:
        u = self.uniform_reads_per_token
        return self.host_reads_per_token / u if u else float("nan")


def evaluate(cold: dict[int, list[int]], counts: Counts, phase: str = "decode") -> Evaluation:
    """Host reads per token a cold set causes on counted data, and the expected reads of a
    uniform-random cold set with the same number of host experts in every layer."""
    picks = counts.picks(phase)
    tokens = counts.tokens(phase)
    if tokens == 0:
        raise SelectionError(f"data set {counts.data.get('name')!r} has no {phase} tokens")
    experts = picks.shape[1]
    reads = sum(int(picks[layer, ids].sum()) for layer, ids in cold.items())
    per_layer_picks = picks.sum(axis=1) / tokens  # top_k for every MoE layer
    uniform = sum(per_layer_picks[layer] * len(ids) / experts for layer, ids in cold.items())
    return Evaluation(counts.data.get("name", "?"), tokens, reads / tokens, float(uniform))
