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

# the fix for a cold file that is wrong in itself (the series' loader says the same)
REMAKE = "fix the file or make a new one with scripts/select-cold-set select"

# architectures whose MTP layers the model code adds after the last decoder layer even when
# config.json does not say how many (vLLM 0.29.0: getattr(config, "mtp_num_hidden_layers", 1))
MTP_BY_DEFAULT = ("Qwen3NextForCausalLM", "Qwen4ExpForCausalLM")


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
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config", cfg)
    experts = text.get("num_experts") or text.get("n_routed_experts")
    experts = experts or text.get("num_local_experts")
    architecture = (cfg.get("architectures") or [None])[0]
    return ModelConfig(
        path,
        architecture,
        int(text["num_hidden_layers"]),
        int(experts) if experts else None,
        mtp_layer_count(architecture, text),
    )


class ColdFileError(ValueError):
    """A cold file that vLLM would refuse; the message says what is wrong, ``fix`` what to
    do about it."""

    def __init__(self, problem: str, fix: str = REMAKE) -> None:
        super().__init__(problem)
        self.fix = fix


def human_bytes(n: float) -> str:
    """Bytes in the unit that shows them (a budget of 2 MiB is not "0.00 GiB")."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _layer_number(key: Any) -> int | None:
    """A layer key as vLLM writes it ("0", "17"); None for anything else ("²" and "٣" are
    digits to str.isdigit() but not layer numbers, "07" would alias "7")."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key:
        return int(key)
    return None


def check_budget(budget: Any) -> None:
    """The optional 'budget' object: numbers where numbers belong, one budget per stage."""
    if budget is None:
        return
    if not isinstance(budget, dict):
        raise ColdFileError(
            f"'budget' must be an object like {{\"pipeline_parallel_size\": 2, "
            f'"gib_per_stage": [3.0, 3.0]}}, not {budget!r}'
        )
    pp = budget.get("pipeline_parallel_size")
    if pp is not None and not (_is_int(pp) and pp >= 1):
        raise ColdFileError(
            f"budget: 'pipeline_parallel_size' must be a whole number >= 1, not {pp!r}"
        )
    per_stage = budget.get("gib_per_stage")
    if per_stage is not None:
        if not isinstance(per_stage, list) or not all(_is_number(g) and g >= 0 for g in per_stage):
            raise ColdFileError(
                "budget: 'gib_per_stage' must be a list of GiB per pipeline stage as numbers "
                f"(e.g. [3.0, 3.0]), not {per_stage!r}"
            )
        if pp is not None and len(per_stage) != pp:
            raise ColdFileError(
                f"budget: 'gib_per_stage' has {len(per_stage)} values for "
                f"pipeline_parallel_size {pp}; give one per stage"
            )
    size = budget.get("bytes_per_expert")
    if size is not None and not (_is_int(size) and size > 0):
        raise ColdFileError(
            f"budget: 'bytes_per_expert' must be a whole number of bytes, not {size!r}"
        )


def check_layers(raw: Any, num_experts: int) -> dict[int, list[int]]:
    """'layers': layer number -> host expert ids, each id once and inside the layer."""
    if not isinstance(raw, dict):
        raise ColdFileError("'layers' must map layer numbers to lists of expert ids")
    parsed: dict[int, list[int]] = {}
    for key, ids in raw.items():
        layer = _layer_number(key)
        if layer is None:
            raise ColdFileError(
                f"layer key {key!r} is not a layer number (write absolute layer numbers in "
                'ASCII digits: "0", "17")'
            )
        if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
            raise ColdFileError(f"layer {key}: expert ids must be a list of integers")
        seen: set[int] = set()
        dupes = sorted({i for i in ids if i in seen or seen.add(i)})
        if dupes:
            raise ColdFileError(f"layer {key} lists expert(s) {dupes[:8]} more than once")
        bad = sorted(i for i in ids if not 0 <= i < num_experts)
        if bad:
            raise ColdFileError(
                f"layer {key}: expert id(s) {bad[:8]} are outside 0-{num_experts - 1}"
            )
        if ids:
            parsed[layer] = sorted(ids)
    if not parsed:
        raise ColdFileError(
            "it lists no host expert ('layers' is empty), so it would offload nothing",
            "make one with scripts/select-cold-set select, or unset VLLM_EXPERT_COLD_FILE "
            "to serve without offload",
        )
    return parsed


