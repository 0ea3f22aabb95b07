# SPDX-License-Identifier: Apache-2.0
"""One cold-file contract, two entry points: every case of one table goes through the
project's preflight (its cold-file check, which runs the tools' coldcheck) and through
vLLM's loader (the series' planner, config.parse_layer_list and cold_file.py), and both
must accept it, or both refuse it with the same problem text, in one line, never a
traceback. The series carries the contract as a file byte-identical to
scripts/eotools/cold_contract.py.

    scripts/test tests/cpu/test_cold_contract.py
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from eotools import cold_contract, coldcheck
from eotools import preflight as pf
from test_preflight import EXPERT, make_model, setup_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERIES_PATH = "vllm/model_executor/layers/fused_moe/expert_offload/cold_contract.py"
ARCH, LAYERS, E = "Qwen3MoeForCausalLM", 4, 16
MODEL = {"name": "model", "architecture": ARCH, "num_layers": LAYERS, "num_experts": E}


def cold_doc(layers=None, model=None, budget=None, **top) -> str:
    doc = {
        "format": cold_contract.FORMAT,
        "version": cold_contract.VERSION,
        "model": MODEL if model is None else model,
        "budget": budget,
        "provenance": {"tool": "test"},
        "layers": {"0": [1, 2]} if layers is None else layers,
        **top,
    }
    return json.dumps(doc)


def head(rest: str) -> str:
    """A cold file whose 'layers' (and what follows) is written by hand."""
    return (
        f'{{"format": "{cold_contract.FORMAT}", "version": 1, "model": {json.dumps(MODEL)}, '
        + rest
        + "}"
    )


# How a case's cold file is made in a folder: its text, or a function of the folder.
Maker = str | bytes | Callable[[pathlib.Path], pathlib.Path] | None


def fifo(tmp: pathlib.Path) -> pathlib.Path:
    os.mkfifo(tmp / "cold.json")
    return tmp / "cold.json"


def sparse_gigabyte(tmp: pathlib.Path) -> pathlib.Path:
    path = tmp / "cold.json"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: takes no disk
    return path


def folder(tmp: pathlib.Path) -> pathlib.Path:
    (tmp / "cold").mkdir()
    return tmp / "cold"


@dataclass(frozen=True)
class Case:
    cold: Maker = None  # None: no cold file
    problem: str | None = None  # None: accepted; else words of the one-line refusal
    fix: str = ""  # words of the fix, where the case checks them
    host_layers: str = ""  # VLLM_EXPERT_HOST_LAYERS


def layer_list(spec: str, problem: str | None = None, fix: str = "") -> Case:
    """A case of VLLM_EXPERT_HOST_LAYERS alone, without a cold file."""
    return Case(None, problem, fix, spec)


DEEP = 5000
CASES: dict[str, Case] = {
    # accepted
    "a good cold file": Case(cold_doc()),
    "a good file with whole host layers beside it": Case(
        cold_doc({"0": [1]}), host_layers="1-2, 3"
    ),
    "spaces in a range (one syntax for both)": layer_list("0 - 3"),
    "an empty layer list": layer_list(""),
    "a trailing comma": layer_list("1,2,"),
    # the file as a file
    "an empty file": Case("", "not readable as JSON (the file is empty)"),
    "only white space": Case(" \n\t", "the file is empty"),
    "bad UTF-8": Case(b'{"format": "\xff\xfe"}', "not UTF-8 text (byte 12)"),
    "a FIFO": Case(fifo, problem="not a regular file (a FIFO, device or socket)"),
    "/dev/zero": Case(lambda tmp: pathlib.Path("/dev/zero"), problem="not a regular file"),
    "a directory": Case(folder, problem="is a directory, not a cold file", fix="not its folder"),
    "a 1 GB file": Case(sparse_gigabyte, problem="larger than the 16,777,216 bytes"),
    "no such file": Case(lambda tmp: tmp / "missing.json", problem="no such file"),
    # the file as JSON
    "not JSON": Case("{not json", "not readable as JSON (Expecting property name"),
    "JSON nested thousands deep": Case(
        '{"a": ' * DEEP + "1" + "}" * DEEP, "not readable as JSON: nested more than 32 levels"
    ),
    "an integer of thousands of digits": Case(
        head('"layers": {"0": [' + "7" * 5000 + "]}"), "an integer of 5000 digits"
    ),
    "an Infinity budget": Case(
        head(
            '"budget": {"pipeline_parallel_size": 1, "gib_per_stage": [Infinity]}, '
            '"layers": {"0": [1]}'
        ),
        "Infinity is not a number this file may hold",
    ),
    "a NaN budget": Case(
        head('"budget": {"pipeline_parallel_size": 1, "gib_per_stage": [NaN]}, "layers": {}'),
        "NaN is not a number this file may hold",
    ),
    "a budget that overflows to infinity": Case(
        head('"budget": {"gib_per_stage": [1e999]}, "layers": {}'), "overflows to infinity"
    ),
    "a duplicate layer key": Case(
        head('"layers": {"0": [1], "0": [2]}'), "key '0' appears twice in one object"
    ),
    # the file as a cold file
    "a JSON list": Case("[]", "not a cold file (its 'format' is not"),
    "another format": Case(cold_doc(format="x"), "not a cold file"),
    "another version": Case(cold_doc(version=2), "format version 2; this reader takes version 1"),
    '"architecture": []': Case(
        cold_doc(model={**MODEL, "architecture": []}),
        "model: 'architecture' must be the model's architecture as a string",
    ),
    "a model name that is not a string": Case(
        cold_doc(model={**MODEL, "name": {"a": 1}}), "model: 'name' must be a string or null"
    ),
    "num_layers true": Case(
        cold_doc(model={**MODEL, "num_layers": True}), "model: 'num_layers' must be a whole"
    ),
    "no expert count": Case(cold_doc(model={"name": "m"}), "'model' must say at least"),
    "a budget as a string": Case(cold_doc(budget="3GiB"), "'budget' must be an object"),
    "a budget per stage missing": Case(
        cold_doc(budget={"pipeline_parallel_size": 2, "gib_per_stage": [3]}),
        "'gib_per_stage' has 1 values for pipeline_parallel_size 2",
    ),
    "a superscript layer key": Case(
        cold_doc({"\u00b2": [1]}), "layer key '²' is not a layer number"
    ),
    "an Arabic-Indic layer key": Case(
        cold_doc({"\u0663": [1]}), "layer key '٣' is not a layer number"
    ),
    "a zero-padded layer key": Case(cold_doc({"07": [1]}), "layer key '07' is not a layer"),
    "a layer key of eleven digits": Case(
        cold_doc({"99999999999": [1]}), "layer key '99999999999' is not a layer number"
    ),
    "expert ids out of range": Case(
        cold_doc({"0": [1, E], "1": [-1]}), f"layer 0: expert id(s) [{E}] are outside 0-{E - 1}"
    ),
    "duplicate expert ids": Case(
        cold_doc({"1": [3, 5, 3]}), "layer 1 lists expert(s) [3] more than once"
    ),
    "expert ids as strings": Case(
        cold_doc({"1": ["3"]}), "layer 1: expert ids must be a list of integers"
    ),
    "no host expert": Case(cold_doc({"0": []}), "it lists no host expert"),
    # the file against the model
    "layers the model does not have": Case(
        cold_doc({"0": [1], "5": [1], "6": [2]}),
        f"it lists layer(s) 5-6, but {{model}} has {LAYERS} layers (0-{LAYERS - 1})",
        "use a cold file made for this model",
    ),
    "another architecture": Case(
        cold_doc(model={**MODEL, "architecture": "DeepseekV3ForCausalLM"}),
        f"it was made for a DeepseekV3ForCausalLM model, but {{model}} is a {ARCH}",
    ),
    "another layer count": Case(
        cold_doc(model={**MODEL, "num_layers": 48}),
        f"it was made for 48 layers, but {{model}} has {LAYERS}",
    ),
    "another expert count": Case(
        cold_doc(model={**MODEL, "num_experts": 32}),
        f"it was made for 32 experts per layer, but {{model}} has {E}",
    ),
    "experts over the budget it was made for": Case(
        cold_doc({"0": [1, 2, 3]}, budget={"pipeline_parallel_size": 1, "gib_per_stage": [0.004]}),
        "its experts take 6.00 MiB on pipeline rank 0, but it was made for a budget of 4.10 MiB",
        "it was made for another model, quantisation or pipeline split",
    ),
    "experts within 1.1x of the budget": Case(
        cold_doc({"0": [1, 2, 3]}, budget={"pipeline_parallel_size": 1, "gib_per_stage": [0.0055]})
    ),
    "a budget made for another pipeline size": Case(
        cold_doc(
            {"0": [1, 2, 3]}, budget={"pipeline_parallel_size": 2, "gib_per_stage": [0.001, 1]}
        )
    ),
    "a layer also in the layer list": Case(
        cold_doc({"2": [1]}),
        "layer(s) 2 are also in VLLM_EXPERT_HOST_LAYERS",
        "list each layer in one of the two only",
        "2",
    ),
    # the layer list
    "a backwards range": layer_list(
        "5-3", "VLLM_EXPERT_HOST_LAYERS='5-3': the range '5-3' runs backwards", "write 3-5"
    ),
    "a superscript digit": layer_list(
        "\u00b2", "VLLM_EXPERT_HOST_LAYERS='²': '²' is not an ASCII digit", "0-5,40"
    ),
    "an Arabic-Indic digit": layer_list("1,\u0663", "'٣' is not an ASCII digit"),
    "a range of a hundred billion layers": layer_list(
        "0-99999999999",
        "layer 99999999999 is above 99999, the highest layer number expert offload takes",
        "name layers 0-99999 only",
    ),
    "a number of thousands of digits": layer_list("1" * 5000, "is above 99999"),
    "a word": layer_list("1,x", "VLLM_EXPERT_HOST_LAYERS='1,x': cannot read 'x'", "0-5,40"),
    "two numbers without a comma": layer_list("1 2", "cannot read '1 2'"),
    "a negative layer": layer_list("-1", "cannot read '-1'"),
    "layers the model does not have in the list": layer_list(
        "2,9-10", f"VLLM_EXPERT_HOST_LAYERS names layer(s) 9-10, but {{model}} has {LAYERS}"
    ),
}


def make_cold_file(tmp: pathlib.Path, maker: Maker) -> pathlib.Path | None:
    if maker is None:
        return None
    if callable(maker):
        return maker(tmp)
    path = tmp / "cold.json"
    if isinstance(maker, bytes):
        path.write_bytes(maker)
    else:
        path.write_text(maker)
    return path


def through_the_preflight(tmp: pathlib.Path, model: pathlib.Path, case: Case):
    """(problem, fix) of the preflight's cold-file check; None when it does not fail."""
    cold = make_cold_file(tmp, case.cold)
    s = setup_for(
        tmp, model=str(model), cold_file=str(cold) if cold else None, host_layers=case.host_layers
    )
    [r] = pf.check_cold_file(s)[0]
    return (r.message, r.fix) if r.status == "fail" else None


