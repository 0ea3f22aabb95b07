# SPDX-License-Identifier: Apache-2.0
"""The rules for what expert offload reads at start-up, in one module with no imports beyond
the standard library, so that vLLM's loader and the container's start-up checks apply the
same ones with the same messages. The series carries a byte-identical copy as
``vllm/model_executor/layers/fused_moe/expert_offload/cold_contract.py``; the project's
tools load that copy from the installed vLLM when it is there.

- JSON files (cold files, usage counts): reading is strict where ``json.loads`` is lenient,
  because these files come from other machines, other tools and half-finished writes: only
  regular files, at most ``max_bytes``, nesting at most ``MAX_DEPTH`` deep, no duplicate keys
  (the second would silently win), no NaN or Infinity, no integers of more than
  ``MAX_INT_DIGITS`` digits, no float that overflows to infinity.
- Cold files (VLLM_EXPERT_COLD_FILE, format below and in cold/README.md): the format, the
  checks of the file on its own, and the checks against the model it is loaded for.
- Layer lists (VLLM_EXPERT_HOST_LAYERS): one syntax, ``parse_layer_list``.

Every refusal is a ContractError whose ``problem`` says what is wrong and ``fix`` what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 32
MAX_INT_DIGITS = 20


class ContractError(ValueError):
    """A file or setting that breaks the contract: ``problem`` says what is wrong, ``fix``
    (may be empty) what to do; the message is both."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


def _check_depth(text: str, limit: int) -> None:
    """Refuse nesting deeper than ``limit`` before the parser recurses into it."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                raise ContractError(f"nested more than {limit} levels deep")
        elif ch in "]}":
            depth -= 1


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ContractError(f"key {key[:40]!r} appears twice in one object")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise ContractError(f"{name} is not a number this file may hold")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ContractError(f"an integer of {len(text)} digits ({text[:12]}...)")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ContractError(f"the number {text[:24]} overflows to infinity")
    return value


def parse_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` as JSON under the rules above; ContractError names what broke them."""
    _check_depth(text, max_depth)
    try:
        return json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_int=_int,
            parse_float=_float,
        )
    except json.JSONDecodeError as e:
        raise ContractError(f"not valid JSON ({e})") from None