def load_cold_file(path: pathlib.Path) -> dict[str, Any]:
    """Read a cold file and check it on its own, as the series does at start-up
    (fused_moe/expert_offload/cold_file.py: the same rules and messages)."""
    if path.is_dir():
        raise ColdFileError(
            "is a directory, not a cold file",
            "give the path of the cold file (a .json file) itself, not its folder",
        )
    if not path.exists():
        raise ColdFileError("no such file", "give the path of a cold file (cold/README.md)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ColdFileError(f"not readable ({e})") from e
    if not text.strip():
        raise ColdFileError("not readable as JSON (the file is empty)")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ColdFileError(f"not readable as JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != COLD_FORMAT:
        raise ColdFileError(f"not a cold file (its 'format' is not {COLD_FORMAT!r})")
    if doc.get("version") != COLD_VERSION:
        raise ColdFileError(f"format version {doc.get('version')!r}; expected {COLD_VERSION}")
    model = doc.get("model")
    if not isinstance(model, dict) or not (
        _is_int(model.get("num_experts")) and model["num_experts"] > 0
    ):
        raise ColdFileError(
            "'model' must say at least which model and how many experts per layer "
            "('num_experts') it was made for"
        )
    layers_of_model = model.get("num_layers")
    if layers_of_model is not None and not (_is_int(layers_of_model) and layers_of_model > 0):
        raise ColdFileError(f"model: 'num_layers' must be a whole number, not {layers_of_model!r}")
    check_budget(doc.get("budget"))
    doc["layers"] = check_layers(doc.get("layers"), model["num_experts"])
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


def mtp_layer_problem(layer: int, num_layers: int) -> str:
    """Why a cold file may not name an MTP layer (the series' loader says the same)."""
    return (
        f"layer {layer} is the model's MTP layer (mtp.layers.{layer}.mlp.experts), whose "
        f"experts always stay on the GPU: a cold file covers layers 0-{num_layers - 1}; "
        f"remove layer {layer} from 'layers'"
    )


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
    n = model.num_layers
    mtp = sorted(x for x in cold["layers"] if n <= x < n + model.mtp_layers)
    problems += [mtp_layer_problem(x, n) for x in mtp]
    beyond = sorted(x for x in cold["layers"] if x >= n and x not in mtp)
    if beyond:
        problems.append(f"it lists layer(s) {beyond[:8]}, the model has {n} (0-{n - 1})")
    both = sorted(set(cold["layers"]) & host_layers)
    if both:
        problems.append(f"layer(s) {both[:8]} are also in VLLM_EXPERT_HOST_LAYERS")
    return problems


def name_mismatch(cold: dict[str, Any], model: ModelConfig) -> str:
    """The model name the file was made for, where it is not the checkpoint's folder name
    (empty: same name, or none recorded). vLLM uses such a file when its shape fits, and
    warns: paths differ between machines, but so do checkpoints of one architecture."""
    name = cold["model"].get("name")
    if not isinstance(name, str) or not name.strip():
        return ""
    made_for = pathlib.PurePath(name.rstrip("/")).name
    if made_for == model.path.resolve().name:
        return ""
    return f"it was made for model {name!r}, but the model is {model.path.resolve().name!r}"


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
                f"its experts take {human_bytes(have)} on pipeline rank {rank}, but it was "
                f"made for {human_bytes(float(gib) * GiB)} per stage "
                f"({plan.bytes_per_expert} bytes per expert, from {plan.source})"
            )
    return ""
