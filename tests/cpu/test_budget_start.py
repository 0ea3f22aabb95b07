# SPDX-License-Identifier: Apache-2.0
"""Budget-only start (scripts/budget-start): the first start spreads the budget evenly; the
counting hook's files of a run are added to the usage history at the next start, which then
selects the least-used experts; files of another model or unreadable ones are set aside.

    scripts/test tests/cpu/test_budget_start.py
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from eotools import budget_start
from eotools.coldset import model_identity
from eotools.counts import Counts
from eotools.selection import GiB, expert_bytes


def plan(model, state, gib=None, pp=2):
    per = expert_bytes(model)
    gib = gib if gib is not None else 6 * per / GiB  # six experts per stage
    messages: list[str] = []
    start = budget_start.plan(model, gib, pp, state, log=messages.append)
    os.close(start.lock_fd)  # the server would hold it; the next start in this test takes it
    return start, messages


def hook_file(model, path, decode, tokens=1000, pp_rank=0, pp_size=1, layers=None, **model_kw):
    """A counts file as the counting hook writes it for one rank."""
    ident = {**model_identity(model), **model_kw}
    decode = np.asarray(decode, dtype=np.int64)
    extra = {"rank": {"pp_rank": pp_rank, "pp_size": pp_size, "dp_rank": 0, "dp_size": 1}}
    extra["layers"] = layers if layers is not None else list(range(decode.shape[0]))
    Counts(
        ident,
        {"name": "served", "tokens": {"prefill": 0, "decode": tokens}},
        np.zeros_like(decode),
        decode,
        8,
        "vllm counting hook",
        extra,
    ).save(path)


def cold_layers(path: pathlib.Path) -> dict[int, list[int]]:
    return {int(k): v for k, v in json.loads(path.read_text())["layers"].items()}


def test_the_first_start_spreads_the_budget_evenly(tiny_model, tmp_path):
    start, messages = plan(tiny_model, tmp_path / "state")
    ident = model_identity(tiny_model)
    e = ident["num_experts"]
    assert start.kind == "initial" and start.tokens_learned == 0
    # 4 layers, 2 stages: six experts per stage, three per layer, each layer's highest ids
    assert cold_layers(start.cold_file) == {x: [e - 3, e - 2, e - 1] for x in range(4)}
    doc = json.loads(start.cold_file.read_text())
    assert doc["model"]["num_layers"] == 4 and doc["budget"]["experts_per_stage"] == [6, 6]
    assert start.count_file == tmp_path / "state" / "run" / start.run_id / "counts.json"
    assert "initial placement" in messages[-1]


def test_the_next_start_learns_the_least_used_experts(tiny_model, tmp_path):
    state = tmp_path / "state"
    e = model_identity(tiny_model)["num_experts"]
    rng = np.random.default_rng(0)
    decode = rng.integers(50, 1000, size=(4, e))
    decode[0, [1, 2]] = 0  # never picked
    (state / "run").mkdir(parents=True)
    # two pipeline ranks, each writing its own layers (zeros elsewhere)
    for rank, layers in ((0, [0, 1]), (1, [2, 3])):
        part = np.zeros_like(decode)
        part[layers] = decode[layers]
        hook_file(tiny_model, state / "run" / f"counts.pp{rank}.json", part, 500, rank, 2, layers)
    start, messages = plan(tiny_model, state)
    assert start.kind == "learned" and start.tokens_learned == 500
    assert not list((state / "run").glob("*.json"))  # folded into the history
    history = json.loads((state / "usage.json").read_text())
    assert np.array_equal(np.asarray(history["decode"]), decode) and history["runs"] == 1
    cold = cold_layers(start.cold_file)
    for stage in ([0, 1], [2, 3]):
        flat = sorted((decode[x, i], x, i) for x in stage for i in range(e))
        assert sorted((x, i) for x in stage for i in cold.get(x, [])) == sorted(
            (x, i) for _, x, i in flat[:6]
        )
    assert {1, 2} <= set(cold[0])

    # a second run adds up
    hook_file(tiny_model, state / "run" / "counts.json", decode, 300)
    start, _ = plan(tiny_model, state)
    history = json.loads((state / "usage.json").read_text())
    assert history["runs"] == 2 and start.tokens_learned == 800
    assert np.array_equal(np.asarray(history["decode"]), 2 * decode)


def test_counts_of_another_model_are_set_aside(tiny_model, tmp_path):
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True)
    e = model_identity(tiny_model)["num_experts"]
    hook_file(tiny_model, state / "run" / "counts.json", np.ones((4, e)), num_layers=48)
    (state / "usage.json").write_text("{ not json")
    start, messages = plan(tiny_model, state)
    assert start.kind == "initial"
    aside = sorted(p.name for p in (state / "set-aside").iterdir())
    assert len(aside) == 2 and any(n.endswith("counts.json") for n in aside)
    assert any(n.endswith("usage.json") for n in aside)
    assert sum("warning" in m and "not used" in m for m in messages) == 2
    assert any("num_layers 48" in m and "counts.json" in m for m in messages)


def test_cli_prints_exports_and_refuses_what_cannot_work(repo_root, tiny_model, tmp_path):
    tool = [sys.executable, str(repo_root / "scripts/budget-start")]
    state = tmp_path / "state"
    r = subprocess.run(
        [
            *tool,
            "--budget-gib",
            "0.001",
            "--state-dir",
            str(state),
            "--",
            str(tiny_model),
            "-pp",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    env = subprocess.run(
        ["bash", "-c", r.stdout + 'echo "$VLLM_EXPERT_COLD_FILE|$VLLM_EXPERT_COUNT_FILE"'],
        capture_output=True,
        text=True,
    ).stdout.strip()
    (run,) = (state / "run").iterdir()  # this start's run folder, named by its run id
    assert env == f"{state / 'cold-0.001GiB.json'}|{run / 'counts.json'}"
    assert (
        json.loads((state / "cold-0.001GiB.json").read_text())["budget"]["pipeline_parallel_size"]
        == 2
    )
    too_big = subprocess.run(
        [*tool, "--budget-gib", "1000", "--state-dir", str(state), "--model", str(tiny_model)],
        capture_output=True,
        text=True,
    )
    assert too_big.returncode == 1 and "lower the budget" in too_big.stderr
    assert "fix:" in too_big.stderr
    no_model = subprocess.run([*tool, "--budget-gib", "1", "--state-dir", str(state)])
    assert no_model.returncode == 2


@pytest.mark.parametrize("layers,pp", [(4, 1), (4, 3)])
def test_initial_placement_never_exceeds_the_budget(layers, pp):
    from eotools.selection import stage_layers

    stages = stage_layers(layers, pp)
    per = 1000
    cold = budget_start.initial_placement(stages, 16, [10 * per / GiB], per)
    for s in stages:
        n = sum(len(cold.get(x, [])) for x in s)
        assert n == 10  # exactly the budget's experts, spread over the stage's layers
        counts = [len(cold.get(x, [])) for x in s]
        assert max(counts) - min(counts) <= 1


def test_the_stages_follow_the_layer_partition(tiny_model, tmp_path):
    """VLLM_PP_LAYER_PARTITION=1,3 splits as vLLM does: stage 0 is layer 0 alone."""
    per = expert_bytes(tiny_model)
    start = budget_start.plan(tiny_model, 6 * per / GiB, 2, tmp_path / "s", [1, 3], log=print)
    doc = json.loads(start.cold_file.read_text())
    assert doc["budget"]["layer_partition"] == [1, 3]
    assert doc["budget"]["experts_per_stage"] == [6, 6]
    assert len(cold_layers(start.cold_file)[0]) == 6  # the whole stage-0 budget in layer 0


def test_host_layers_stay_out_of_the_cold_file(tiny_model, tmp_path):
    """vLLM refuses a cold file naming a layer of VLLM_EXPERT_HOST_LAYERS: the budget goes
    to the stage's other layers; a stage that is all host layers gets no expert, said once."""
    per = expert_bytes(tiny_model)
    messages: list[str] = []
    start = budget_start.plan(
        tiny_model, 6 * per / GiB, 2, tmp_path / "a", None, messages.append, frozenset({0})
    )
    layers = cold_layers(start.cold_file)
    assert 0 not in layers and len(layers[1]) == 6  # stage 0 is layers 0-1
    start = budget_start.plan(
        tiny_model, 6 * per / GiB, 2, tmp_path / "b", None, messages.append, frozenset({0, 1})
    )
    assert set(cold_layers(start.cold_file)) == {2, 3}
    assert sum("every layer of pipeline stage 0 (0-1)" in m for m in messages) == 1
    with pytest.raises(ValueError, match=r"names layer\(s\) 4-5, but the model has 4"):
        budget_start.plan(tiny_model, 0.001, 1, tmp_path / "c", None, print, frozenset({4, 5}))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--budget-gib", "inf"], "--budget-gib 'inf': not a finite"),
        (["--budget-gib", "nan"], "--budget-gib 'nan': not a finite"),
        (["--budget-gib", "0"], "--budget-gib '0': outside > 0"),
        (["--budget-gib", "1", "--layer-partition", "2,x"], "--layer-partition '2,x'"),
        (["--budget-gib", "1", "--host-layers", "3-1"], "runs backwards"),
        (["--budget-gib", "1", "--", "/m", "-pp", "zero"], "parallel sizes"),
    ],
)
def test_cli_refuses_bad_values_with_usage(repo_root, tmp_path, argv, says):
    tool = [sys.executable, str(repo_root / "scripts/budget-start")]
    r = subprocess.run([*tool, "--state-dir", str(tmp_path), *argv], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr


def test_cli_reads_the_partition_and_host_layers_vllm_reads(repo_root, tiny_model, tmp_path):
    """Run on its own, budget-start splits as vLLM will with this environment."""
    env = {**os.environ, "VLLM_PP_LAYER_PARTITION": "1,3", "VLLM_EXPERT_HOST_LAYERS": "2"}
    r = subprocess.run(
        [sys.executable, str(repo_root / "scripts/budget-start"), "--budget-gib", "0.001"]
        + ["--state-dir", str(tmp_path / "s"), "--", str(tiny_model), "-pp", "2"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "s" / "cold-0.001GiB.json").read_text())
    assert doc["budget"]["layer_partition"] == [1, 3] and "2" not in doc["layers"]


def test_budget_start_does_not_need_the_preflight(repo_root, tiny_model, tmp_path):
    """The earlier step of a start does not import the later one."""
    code = (
        "import sys; sys.modules['eotools.preflight'] = None\n"
        f"sys.path.insert(0, {str(repo_root / 'scripts')!r})\n"
        "from eotools.budget_start import main\n"
        f"sys.exit(main(['--budget-gib', '0.001', '--state-dir', {str(tmp_path)!r}, "
        f"'--model', {str(tiny_model)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