def read_text(path: str | os.PathLike[str], max_bytes: int) -> str:
    """A regular file's UTF-8 text, refused if it is larger than ``max_bytes``. A FIFO,
    a device or a directory is refused without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise ContractError("a directory, not a file") from None
    except FileNotFoundError:
        raise ContractError("no such file") from None
    except OSError as e:
        raise ContractError(f"cannot be opened ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise ContractError("a directory, not a file")
            raise ContractError("not a regular file (a FIFO, device or socket)")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ContractError(f"larger than the {max_bytes:,} bytes such a file may take")
    except OSError as e:
        raise ContractError(f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ContractError(f"not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike[str], max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """A regular file of at most ``max_bytes`` read as strict JSON (module docstring)."""
    return parse_json(read_text(path, max_bytes), max_depth)


# --- cold files ----------------------------------------------------------------------------
#
#     {
#       "format": "vllm-expert-offload/cold-set",
#       "version": 1,
#       "model": {"name": "...", "revision": "...", "architecture": "Qwen3MoeForCausalLM",
#                 "num_layers": 48, "num_experts": 512},
#       "budget": {"pipeline_parallel_size": 2, "gib_per_stage": [3.0, 3.0],
#                  "bytes_per_expert": 2534400},
#       "provenance": {"tool": "...", "data": [...], ...},
#       "layers": {"0": [3, 17, ...], "1": [...], ...}
#     }
#
# ``layers`` uses absolute layer numbers; a layer that is absent keeps all experts on the GPU.
# ``model`` says what the file was computed on and is checked against the model being
# loaded; ``budget`` (optional) says how many bytes per pipeline stage the file was made for.
# ``provenance`` is free-form.

FORMAT = "vllm-expert-offload/cold-set"
VERSION = 1
COLD_FILE_VARIABLE = "VLLM_EXPERT_COLD_FILE"
HOST_LAYERS_VARIABLE = "VLLM_EXPERT_HOST_LAYERS"
# Larger than any real cold file (94 layers x 512 ids, indented, is under 1 MB).
MAX_COLD_FILE_BYTES = 16 << 20
# Layer numbers are below this: no model has as many layers, and a layer list may not build
# a larger set ("0-99999999999" would take all memory).
MAX_LAYERS = 100_000

REMAKE = "fix the file or make a new one with scripts/select-cold-set select"
GIVE_A_COLD_FILE = (
    "give the path of a cold file made by scripts/select-cold-set (cold/README.md), or unset "
    f"{COLD_FILE_VARIABLE}"
)
FOR_THIS_MODEL = (
    f"use a cold file made for this model (scripts/select-cold-set) or unset {COLD_FILE_VARIABLE}"
)


@dataclass(frozen=True)
class ColdSet:
    """A cold file that passed ``check_cold_doc``."""

    model: dict[str, Any]
    budget: dict[str, Any] | None
    layers: dict[int, tuple[int, ...]]  # layer -> sorted host expert ids, none empty
    doc: dict[str, Any]  # the whole file as read


@dataclass(frozen=True)
class ModelShape:
    """What a cold file is checked against: the model being loaded."""

    name: str  # how messages call it ("the model", a path)
    num_layers: int | None  # decoder layers; None: unknown
    num_experts: int | None = None  # routed experts per MoE layer; None: unknown
    architecture: str | None = None
    mtp_layers: int = 0  # MoE layers of the MTP drafter, numbered from num_layers


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def _shown(x: Any, limit: int = 60) -> str:
    """``repr(x)``, cut short: a message quotes what it refuses, not all of it."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_ranges(layers: Iterable[int]) -> str:
    """Layer numbers as the layer-list syntax writes them: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    ordered = sorted(set(layers))
    start = None
    for i, x in enumerate(ordered):
        if start is None:
            start = x
        if i + 1 == len(ordered) or ordered[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _layer_number(key: Any) -> int | None:
    """A layer key as the tools write it ("0", "17"); None for anything else ("²" and "٣"
    are digits to str.isdigit() but not layer numbers, "07" would alias "7")."""
    if (
        isinstance(key, str)
        and 0 < len(key) <= len(str(MAX_LAYERS))
        and key.isascii()
        and key.isdigit()
        and str(int(key)) == key
        and int(key) < MAX_LAYERS
    ):
        return int(key)
    return None


def read_cold_file(path: str | os.PathLike[str]) -> ColdSet:
    """Read a cold file and check it on its own (``check_cold_doc``)."""
    if os.path.isdir(path):
        raise ContractError(
            "is a directory, not a cold file",
            "give the path of the cold file (a .json file) itself, not its folder",
        )
    if not os.path.exists(path):
        raise ContractError("no such file", GIVE_A_COLD_FILE)
    try:
        text = read_text(path, MAX_COLD_FILE_BYTES)
    except ContractError as e:
        raise ContractError(e.problem, GIVE_A_COLD_FILE) from None
    if not text.strip():
        raise ContractError("not readable as JSON (the file is empty)", REMAKE)
    try:
        doc = parse_json(text)
    except ContractError as e:
        # "not valid JSON (Expecting ...)" reads as "not readable as JSON (Expecting ...)"
        problem = e.problem.removeprefix("not valid JSON ")
        sep = " " if problem != e.problem else ": "
        raise ContractError(f"not readable as JSON{sep}{problem}", REMAKE) from None
    return check_cold_doc(doc)


def check_cold_doc(doc: Any) -> ColdSet:
    """A cold file's content on its own: format, version, the model it was made for, its
    budget, and per layer host expert ids that exist, each once."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ContractError(f"not a cold file (its 'format' is not {FORMAT!r})", REMAKE)
    if doc.get("version") != VERSION:
        raise ContractError(
            f"format version {_shown(doc.get('version'))}; this reader takes version {VERSION}",
            REMAKE,
        )
    model = _check_model(doc.get("model"))
    budget = _check_budget(doc.get("budget"))
    layers = _check_layers(doc.get("layers"), model["num_experts"])
    return ColdSet(model, budget, layers, doc)