def through_vllm(tmp: pathlib.Path, model: pathlib.Path, case: Case) -> str | None:
    """The series' loader: the layer list as OffloadSettings reads it, then the planner
    (the cold file on its own, against the model, then against its budget with the fake
    checkpoint's expert size, as the first host layer checks it); its error, or None."""
    from vllm.model_executor.layers.fused_moe.expert_offload import ExpertOffloadError
    from vllm.model_executor.layers.fused_moe.expert_offload.config import (
        OffloadSettings,
        parse_layer_list,
    )
    from vllm.model_executor.layers.fused_moe.expert_offload.planner import (
        ModelFacts,
        OffloadPlanner,
    )

    cold = make_cold_file(tmp, case.cold)
    facts = ModelFacts(str(model), LAYERS, architecture=ARCH, num_experts=E)
    try:
        host = parse_layer_list(case.host_layers)
        planner = OffloadPlanner(OffloadSettings(host, str(cold) if cold else None), facts)
        planner.check_budget(EXPERT, E)
    except ExpertOffloadError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", list(CASES))
def test_both_entry_points_accept_or_refuse_alike(tmp_path, name):
    case = CASES[name]
    model = make_model(tmp_path, layers=LAYERS, experts=E)
    (tmp_path / "tools").mkdir()
    (tmp_path / "vllm").mkdir()
    tools = through_the_preflight(tmp_path / "tools", model, case)
    vllm_error = through_vllm(tmp_path / "vllm", model, case)
    if case.problem is None:
        assert tools is None and vllm_error is None, (tools, vllm_error)
        return
    assert tools is not None, "the preflight accepted it"
    assert vllm_error is not None, "vLLM's loader accepted it"
    message, fix = tools
    # the tools call the model "the model", vLLM by its path
    assert case.problem.format(model="the model") in message
    assert case.problem.format(model=str(model)) in vllm_error
    assert case.fix in fix and case.fix in vllm_error
    for text in (message, fix, vllm_error):
        assert "\n" not in text and "Traceback" not in text
    if case.cold is not None and "{model}" not in case.problem:
        # a file refused on its own: both name the setting and the file
        assert "VLLM_EXPERT_COLD_FILE=" in message and "VLLM_EXPERT_COLD_FILE=" in vllm_error


