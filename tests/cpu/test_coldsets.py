# SPDX-License-Identifier: Apache-2.0
"""Cold-set tooling: counts files, normalisation, per-stage budgets, evaluation against uniform
random, the runtime-swap policy and its simulation, on the synthetic model's planted routing.

    scripts/test tests/cpu/test_coldsets.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from eotools.counts import Counts, CountsError, check_same_model, load_counts
from eotools.selection import (
    SelectionError,
    evaluate,
    normalised_usage,
    select_cold,
    stage_layers,
)
from eotools.swap_policy import SwapPolicy, SwapState, simulate

E, K = 16, 2
MODEL = {"name": "m", "architecture": "Qwen3MoeForCausalLM", "num_layers": 3, "num_experts": E}


def counts(name: str, picks: np.ndarray, tokens: int = 100, **model) -> Counts:
    return Counts(
        {**MODEL, **model},
        {"name": name, "kind": name, "tokens": {"prefill": tokens, "decode": tokens}},
        prefill=picks.astype(np.int64),
        decode=picks.astype(np.int64),
        top_k=K,
    )


# ---- counts files ------------------------------------------------------------------------------
def test_counts_round_trip_and_validation(tmp_path):
    c = counts("code", np.arange(3 * E).reshape(3, E))
    c.save(tmp_path / "code.json")
    back = load_counts(tmp_path / "code.json")
    assert np.array_equal(back.prefill, c.prefill) and back.data == c.data
    (tmp_path / "bad.json").write_text("{broken")
    with pytest.raises(CountsError, match="not a readable counts file"):
        load_counts(tmp_path / "bad.json")
    doc = json.loads((tmp_path / "code.json").read_text())
    doc["decode"] = doc["decode"][:2]
    (tmp_path / "shape.json").write_text(json.dumps(doc))
    with pytest.raises(CountsError, match="layers x experts"):
        load_counts(tmp_path / "shape.json")


def test_counts_from_another_model_or_empty_are_refused():
    a = counts("code", np.ones((3, E)))
    other = counts("chat", np.ones((3, E)), num_layers=48)
    with pytest.raises(CountsError, match="num_layers=48") as e:
        check_same_model([a, other])
    assert "count again" in str(e.value)
    with pytest.raises(CountsError, match="no counted tokens"):
        check_same_model([a, counts("empty", np.zeros((3, E)), tokens=0)])


# ---- normalisation and stages ------------------------------------------------------------------
def test_each_data_set_counts_the_same_after_normalisation():
    big = np.zeros((3, E))
    big[:, 0] = 1000  # a large data set using expert 0
    small = np.zeros((3, E))
    small[:, 1] = 10  # a small one using expert 1
    usage = normalised_usage([counts("big", big), counts("small", small)])
    assert usage[0, 0] == pytest.approx(usage[0, 1])
    weighted = normalised_usage([counts("big", big), counts("small", small)], [1, 3])
    assert weighted[0, 1] == pytest.approx(3 * weighted[0, 0])
    with pytest.raises(SelectionError, match="one non-negative weight"):
        normalised_usage([counts("big", big)], [1, 2])


@pytest.mark.parametrize("layers,pp", [(48, 2), (47, 3), (10, 4), (61, 8), (7, 1)])
def test_stages_split_layers_as_vllm_does(layers, pp):
    from vllm.distributed.utils import get_pp_indices

    assert [(r.start, r.stop) for r in stage_layers(layers, pp)] == [
        get_pp_indices(layers, rank, pp) for rank in range(pp)
    ]
    assert [len(r) for r in stage_layers(10, 3, [2, 5, 3])] == [2, 5, 3]
    with pytest.raises(SelectionError, match="does not split"):
        stage_layers(10, 3, [2, 5, 4])


def test_budgets_per_stage():
    usage = np.tile(np.arange(E, dtype=float), (4, 1))  # expert e has usage e in every layer
    usage[3] += 100  # layer 3 is busy
    stages = stage_layers(4, 2)  # layers 0-1 and 2-3
    per_expert = 1 << 20
    # 3 MiB on stage 0 and 5 MiB on stage 1: least used first, across the stage's layers
    cold, picks = select_cold(usage, stages, [3 / 1024, 5 / 1024], per_expert)
    assert [p.experts for p in picks] == [3, 5]
    assert cold == {0: [0, 1], 1: [0], 2: [0, 1, 2, 3, 4]}
    # a budget larger than one layer spills into the next layer of the stage
    cold, _ = select_cold(usage, stages, [20 / 1024, 0.0], per_expert)
    assert len(cold[0]) + len(cold[1]) == 20 and 2 not in cold
    with pytest.raises(SelectionError, match="smaller than one expert"):
        select_cold(usage, stages, [0.5 / 1024], per_expert)
    with pytest.raises(SelectionError, match="have only 32"):
        select_cold(usage, stages, [40 / 1024], per_expert)
    with pytest.raises(SelectionError, match="every expert of the stage"):
        select_cold(usage, stages, [32 / 1024], per_expert)


def test_evaluation_against_uniform_random():
    picks = np.zeros((3, E))
    picks[:, :K] = 100  # 100 tokens, each picking experts 0 and 1 in every layer
    c = counts("chat", picks)
    hot = evaluate({0: [0], 1: [0], 2: [0]}, c)
    assert hot.host_reads_per_token == pytest.approx(3.0)  # one of two picks, three layers
    assert hot.uniform_reads_per_token == pytest.approx(3 * K / E)
    cold = evaluate({0: [5, 6], 2: [7]}, c)
    assert cold.host_reads_per_token == 0.0 and cold.ratio == 0.0


# ---- the swap policy ----------------------------------------------------------------------------
def test_policy_moves_a_hot_host_expert_and_respects_the_margin():
    state = SwapState(1, 4, {0: [3]})
    policy = SwapPolicy(interval=1, half_life=1e9, margin=2.0)
    for _ in range(2):
        state.observe(np.array([[3, 0]]))
    assert state.decide(policy) == []  # expert 3: 2 picks, least-used GPU expert 1: 0 (not > 2)
    state.observe(np.array([[3, 0]]))
    assert state.decide(policy) == [(0, 3, 1)]  # 3 > 0 + 2: expert 3 to the GPU, 1 to host
    assert state.on_host[0].tolist() == [False, True, False, False]
    assert state.host_reads(np.array([[1, 3]])) == 1


def test_a_negative_margin_swaps_every_layer_at_every_decision():
    """The stress setting of the live test: equal counts swap too (lowest ids on ties)."""
    state = SwapState(2, 4, {0: [3], 1: [0, 1]})
    policy = SwapPolicy(interval=1, half_life=1.0, margin=-1.0)
    assert state.decide(policy) == [(0, 3, 0), (1, 0, 2)]
    assert state.decide(policy) == [(0, 0, 1), (1, 1, 0)]
    assert state.on_host.sum(axis=1).tolist() == [1, 2]


def test_counts_decay_with_the_half_life():
    state = SwapState(1, 4, {0: [3]})
    state.observe(np.array([[0, 1]]))
    state.decide(SwapPolicy(interval=8, half_life=8.0, margin=100))
    assert state.counts[0, 0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="invalid swap policy"):
        SwapPolicy(interval=0)


def test_swap_halves_host_reads_on_conversations_that_stay_in_one_domain(repo_root, tmp_path):
    """The finding on the synthetic model: a cold set from mixed data, then the
    runtime swap on held-out conversations of one domain cuts host reads by more than half,
    also counting each swap as two reads; and the mixed set beats uniform on every domain
    while a one-domain set is worse than uniform on its opposite domain."""
    out = tmp_path / "cold"
    r = subprocess.run(
        ["bash", str(repo_root / "scripts/make-synthetic-cold-sets"), str(out)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    sim = json.loads((out / "swap-simulation.json").read_text())["results"]
    by = {}
    for row in sim:
        by.setdefault(row["workload"], {})["swap" if row["policy"] else "fixed"] = row
    assert len(by) == 6
    for workload, rows in by.items():
        fixed = rows["fixed"]["reads_per_token"]
        swapped = rows["swap"]["reads_per_token"] + 2 * rows["swap"]["swaps_per_token"]
        assert swapped < 0.5 * fixed, workload
    domains = set(by)
    mixed = report.split("## 1 GiB")[1].split("##")[0]
    ratios = [
        float(line.split()[-1])
        for line in mixed.splitlines()
        if line.split() and line.split()[0] in domains
    ]
    assert len(ratios) == 6 and max(ratios) < 1.0
    code_only = report.split("counted on one domain only")[1].split("##")[0]
    story = next(line for line in code_only.splitlines() if line.startswith("story"))
    assert float(story.split()[-1]) > 1.0
    # the committed cold sets are what the script makes (but for their creation time)
    for name in ("0.5GiB.json", "1GiB.json", "2GiB.json", "4GiB.json"):
        made = json.loads((out / name).read_text())
        shipped = json.loads((repo_root / "cold/synthetic-target-int4-8l" / name).read_text())
        assert made["layers"] == shipped["layers"] and made["model"] == shipped["model"]


def test_simulation_without_a_policy_counts_reads_only():
    picks = [np.array([[0, 1], [2, 3]])] * 10
    r = simulate(iter(picks), 2, 4, {0: [1], 1: [2, 3]}, None)
    assert (r.tokens, r.host_reads, r.swaps) == (10, 30, 0)