def _check_model(model: Any) -> dict[str, Any]:
    if not isinstance(model, dict) or not (
        _is_int(model.get("num_experts")) and model["num_experts"] > 0
    ):
        raise ContractError(
            "'model' must say at least which model and how many experts per layer "
            "('num_experts', a whole number) it was made for",
            REMAKE,
        )
    num_layers = model.get("num_layers")
    if num_layers is not None and not (_is_int(num_layers) and 0 < num_layers <= MAX_LAYERS):
        raise ContractError(
            f"model: 'num_layers' must be a whole number from 1 to {MAX_LAYERS}, "
            f"not {_shown(num_layers)}",
            REMAKE,
        )
    arch = model.get("architecture")
    if arch is not None and not (isinstance(arch, str) and arch.strip()):
        raise ContractError(
            "model: 'architecture' must be the model's architecture as a string (such as "
            f'"Qwen3MoeForCausalLM") or null, not {_shown(arch)}',
            REMAKE,
        )
    for key in ("name", "revision"):
        if model.get(key) is not None and not isinstance(model[key], str):
            raise ContractError(
                f"model: {key!r} must be a string or null, not {_shown(model[key])}", REMAKE
            )
    return model


def _check_budget(budget: Any) -> dict[str, Any] | None:
    """The optional 'budget': numbers where numbers belong, one budget per stage (a string
    such as "3GiB" would fail later, inside the budget check)."""
    if budget is None:
        return None
    if not isinstance(budget, dict):
        raise ContractError(
            "'budget' must be an object like {\"pipeline_parallel_size\": 2, "
            f'"gib_per_stage": [3.0, 3.0]}}, not {_shown(budget)}',
            REMAKE,
        )
    pp = budget.get("pipeline_parallel_size")
    if pp is not None and not (_is_int(pp) and pp >= 1):
        raise ContractError(
            f"budget: 'pipeline_parallel_size' must be a whole number >= 1, not {_shown(pp)}",
            REMAKE,
        )
    per_stage = budget.get("gib_per_stage")
    if per_stage is not None:
        if not isinstance(per_stage, list) or not all(_is_number(g) and g >= 0 for g in per_stage):
            raise ContractError(
                "budget: 'gib_per_stage' must be a list of GiB per pipeline stage as numbers "
                f"(e.g. [3.0, 3.0]), not {_shown(per_stage)}",
                REMAKE,
            )
        if pp is not None and len(per_stage) != pp:
            raise ContractError(
                f"budget: 'gib_per_stage' has {len(per_stage)} values for "
                f"pipeline_parallel_size {pp}; give one per stage",
                REMAKE,
            )
    size = budget.get("bytes_per_expert")
    if size is not None and not (_is_int(size) and size > 0):
        raise ContractError(
            f"budget: 'bytes_per_expert' must be a whole number of bytes, not {_shown(size)}",
            REMAKE,
        )
    return budget


def _check_layers(raw: Any, num_experts: int) -> dict[int, tuple[int, ...]]:
    """'layers': layer number -> host expert ids, each id once and inside the layer."""
    if not isinstance(raw, dict):
        raise ContractError("'layers' must map layer numbers to lists of expert ids", REMAKE)
    layers: dict[int, tuple[int, ...]] = {}
    for key, ids in raw.items():
        layer = _layer_number(key)
        if layer is None:
            raise ContractError(
                f"layer key {_shown(key)} is not a layer number (write absolute layer numbers "
                f'below {MAX_LAYERS} in ASCII digits: "0", "17")',
                REMAKE,
            )
        if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
            raise ContractError(f"layer {key}: expert ids must be a list of integers", REMAKE)
        seen: set[int] = set()
        dupes = sorted({i for i in ids if i in seen or seen.add(i)})
        if dupes:
            raise ContractError(f"layer {key} lists expert(s) {dupes[:8]} more than once", REMAKE)
        bad = sorted(i for i in ids if not 0 <= i < num_experts)
        if bad:
            raise ContractError(
                f"layer {key}: expert id(s) {bad[:8]} are outside 0-{num_experts - 1}", REMAKE
            )
        if ids:
            layers[layer] = tuple(sorted(ids))
    if not layers:
        raise ContractError(
            "it lists no host expert ('layers' is empty), so it would offload nothing",
            f"make one with scripts/select-cold-set select, or unset {COLD_FILE_VARIABLE} to "
            "serve without offload",
        )
    return layers


