# SPDX-License-Identifier: Apache-2.0
"""Bad cold files given to the project's tools: `select-cold-set evaluate`, `simulate-swap` and
the preflight's cold-file check each stop with one line that names the problem and the fix
(their documented exit code), never a traceback, and apply the rules of the series' loader
(tests/cpu/test_offload_layers.py checks the loader on the same files).

    scripts/test tests/cpu/test_cold_file_input.py
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from eotools import preflight as pf
from eotools import select_cold_set, simulate_swap
from eotools.counts import Counts
from test_preflight import make_cold, make_model, only, setup_for

E, K, LAYERS = 16, 2, 3
MODEL = {"name": "m", "architecture": "Qwen3MoeForCausalLM", "num_layers": LAYERS, "num_experts": E}
HEAD = {"format": "vllm-expert-offload/cold-set", "version": 1, "model": MODEL}

# (the cold file's text, words its one-line error must hold)
BAD = {
    "an empty file": ("", "the file is empty"),
    "no layers": (json.dumps({**HEAD, "layers": {}}), "lists no host expert"),
    "only empty layers": (json.dumps({**HEAD, "layers": {"0": []}}), "lists no host expert"),
    "an expert id out of range": (
        json.dumps({**HEAD, "layers": {"0": [1, E]}}),
        f"expert id(s) [{E}] are outside 0-{E - 1}",
    ),
    "a negative expert id": (
        json.dumps({**HEAD, "layers": {"1": [-1]}}),
        "expert id(s) [-1] are outside",
    ),
    "a duplicate id": (
        json.dumps({**HEAD, "layers": {"0": [3, 5, 3]}}),
        "layer 0 lists expert(s) [3] more than once",
    ),
    "a superscript layer key": (
        json.dumps({**HEAD, "layers": {"\u00b2": [1]}}),
        "layer key '²' is not a layer number",
    ),
    "a budget as a string": (
        json.dumps({**HEAD, "budget": "3GiB", "layers": {"0": [1]}}),
        "'budget' must be an object",
    ),
    "a stage budget as a string": (
        json.dumps(
            {
                **HEAD,
                "budget": {"pipeline_parallel_size": 1, "gib_per_stage": ["3GiB"]},
                "layers": {"0": [1]},
            }
        ),
        "'gib_per_stage' must be a list of GiB per pipeline stage as numbers",
    ),
}


def write(tmp: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp / "cold.json"
    path.write_text(text)
    return path


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ")
    return lines[0]


def counts_file(tmp: pathlib.Path) -> pathlib.Path:
    picks = np.arange(LAYERS * E).reshape(LAYERS, E)
    c = Counts(
        MODEL,
        {"name": "code", "kind": "code", "tokens": {"prefill": 100, "decode": 100}},
        prefill=picks.astype(np.int64),
        decode=picks.astype(np.int64),
        top_k=K,
    )
    path = tmp / "code.json"
    c.save(path)
    return path


def picks_file(tmp: pathlib.Path) -> pathlib.Path:
    path = tmp / "picks.npy"
    np.save(path, np.zeros((4, LAYERS, K), dtype=np.int64))
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_evaluate_refuses_a_bad_cold_file_in_one_line(tmp_path, capsys, case):
    text, words = BAD[case]
    cold = write(tmp_path, text)
    code = select_cold_set.main(
        ["evaluate", "--cold", str(cold), "--counts", str(counts_file(tmp_path))]
    )
    line = one_error_line(capsys.readouterr().err)
    assert code == 1
    assert words in line and str(cold) in line and "select-cold-set" in line


@pytest.mark.parametrize("case", list(BAD))
def test_simulate_swap_refuses_a_bad_cold_file_in_one_line(tmp_path, capsys, case):
    text, words = BAD[case]
    cold = write(tmp_path, text)
    code = simulate_swap.main(["--cold", str(cold), "--picks", str(picks_file(tmp_path))])
    line = one_error_line(capsys.readouterr().err)
    assert code == 1
    assert words in line and str(cold) in line and "select-cold-set" in line


def test_the_tools_refuse_layers_the_counts_or_model_do_not_have(tmp_path, capsys):
    cold = write(tmp_path, json.dumps({**HEAD, "layers": {"5": [1]}}))
    code = select_cold_set.main(
        ["evaluate", "--cold", str(cold), "--counts", str(counts_file(tmp_path))]
    )
    assert code == 1
    assert "layer(s) [5]" in one_error_line(capsys.readouterr().err)
    assert simulate_swap.main(["--cold", str(cold), "--picks", str(picks_file(tmp_path))]) == 1
    assert "layer(s) [5]" in one_error_line(capsys.readouterr().err)


def test_simulate_swap_refuses_picks_outside_the_models_experts(tmp_path, capsys):
    cold = write(tmp_path, json.dumps({**HEAD, "layers": {"0": [1]}}))
    picks = tmp_path / "picks.npy"
    np.save(picks, np.full((4, LAYERS, K), E, dtype=np.int64))
    assert simulate_swap.main(["--cold", str(cold), "--picks", str(picks)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"not all in 0-{E - 1}" in line


def test_a_directory_is_called_a_directory_by_every_tool(tmp_path, capsys):
    assert simulate_swap.main(["--cold", str(tmp_path), "--picks", str(picks_file(tmp_path))]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "is a directory, not a cold file" in line and "no such file" not in line
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file=str(tmp_path))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail" and "is a directory, not a cold file" in r.message
    assert "not its folder" in r.fix


# ---- the preflight's cold-file check ------------------------------------------------------------


@pytest.mark.parametrize("case", list(BAD))
def test_preflight_refuses_a_bad_cold_file_with_its_exit_code(tmp_path, case):
    text, words = BAD[case]
    model = make_model(tmp_path, layers=LAYERS, experts=E)
    s = setup_for(tmp_path, model=str(model), cold_file=str(write(tmp_path, text)))
    results = pf.run_checks(s, ["vllm"])
    [r] = only(results, "cold-file")
    assert r.status == "fail" and words in r.message and "\n" not in r.message
    assert "select-cold-set" in r.fix
    assert pf.exit_code(results) == pf.EXIT_CODES["cold-file"]


def qwen4exp_model(tmp: pathlib.Path, layers: int = 4, experts: int = 64) -> pathlib.Path:
    d = make_model(tmp, layers=layers, experts=experts)
    cfg = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "text_config": {"num_hidden_layers": layers, "num_experts": experts},
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_preflight_refuses_a_cold_file_naming_the_mtp_layer(tmp_path):
    """Qwen4Exp's MTP MoE layer is mtp.layers.{num_hidden_layers}.mlp.experts: never
    offloaded, and the message says so rather than "the model has 4 layers"."""
    model = qwen4exp_model(tmp_path)
    made_for = {"architecture": "Qwen4ExpForCausalLM", "num_layers": 4, "num_experts": 64}
    cold = make_cold(tmp_path, {0: [1], 4: [2]}, model=made_for)
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail"
    assert "layer 4 is the model's MTP layer (mtp.layers.4.mlp.experts)" in r.message
    assert "remove layer(s) 4 from 'layers'" in r.fix


def test_preflight_refuses_a_qwen3_moe_cold_file_for_a_qwen4exp_model(tmp_path):
    model = qwen4exp_model(tmp_path)
    cold = make_cold(tmp_path, {0: [1], 7: [100]})  # Qwen3-MoE: 8 layers x 512 experts
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold))
    results = pf.run_checks(s, ["vllm"])
    [r] = only(results, "cold-file")
    assert r.status == "fail"
    for words in (
        "made for a Qwen3MoeForCausalLM model, but the model is a Qwen4ExpForCausalLM",
        "made for 8 layers, but the model has 4",
        "made for 512 experts per layer, but the model has 64",
    ):
        assert words in r.message
    assert "select-cold-set select" in r.fix
    assert pf.exit_code(results) == pf.EXIT_CODES["cold-file"]


def test_preflight_warns_about_a_cold_file_made_for_another_model_name(tmp_path):
    model = make_model(tmp_path)  # the folder is "model"
    made_for = {"name": "Qwen3-30B-A3B", "num_layers": 8, "num_experts": 512}
    cold = make_cold(tmp_path, {0: [1]}, model=made_for)
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "warn"
    assert "made for model 'Qwen3-30B-A3B', but the model is 'model'" in r.message
    assert "so vLLM uses it" in r.message and "select-cold-set" in r.fix
    # the same folder name elsewhere is the same model: no warning
    made_for["name"] = "/elsewhere/model"
    cold = make_cold(tmp_path, {0: [1]}, model=made_for)
    [r] = only(
        pf.run_checks(setup_for(tmp_path, model=str(model), cold_file=str(cold)), ["vllm"]),
        "cold-file",
    )
    assert r.status == "ok"


def test_a_small_budget_is_shown_in_units_that_show_it(tmp_path):
    from eotools.coldcheck import human_bytes

    # 2 experts x 2 MiB against a budget of 1 MiB per stage: not "made for 0.00 GiB"
    model = make_model(tmp_path)
    budget = {"pipeline_parallel_size": 1, "gib_per_stage": [1 / 1024]}
    cold = make_cold(tmp_path, {0: [1, 2]}, budget=budget)
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail"
    assert (
        "4.00 MiB on pipeline rank 0" in r.message
        and "made for a budget of 1.00 MiB per stage" in r.message
    )
    assert (human_bytes(3 << 30), human_bytes(0.5 * (1 << 30)), human_bytes(512)) == (
        "3.00 GiB",
        "0.50 GiB",
        "0.50 KiB",
    )


def test_a_cold_file_without_host_experts_is_not_written(tmp_path):
    """vLLM refuses it at start-up; select-cold-set and budget-start stop before writing."""
    from eotools.coldset import write_cold_file
    from eotools.selection import SelectionError

    with pytest.raises(SelectionError, match="no layer has a host expert"):
        write_cold_file(tmp_path / "cold.json", {0: [], 1: []}, MODEL, {})
    assert not (tmp_path / "cold.json").exists()