def test_the_table_covers_what_it_must():
    assert len(CASES) >= 25
    refused = [c for c in CASES.values() if c.problem is not None]
    accepted = [c for c in CASES.values() if c.problem is None]
    assert len(refused) >= 25 and len(accepted) >= 3


@pytest.mark.parametrize(
    "spec, layers",
    [
        ("0-3", {0, 1, 2, 3}),
        ("0 - 3", {0, 1, 2, 3}),
        (" 0-1 ,\t3 ", {0, 1, 3}),
        ("2-2,2", {2}),
        ("007", {7}),
        ("", set()),
        (",,", set()),
    ],
)
def test_both_read_a_layer_list_alike(spec, layers):
    from vllm.model_executor.layers.fused_moe.expert_offload.config import parse_layer_list

    assert cold_contract.parse_layer_list(spec) == frozenset(layers)
    assert coldcheck.parse_layer_list(spec) == frozenset(layers)
    assert parse_layer_list(spec) == frozenset(layers)


def test_a_layer_list_never_builds_more_than_its_cap():
    parse = cold_contract.parse_layer_list
    assert len(parse("0-99999")) == cold_contract.MAX_LAYERS
    with pytest.raises(cold_contract.ContractError) as e:
        parse("0-100000")
    assert "is above 99999" in e.value.problem and e.value.fix == "name layers 0-99999 only"
    # with the model's last layer: refused above it, named in the message
    assert parse("0-7", max_layer=7) == frozenset(range(8))
    with pytest.raises(cold_contract.ContractError) as e:
        parse("0-8", "PP_LAYERS", max_layer=7)
    assert str(e.value) == (
        "PP_LAYERS='0-8': layer 8 is above 7, the model's last layer; name layers 0-7 only"
    )
    with pytest.raises(cold_contract.ContractError, match="the model has no layers"):
        parse("0", max_layer=-1)