def model_mismatches(
    cold: ColdSet, model: ModelShape, host_layers: Iterable[int] = ()
) -> list[ContractError]:
    """Every way the cold file does not fit the model (empty: it fits)."""
    made_for, name, n = cold.model, model.name, model.num_layers
    out: list[ContractError] = []
    arch = made_for.get("architecture")
    if arch and model.architecture and arch != model.architecture:
        out.append(
            ContractError(
                f"it was made for a {arch} model, but {name} is a {model.architecture}",
                FOR_THIS_MODEL,
            )
        )
    if n is not None and made_for.get("num_layers") not in (None, n):
        out.append(
            ContractError(
                f"it was made for {made_for['num_layers']} layers, but {name} has {n}",
                FOR_THIS_MODEL,
            )
        )
    if model.num_experts is not None and made_for["num_experts"] != model.num_experts:
        out.append(
            ContractError(
                f"it was made for {made_for['num_experts']} experts per layer, but {name} "
                f"has {model.num_experts}",
                FOR_THIS_MODEL,
            )
        )
    if n is not None:
        mtp = sorted(x for x in cold.layers if n <= x < n + model.mtp_layers)
        if mtp:
            out.append(
                ContractError(
                    f"layer {mtp[0]} is the model's MTP layer (mtp.layers.{mtp[0]}.mlp.experts),"
                    f" whose experts always stay on the GPU: a cold file covers layers 0-{n - 1}",
                    f"remove layer(s) {format_ranges(mtp)} from 'layers'",
                )
            )
        beyond = sorted(x for x in cold.layers if x >= n and x not in mtp)
        if beyond:
            out.append(
                ContractError(
                    f"it lists layer(s) {format_ranges(beyond)}, but {name} has {n} layers "
                    f"(0-{n - 1})",
                    FOR_THIS_MODEL,
                )
            )
    both = sorted(set(cold.layers) & set(host_layers))
    if both:
        out.append(
            ContractError(
                f"layer(s) {format_ranges(both)} are also in {HOST_LAYERS_VARIABLE}",
                "list each layer in one of the two only",
            )
        )
    return out


def check_fits_model(cold: ColdSet, model: ModelShape, host_layers: Iterable[int] = ()) -> None:
    """Refuse a cold file that does not fit the model, naming every mismatch at once."""
    problems = model_mismatches(cold, model, host_layers)
    if problems:
        fixes = list(dict.fromkeys(p.fix for p in problems))
        raise ContractError("; ".join(p.problem for p in problems), "; ".join(fixes))


def host_layers_beyond(host_layers: Iterable[int], model: ModelShape) -> ContractError | None:
    """The layers of VLLM_EXPERT_HOST_LAYERS that the model does not have, as a refusal
    (None: all exist, or the model's layer count is unknown)."""
    n = model.num_layers
    missing = sorted(x for x in host_layers if n is not None and x >= n)
    if not missing:
        return None
    return ContractError(
        f"{HOST_LAYERS_VARIABLE} names layer(s) {format_ranges(missing)}, but {model.name} has "
        f"{n} layers (0-{n - 1})",
        f"remove them from {HOST_LAYERS_VARIABLE}",
    )


def other_model_name(cold: ColdSet, model: str) -> str:
    """The model name the file was made for, where its last path part is not the model's
    (empty: the same, or none recorded). Such a file is used when its shape fits, with a
    warning: paths differ between machines, but so do checkpoints of one architecture."""
    name = cold.model.get("name")
    if not isinstance(name, str) or not name.strip():
        return ""
    if os.path.basename(name.rstrip("/")) == os.path.basename(model.rstrip("/")):
        return ""
    return f"it was made for model {name!r}, but the model is {model!r}"


GiB = 1 << 30
# A file whose experts take more than this times the budget it states for a rank was made
# for another model, quantisation or split.
BUDGET_SLACK = 1.10


