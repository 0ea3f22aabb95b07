# SPDX-License-Identifier: Apache-2.0
"""A cold file against the model it is meant for, without vLLM: the host experts per pipeline
rank and their bytes, from the model's config.json and checkpoint. The cold-file format, its
rules and the layer-list syntax live in cold_contract.py, which the series carries as
vLLM's own copy: the tools use that copy where the installed vLLM has it (so the preflight
refuses exactly what vLLM would), else the one next to this module."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import cold_contract as own_contract
from .selection import SelectionError, expert_bytes, stage_layers

# where the series puts its copy of the contract, inside the vllm package
SERIES_CONTRACT = "model_executor/layers/fused_moe/expert_offload/cold_contract.py"
# what the tools call; a copy without them (an older series) is not used
CONTRACT_API = (
    "ContractError",
    "ColdSet",
    "ModelShape",
    "read_cold_file",
    "check_fits_model",
    "other_model_name",
    "parse_layer_list",
    "host_layers_beyond",
    "over_budget",
    "other_pipeline_size",
    "human_bytes",
    "read_json",
)


def installed_contract_path() -> pathlib.Path | None:
    """The installed vLLM's copy of cold_contract.py, found without importing vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(base, SERIES_CONTRACT)
        if path.is_file():
            return path
    return None


def load_contract() -> tuple[ModuleType, str]:
    """The contract the installed series applies, else ours; and where it came from."""
    path = installed_contract_path()
    if path is not None:
        spec = importlib.util.spec_from_file_location("eotools._series_cold_contract", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            # registered while it runs: dataclasses look their module up by name
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except Exception:  # a broken copy: the vllm check reports the series
                del sys.modules[spec.name]
                module = None
            if module is not None and all(hasattr(module, name) for name in CONTRACT_API):
                return module, str(path)
    return own_contract, own_contract.__file__


contract, CONTRACT_SOURCE = load_contract()
ContractError = contract.ContractError
# the fix for a cold file that is wrong in itself (the series' loader says the same)
REMAKE = contract.REMAKE
# how the tools' messages call the model (vLLM's: its path)
THE_MODEL = "the model"

# architectures whose MTP layers the model code adds after the last decoder layer even when
# config.json does not say how many (vLLM 0.29.0: getattr(config, "mtp_num_hidden_layers", 1))
MTP_BY_DEFAULT = ("Qwen3NextForCausalLM", "Qwen4ExpForCausalLM")
# config.json of a checkpoint: a few KB; larger is not a config
MAX_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True)
class ModelConfig:
    path: pathlib.Path
    architecture: str | None
    num_layers: int
    num_experts: int | None
    mtp_layers: int = 0  # MoE layers of the MTP drafter, numbered from num_layers


