# SPDX-License-Identifier: Apache-2.0
"""simulate-swap --streams: several streams decoded together, as bench-offload --streams runs
them on the GPU. A step reads a host expert once however many of its streams picked it (the
kernel reads an expert's rows once per batch); the hindsight placement is the floor that no
fixed cold set can beat on the same run.

    scripts/test tests/cpu/test_simulate_streams.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from eotools import simulate_swap
from eotools.swap_policy import SwapPolicy, hindsight_host, simulate, simulate_steps


def steps_of(*steps) -> np.ndarray:
    """Steps (steps, streams, layers=1, top_k) from per-step lists of each stream's picks."""
    return np.array(steps, dtype=np.int64)[:, :, None, :]


def test_a_step_reads_a_host_expert_once_for_all_its_streams():
    # two streams, top-2, expert 3 on host: both streams pick it at the first step
    steps = steps_of([[3, 1], [3, 2]], [[0, 1], [2, 3]])
    r = simulate_steps(iter(steps), 1, 8, {0: [3]}, None)
    assert (r.tokens, r.steps, r.host_reads) == (4, 2, 2)
    assert r.reads_per_step == 1.0 and r.reads_per_token == 0.5
    # one token per step reads it at every pick
    per_token = simulate(iter(steps.reshape(4, 1, 2)), 1, 8, {0: [3]}, None)
    assert per_token.host_reads == 3


def test_the_swap_decides_on_every_pick_of_a_step():
    # expert 3 on host is picked by both streams; expert 5, on the GPU, never: a decision
    # after the first step (interval 1, margin 1) brings 3 in, so the next steps read nothing
    steps = steps_of(*[[[3, 1], [3, 2]]] * 3)
    policy = SwapPolicy(interval=1, half_life=1e9, margin=1.0)
    r = simulate_steps(iter(steps), 1, 8, {0: [3]}, policy)
    assert (r.host_reads, r.swaps) == (1, 1)
    # margin 2: the two picks of one step are not enough, those of two steps are
    later = simulate_steps(iter(steps), 1, 8, {0: [3]}, SwapPolicy(1, 1e9, 2.0))
    assert (later.host_reads, later.swaps) == (2, 1)
    stay = simulate_steps(iter(steps), 1, 8, {0: [3]}, SwapPolicy(1, 1e9, 10.0))
    assert (stay.host_reads, stay.swaps) == (3, 0)


def test_the_hindsight_placement_is_the_least_picked_of_each_layer():
    picks = np.array([[[[0, 1], [2, 3]], [[0, 1], [0, 2]]]], dtype=np.int64)  # (1, 2, 2, 2)
    # layer 0 picks 0 and 1; layer 1 picks 2, 3, 0, 2
    got = hindsight_host(picks.reshape(2, 1, 2, 2), 6, {0: [0, 1], 1: [2]})
    assert got[0] == [2, 3]  # never picked (ties broken by id)
    assert len(got[1]) == 1 and got[1][0] in (1, 4, 5)


def test_the_placement_rebuilt_for_each_batch_counts_what_it_moves():
    """Two batches of one stream: the first picks 3, the second 5 (both on host at the
    start with 4). Rebuilt per batch, neither batch reads the host; 3 leaves the host for
    the first (one pair), then 5 for the second (another), and among never-picked experts
    the ones already on the host stay there."""
    from eotools.swap_policy import placed_per_batch

    steps = steps_of([[3, 1]], [[3, 2]], [[5, 1]], [[5, 2]])
    r = placed_per_batch(steps, 8, {0: [3, 4, 5]}, [0, 2])
    assert (r.tokens, r.steps, r.host_reads, r.swaps) == (4, 4, 0, 2)
    # the fixed placement that the whole run picks least: never-picked experts, and among
    # them the one already on the host (4) before others
    fixed = hindsight_host(steps, 8, {0: [3, 4, 5]})
    assert simulate_steps(iter(steps), 1, 8, fixed, None).host_reads == 0
    assert 4 in fixed[0]


def test_the_placement_built_from_each_batchs_prompts():
    """Each batch placed by what its prompts picked. The first batch's prompts pick 3 (and
    2, 1): 3 comes to the GPU in exchange for 0, which they never picked, and its decode
    (3 and 2) reads nothing. The second batch's prompts pick 5 (and 2, 0): 5 and 0 come to
    the GPU in exchange for 1 and 3 (three pairs moved in all), but its decode picks 6,
    which stays on the host: two reads, one per step."""
    from eotools.swap_policy import placed_per_batch

    steps = steps_of([[3, 2]], [[3, 2]], [[6, 2]], [[6, 2]])
    prompts = {0: np.array([[[3, 2]], [[3, 1]]]), 2: np.array([[[5, 2]], [[5, 0]]])}
    r = placed_per_batch(steps, 8, {0: [3, 5, 6]}, [0, 2], prompts)
    assert (r.tokens, r.steps, r.host_reads, r.swaps) == (4, 4, 2, 3)
    # without the prompts, the same call is the hindsight floor: no read at all
    assert placed_per_batch(steps, 8, {0: [3, 5, 6]}, [0, 2]).host_reads == 0