# --- one file, two copies ----------------------------------------------------------------------


def file_added_by_series(path: str) -> bytes:
    """The text of the file that one patch of patches/series adds (no later patch may
    change it), rebuilt from the patch's lines."""
    series = [
        line.strip()
        for line in (ROOT / "patches" / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    touching = [
        name for name in series if f"+++ b/{path}\n" in (ROOT / "patches" / name).read_text()
    ]
    assert len(touching) == 1, f"{path} is touched by {touching}; one patch must add it"
    lines = (ROOT / "patches" / touching[0]).read_text().splitlines(keepends=True)
    start = lines.index(f"+++ b/{path}\n")
    assert lines[start - 1] == "--- /dev/null\n", "the patch must add the file, not change it"
    assert lines[start + 1].startswith("@@ -0,0 +1,")
    out = []
    for line in lines[start + 2 :]:
        if line.startswith("+"):
            out.append(line[1:])
        elif line.startswith("\\ No newline at end of file"):
            out[-1] = out[-1].removesuffix("\n")
        else:
            break
    return "".join(out).encode()


def test_the_series_carries_the_contract_byte_for_byte():
    ours = (ROOT / "scripts" / "eotools" / "cold_contract.py").read_bytes()
    assert file_added_by_series(SERIES_PATH) == ours


def test_the_tools_use_the_installed_series_copy():
    """The preflight refuses what vLLM would: it runs the contract of the installed series
    where there is one (find_spec, without importing vLLM)."""
    installed = coldcheck.installed_contract_path()
    assert installed is not None, "the test venv's vLLM must carry the series"
    assert str(installed) == coldcheck.CONTRACT_SOURCE
    assert installed.read_bytes() == (ROOT / "scripts/eotools/cold_contract.py").read_bytes()


def test_the_tools_fall_back_to_their_own_copy(tmp_path, monkeypatch):
    """An installed copy that is broken or lacks what the tools call (an older series) is
    not used."""
    fake = tmp_path / "cold_contract.py"
    monkeypatch.setattr(coldcheck, "installed_contract_path", lambda: fake)
    for text in ("raise RuntimeError('broken')\n", "FORMAT = 'x'\n"):
        fake.write_text(text)
        module, source = coldcheck.load_contract()
        assert module is cold_contract and source == cold_contract.__file__
    monkeypatch.setattr(coldcheck, "installed_contract_path", lambda: None)
    assert coldcheck.load_contract()[0] is cold_contract


def test_a_file_made_for_another_pipeline_size_is_used_with_one_warning(tmp_path):
    """Where the project accepts something odd, it says so: a file whose budget was made for
    pipeline parallel 2, served with 1, is used as it lists its layers (its stage budgets do
    not map onto this split), and both the preflight and vLLM's loader say so in one line."""
    import logging

    model = make_model(tmp_path, layers=LAYERS, experts=E)
    # a budget far below its experts: at PP=1 it would be refused (the case above)
    doc = cold_doc(
        {"0": [1, 2, 3]}, budget={"pipeline_parallel_size": 2, "gib_per_stage": [0.004, 0.004]}
    )
    case = Case(doc, None)
    (tmp_path / "tools").mkdir()
    cold = make_cold_file(tmp_path / "tools", case.cold)
    s = setup_for(tmp_path / "tools", model=str(model), cold_file=str(cold))
    [r] = pf.check_cold_file(s)[0]
    assert r.status == "warn", r
    assert "made for pipeline parallel size 2 and is served with 1" in r.message
    assert "budget per stage is not checked" in r.message and "select-cold-set" in r.fix
    (tmp_path / "vllm").mkdir()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    # vLLM's loggers do not propagate to the root logger: listen on the planner's own
    log = logging.getLogger("vllm.model_executor.layers.fused_moe.expert_offload.planner")
    log.addHandler(handler)
    try:
        assert through_vllm(tmp_path / "vllm", model, case) is None
    finally:
        log.removeHandler(handler)
    said = [m for m in lines if "pipeline parallel size 2" in m]
    assert len(said) == 1 and "VLLM_EXPERT_COLD_FILE=" in said[0], lines