def mtp_layer_count(architecture: str | None, text: dict[str, Any]) -> int:
    """How many MTP layers follow the decoder layers (their MoE layer is
    ``mtp.layers.{num_layers + i}.mlp.experts``): never offloaded, never in a cold file."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if isinstance(text.get(key), int):
            return text[key]
    return 1 if architecture in MTP_BY_DEFAULT else 0


def read_model_config(model: str | None) -> ModelConfig | None:
    """The shape of a local checkpoint from its config.json; None if `model` is not a local
    directory with one (a hub id: vLLM checks the cold file itself after downloading)."""
    if not model:
        return None
    path = pathlib.Path(model)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    fix = f"check the model folder {path}: its config.json is not one vLLM can load"
    try:
        cfg = contract.read_json(cfg_file, MAX_CONFIG_BYTES)
    except contract.ContractError as e:
        raise ColdFileError(f"{cfg_file}: {e.problem}", fix) from None
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
    layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if not (isinstance(layers, int) and not isinstance(layers, bool) and layers > 0):
        raise ColdFileError(f"{cfg_file}: no whole number 'num_hidden_layers'", fix)
    experts = text.get("num_experts") or text.get("n_routed_experts")
    experts = experts or text.get("num_local_experts")
    if not (isinstance(experts, int) and not isinstance(experts, bool) and experts > 0):
        experts = None
    names = cfg.get("architectures")
    architecture = names[0] if isinstance(names, list) and names else None
    if not isinstance(architecture, str):
        architecture = None
    return ModelConfig(path, architecture, layers, experts, mtp_layer_count(architecture, text))


class ColdFileError(ValueError):
    """A cold file that vLLM would refuse; the message says what is wrong, ``fix`` what to
    do about it."""

    def __init__(self, problem: str, fix: str = REMAKE) -> None:
        super().__init__(problem)
        self.fix = fix


human_bytes = contract.human_bytes


def load_cold_file(path: pathlib.Path) -> dict[str, Any]:
    """Read a cold file and check it on its own, under the contract vLLM applies at start-up;
    its 'layers' as layer number -> sorted host expert ids."""
    try:
        cold = contract.read_cold_file(path)
    except contract.ContractError as e:
        raise ColdFileError(e.problem, e.fix or REMAKE) from None
    layers = {layer: list(ids) for layer, ids in cold.layers.items()}
    return {**cold.doc, "model": cold.model, "budget": cold.budget, "layers": layers}


def parse_layer_list(text: str) -> frozenset[int]:
    """VLLM_EXPERT_HOST_LAYERS under the contract's syntax ("0-5,40"); ContractError, a
    ValueError, names the problem and the fix."""
    return contract.parse_layer_list(text)


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
    host = contract.parse_layer_list(host_layers)
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


def _cold_set(cold: dict[str, Any]) -> Any:
    """A dict of load_cold_file as the contract's ColdSet."""
    layers = {layer: tuple(ids) for layer, ids in cold["layers"].items()}
    return contract.ColdSet(cold["model"], cold.get("budget"), layers, cold)


def _shape(model: ModelConfig) -> Any:
    return contract.ModelShape(
        THE_MODEL, model.num_layers, model.num_experts, model.architecture, model.mtp_layers
    )


def check_fits_model(cold: dict[str, Any], model: ModelConfig, host_layers: frozenset[int]) -> None:
    """Refuse, as vLLM would, a cold file that does not fit the model: every mismatch in one
    ColdFileError."""
    try:
        contract.check_fits_model(_cold_set(cold), _shape(model), host_layers)
    except contract.ContractError as e:
        raise ColdFileError(e.problem, e.fix) from None


def check_host_layers(host_layers: frozenset[int], model: ModelConfig) -> None:
    """Refuse VLLM_EXPERT_HOST_LAYERS naming layers the model does not have."""
    problem = contract.host_layers_beyond(host_layers, _shape(model))
    if problem is not None:
        raise ColdFileError(problem.problem, problem.fix)


def pipeline_size_mismatch(cold: dict[str, Any], pp: int) -> str | None:
    """vLLM's warning for a file made for another pipeline size (served as listed, its
    per-stage budget unchecked); None where the sizes agree."""
    return contract.other_pipeline_size(_cold_set(cold), pp)


def name_mismatch(cold: dict[str, Any], model: ModelConfig) -> str:
    """The model name the file was made for, where it is not the checkpoint's folder name
    (empty: same name, or none recorded). vLLM uses such a file when its shape fits, and
    warns: paths differ between machines, but so do checkpoints of one architecture."""
    return contract.other_model_name(_cold_set(cold), model.path.resolve().name)


def over_budget(cold: dict[str, Any], plan: HostPlan, pp: int) -> ColdFileError | None:
    """The refusal vLLM gives a file whose experts on a rank exceed the budget it states
    (made for another model, quantisation or split); None where they fit."""
    if not plan.bytes_per_expert:
        return None
    for rank, n in enumerate(plan.experts_per_rank):
        over = contract.over_budget(
            _cold_set(cold), pp, rank, n, plan.bytes_per_expert, plan.source
        )
        if over is not None:
            return ColdFileError(over.problem, over.fix)
    return None