def human_bytes(n: float) -> str:
    """Bytes in the unit that shows them (a budget of 2 MiB is not "0.00 GiB")."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def over_budget(
    cold: ColdSet, pp_size: int, rank: int, host_experts: int, bytes_per_expert: int, source: str
) -> ContractError | None:
    """The refusal of a file whose ``host_experts`` on pipeline ``rank`` take more than
    ``BUDGET_SLACK`` times the budget it states for a stage; None where they fit, or where
    the file was made for another pipeline size (its stage budgets do not map onto ranks)."""
    budget = cold.budget or {}
    per_stage = budget.get("gib_per_stage")
    if not per_stage or budget.get("pipeline_parallel_size") != pp_size:
        return None
    have = host_experts * bytes_per_expert
    allowed = float(per_stage[rank]) * GiB
    if have <= allowed * BUDGET_SLACK:
        return None
    return ContractError(
        f"its experts take {human_bytes(have)} on pipeline rank {rank}, but it was made for "
        f"a budget of {human_bytes(allowed)} per stage ({bytes_per_expert} bytes per expert, "
        f"from {source})",
        "it was made for another model, quantisation or pipeline split; make one for this "
        "setup with scripts/select-cold-set",
    )


def other_pipeline_size(cold: ColdSet, pp_size: int) -> str | None:
    """The warning for a file whose budget was made for another pipeline size: it is served
    as its layers say, but its per-stage budgets cannot be checked (stages differ); None
    where the sizes agree or the file states no per-stage budget."""
    budget = cold.budget or {}
    made = budget.get("pipeline_parallel_size")
    if not budget.get("gib_per_stage") or made is None or made == pp_size:
        return None
    return (
        f"it was made for pipeline parallel size {made} and is served with {pp_size}: its "
        "experts are placed as it lists them, but its budget per stage is not checked; make "
        "one for this split with scripts/select-cold-set to have it checked"
    )


# --- layer lists ---------------------------------------------------------------------------

# "0-5,40": layer numbers and ranges in ASCII digits, separated by commas; spaces and tabs
# around numbers, dashes and commas are allowed ("0 - 5, 40"), empty items are skipped.
_LAYER_ITEM = re.compile(r"[ \t]*([0-9]+)(?:[ \t]*-[ \t]*([0-9]+))?[ \t]*")
LAYER_LIST_SYNTAX = "layer numbers and ranges in ASCII digits separated by commas, such as 0-5,40"


def parse_layer_list(
    spec: str, variable: str = "VLLM_EXPERT_HOST_LAYERS", max_layer: int | None = None
) -> frozenset[int]:
    """The layers a layer list such as ``"0-5,40"`` names (syntax above). A range that runs
    backwards, a character that is not an ASCII digit, or a layer above ``max_layer`` (the
    highest layer number allowed; default ``MAX_LAYERS - 1``) is refused before any set is
    built, with a ContractError naming ``variable``, the problem and the fix."""
    highest = MAX_LAYERS - 1 if max_layer is None else max_layer
    where = f"{variable}={_shown(spec)}"
    if not isinstance(spec, str):
        raise ContractError(f"{where}: not a string", f"write {LAYER_LIST_SYNTAX}")
    layers: set[int] = set()
    for part in spec.split(","):
        if not part.strip(" \t"):
            continue
        odd = next((ch for ch in part if not ch.isascii()), None)
        if odd is not None:
            raise ContractError(
                f"{where}: {odd!r} is not an ASCII digit", f"write {LAYER_LIST_SYNTAX}"
            )
        m = _LAYER_ITEM.fullmatch(part)
        if m is None:
            raise ContractError(
                f"{where}: cannot read {_shown(part.strip())}", f"write {LAYER_LIST_SYNTAX}"
            )
        numbers = [g.lstrip("0") or "0" for g in m.groups() if g is not None]
        for digits in numbers:
            # compare lengths first: int() of thousands of digits is slow, then refused
            if len(digits) > len(str(max(highest, 0))) or int(digits) > highest:
                beyond = (
                    "the model's last layer"
                    if max_layer is not None
                    else "the highest layer number expert offload takes"
                )
                raise ContractError(
                    f"{where}: layer {digits[:20]}{'...' * (len(digits) > 20)} is above {highest}, "
                    f"{beyond}",
                    f"name layers 0-{highest} only"
                    if highest >= 0
                    else f"unset {variable}: the model has no layers",
                )
        first, last = int(numbers[0]), int(numbers[-1])
        if last < first:
            raise ContractError(
                f"{where}: the range {_shown(part.strip())} runs backwards",
                f"write {last}-{first}",
            )
        layers.update(range(first, last + 1))
    return frozenset(layers)