def test_the_command_line_on_a_planted_model(tmp_path, repo_root):
    """bench-offload's workload on a two-layer make-test-model checkpoint: the fixed cold
    set, the swap and the hindsight placement, each with reads per token and per step; the
    hindsight placement reads no more than the cold set it replaces."""
    model = tmp_path / "m"
    tool = [sys.executable, str(repo_root / "scripts/make-test-model"), str(model)]
    subprocess.run([*tool, "--layers", "2", "--no-weights"], check=True, capture_output=True)
    cold = tmp_path / "cold.json"
    cfg = json.loads((model / "config.json").read_text())
    cold.write_text(
        json.dumps(
            {
                "format": "vllm-expert-offload/cold-set",
                "version": 1,
                "model": {
                    "name": model.name,
                    "architecture": cfg["architectures"][0],
                    "num_layers": 2,
                    "num_experts": cfg["num_experts"],
                },
                "layers": {"0": list(range(0, 512, 10)), "1": list(range(5, 512, 10))},
            }
        )
    )
    out = tmp_path / "sim.json"
    args = ["--cold", str(cold), "--model", str(model), "--streams", "4", "--batches", "1"]
    assert simulate_swap.main([*args, "--decode-tokens", "17", "--json", str(out)]) == 0
    rows = {r["placement"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {
        "fixed cold set",
        "swap 8/512/2",
        "hindsight fixed placement",
        "hindsight placement per batch",
        "placement per batch by prompts",
    }
    what_if = ["--decode-tokens", "17", "--max-swaps", "4", "--count-prompts"]
    assert simulate_swap.main([*args, *what_if, "--json", str(tmp_path / "w.json")]) == 0
    labels = [r["placement"] for r in json.loads((tmp_path / "w.json").read_text())["results"]]
    assert "swap 8/512/2 x4 +prompts" in labels
    assert simulate_swap.main([*args, "--max-swaps", "0"]) == 1
    for r in rows.values():
        assert (r["steps"], r["tokens"]) == (2 * 16, 2 * 16 * 4)  # warm-up + 1 batch
        assert r["reads_per_step"] == r["reads_per_token"] * 4
    per_batch, fixed, cold = (
        rows[k]["reads_per_token"]
        for k in ("hindsight placement per batch", "hindsight fixed placement", "fixed cold set")
    )
    assert per_batch <= fixed <= cold
    assert rows["fixed cold set"]["reads_per_token"] > 0
    bad = simulate_swap.main([*args[:4], "--streams", "0"])
    assert bad == 1


def test_what_if_more_swaps_per_decision_and_prompt_picks_counted():
    """--max-swaps K trades up to K pairs per layer per decision, the most used host
    expert with the least used GPU one, then the next pair, while the margin holds; the
    runtime's kernel trades one (K=1 is the reference). Prompt picks, counted before their
    batch's first step, let the first decision act on them."""
    # host experts 3, 4, 5; the stream picks 3 and 4 at every step
    steps = steps_of(*[[[3, 4]]] * 4)
    host = {0: [3, 4, 5]}
    one = simulate_steps(iter(steps), 1, 8, host, SwapPolicy(2, 1e9, 1.0))
    two = simulate_steps(iter(steps), 1, 8, host, SwapPolicy(2, 1e9, 1.0, max_swaps=2))
    assert (one.host_reads, one.swaps) == (2 + 2 + 1 + 1, 2)  # 4 leaves at the second decision
    assert (two.host_reads, two.swaps) == (2 + 2, 2)  # both leave at the first
    # expert 5 is never picked: no third pair even with K=8
    many = simulate_steps(iter(steps), 1, 8, host, SwapPolicy(2, 1e9, 1.0, max_swaps=8))
    assert many.swaps == 2
    # the prompt picked 3 and 4 twice: the first decision already has them
    prompt = {0: np.array([[[3, 4]], [[3, 4]]])}
    early = simulate_steps(iter(steps), 1, 8, host, SwapPolicy(1, 1e9, 1.0, 2), prompt)
    assert (early.host_reads, early.swaps) == (2, 2)
    assert simulate_steps(iter(steps), 1, 8, host, None, prompt).host_reads == 8
