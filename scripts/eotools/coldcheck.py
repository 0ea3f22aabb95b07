# SPDX-License-Identifier: Apache-2.0
"""A cold file against the model it is meant for, without vLLM: its format (cold/README.md),
the model's shape from config.json, the host experts per pipeline rank and their bytes. The
same rules the series applies at start-up (fused_moe/expert_offload/cold_file.py and
planner.py), so the preflight can refuse a file before minutes of loading."""

from __future__ import annotations

import contextlib
import json
import pathlib
from dataclasses import dataclass
from typing import Any

from .coldset import FORMAT as COLD_FORMAT
from .coldset import VERSION as COLD_VERSION
from .selection import GiB, SelectionError, expert_bytes, stage_layers


@dataclass(frozen=True)
class ModelConfig:
    path: pathlib.Path
    architecture: str | None
    num_layers: int
    num_experts: int | None


def read_model_config(model: str | None) -> ModelConfig | None:
    """The shape of a local checkpoint from its config.json; None if `model` is not a local
    directory with one (a hub id: vLLM checks the cold file itself after downloading)."""
    if not model:
        return None
    path = pathlib.Path(model)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config", cfg)
    experts = text.get("num_experts") or text.get("n_routed_experts")
    experts = experts or text.get("num_local_experts")
    return ModelConfig(
        path,
        (cfg.get("architectures") or [None])[0],
        int(text["num_hidden_layers"]),
        int(experts) if experts else None,
    )


class ColdFileError(ValueError):
    """A cold file that vLLM would refuse; the message says what is wrong."""


def load_cold_file(path: pathlib.Path) -> dict[str, Any]:
    """Read a cold file and check it on its own, as the series does at start-up."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ColdFileError(f"not readable as JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != COLD_FORMAT:
        raise ColdFileError(f"not a cold file (its 'format' is not {COLD_FORMAT!r})")
    if doc.get("version") != COLD_VERSION:
        raise ColdFileError(f"format version {doc.get('version')!r}; expected {COLD_VERSION}")
    model = doc.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("num_experts"), int):
        raise ColdFileError("'model' must say how many experts per layer ('num_experts')")
    layers = doc.get("layers")
    if not isinstance(layers, dict):
        raise ColdFileError("'layers' must map layer numbers to lists of expert ids")
    parsed: dict[int, list[int]] = {}
    for key, ids in layers.items():
        if not key.isdigit():
            raise ColdFileError(f"layer key {key!r} is not a layer number")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise ColdFileError(f"layer {key}: expert ids must be a list of integers")
        if len(set(ids)) != len(ids):
            raise ColdFileError(f"layer {key} lists an expert more than once")
        bad = [i for i in ids if not 0 <= i < model["num_experts"]]
        if bad:
            raise ColdFileError(
                f"layer {key}: expert id(s) {bad[:8]} outside 0-{model['num_experts'] - 1}"
            )
        if ids:
            parsed[int(key)] = sorted(ids)
    doc["layers"] = parsed
    return doc


def parse_layer_list(text: str) -> set[int]:
    """VLLM_EXPERT_HOST_LAYERS syntax: numbers and ranges, comma separated ("0-5,40")."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"cannot read {part!r} in the layer list {text!r}")
        out.update(range(int(lo), int(hi if dash else lo) + 1))
    return out


@dataclass(frozen=True)
class HostPlan:
    """Host experts per pipeline rank, and their bytes where the expert size is known."""

    experts_per_rank: list[int]
    bytes_per_expert: int | None
    source: str  # where bytes_per_expert came from

    @property
    def total_bytes(self) -> int | None:
        if self.bytes_per_expert is None:
            return None
        return sum(self.experts_per_rank) * self.bytes_per_expert


def plan_host_experts(
    cold: dict[str, Any] | None,
    model: ModelConfig | None,
    pp: int,
    host_layers: str = "",
    partition: str = "",
) -> HostPlan:
    """How many host experts each pipeline rank holds (vLLM's layer split, or
    VLLM_PP_LAYER_PARTITION's), and the bytes of one: from the checkpoint's headers, else
    from the cold file's budget."""
    num_layers = model.num_layers if model else (cold or {}).get("model", {}).get("num_layers")
    num_experts = (model.num_experts if model else None) or (cold or {}).get("model", {}).get(
        "num_experts"
    )
    host = parse_layer_list(host_layers)
    parts = [int(x) for x in partition.split(",") if x.strip()] or None
    if num_layers:
        ranks = stage_layers(num_layers, pp, parts)
    else:  # layer count unknown: only the total matters
        ranks = [range(0, 1 << 30)] + [range(0)] * (pp - 1)
    cold_layers: dict[int, list[int]] = (cold or {}).get("layers", {})
    per_rank = []
    for layers in ranks:
        n = sum(len(ids) for layer, ids in cold_layers.items() if layer in layers)
        n += sum(num_experts or 0 for layer in host if layer in layers)
        per_rank.append(n)
    size, source = None, "unknown"
    if model is not None:
        with contextlib.suppress(SelectionError, OSError, ValueError, KeyError):
            size, source = expert_bytes(model.path), f"the checkpoint in {model.path}"
    budget = (cold or {}).get("budget") or {}
    if size is None and isinstance(budget.get("bytes_per_expert"), int):
        size, source = budget["bytes_per_expert"], "the cold file's budget"
    return HostPlan(per_rank, size, source)


def model_mismatches(cold: dict[str, Any], model: ModelConfig, host_layers: set[int]) -> list[str]:
    """Why vLLM would refuse this cold file for this model (empty: it fits)."""
    made_for = cold["model"]
    problems = []
    if made_for.get("architecture") and model.architecture not in (
        None,
        made_for["architecture"],
    ):
        problems.append(
            f"it was made for a {made_for['architecture']}, the model is a {model.architecture}"
        )
    if made_for.get("num_layers") not in (None, model.num_layers):
        problems.append(
            f"it was made for {made_for['num_layers']} layers, the model has {model.num_layers}"
        )
    if model.num_experts is not None and made_for["num_experts"] != model.num_experts:
        problems.append(
            f"it was made for {made_for['num_experts']} experts per layer, the model has "
            f"{model.num_experts}"
        )
    beyond = sorted(x for x in cold["layers"] if x >= model.num_layers)
    if beyond:
        problems.append(f"it lists layer(s) {beyond[:8]}, the model has {model.num_layers}")
    both = sorted(set(cold["layers"]) & host_layers)
    if both:
        problems.append(f"layer(s) {both[:8]} are also in VLLM_EXPERT_HOST_LAYERS")
    return problems


def over_budget(cold: dict[str, Any], plan: HostPlan, pp: int) -> str:
    """The series refuses a file whose experts exceed 1.1x the budget it states for a rank
    (made for another model, quantisation or split); say so before loading."""
    budget = cold.get("budget") or {}
    per_stage = budget.get("gib_per_stage")
    if not per_stage or budget.get("pipeline_parallel_size") != pp or not plan.bytes_per_expert:
        return ""
    for rank, (n, gib) in enumerate(zip(plan.experts_per_rank, per_stage, strict=False)):
        have = n * plan.bytes_per_expert
        if have > float(gib) * GiB * 1.10:
            return (
                f"its experts take {have / GiB:.2f} GiB on pipeline rank {rank}, but it was "
                f"made for {float(gib):.2f} GiB per stage ({plan.bytes_per_expert} bytes "
                f"per expert, from {plan.source})"
            )
    return ""
