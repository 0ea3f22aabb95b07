# SPDX-License-Identifier: Apache-2.0
"""The runtime swap wired into serving (expert_offload/swap_runtime.py) on the CPU: one-table
layers register, the first forward makes the counters from the merged tables and routes
the router's expert ids through them, the model runner's step marks decode tokens for
counting, and every `interval` decode steps one decision (decide + swap kernels) is enqueued
over every layer's weight and scale tensors (never the router gate). The kernels themselves
are checked in tests/cpu/test_swap_kernels.py; here they are recorded.

    scripts/test tests/cpu/test_swap_runtime.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_offload_layers import E, K
from test_one_table import COLD, loaded  # noqa: F401 (a fixture)


@pytest.fixture
def runtime(loaded, monkeypatch):  # noqa: F811
    from vllm.model_executor.layers.fused_moe.expert_offload import (
        one_table,
        swap,
        swap_runtime,
    )

    runner, _ = loaded
    table = one_table.merge(runner.routed_experts, one_table.cpu_allocator)
    runner.routed_experts.__dict__["one_table"] = table
    calls = {"count": [], "step": []}

    def route_picks(state, i, ids, valid=None):
        calls["count"].append((i, valid))
        return ids + 100  # recognisable: these came from the (recorded) kernel

    monkeypatch.setattr(swap, "route_picks", route_picks)
    monkeypatch.setattr(
        swap, "step", lambda state, tables, decay, margin: calls["step"].append(tables)
    )
    rt = swap_runtime.SwapRuntime(swap_runtime.SwapSettings(8, 512.0, 2.0), max_tokens=16)
    assert rt.register(runner.routed_experts)
    return rt, runner, table, calls


def test_the_first_forward_makes_counters_from_the_merged_table(runtime):
    rt, runner, table, calls = runtime
    rt.prepare_step(np.array([0, 1]), np.array([False]))  # before any forward: nothing
    assert rt.state is None and rt.decode_steps == 0
    ids = torch.randint(0, E, (4, K), dtype=torch.int32)
    assert torch.equal(rt.route(runner.routed_experts, ids), ids + 100)
    assert rt.state.gpu_rows.tolist() == [E - len(COLD)]
    assert rt.state.row_to_expert[0].tolist() == table.row_to_expert
    assert torch.equal(rt.state.expert_to_row[0], table.expert_to_row)
    [(layer, valid)] = calls["count"]
    assert layer == 0 and valid.shape == (4,) and not valid.any()  # nothing marked yet
    # more tokens than the mask holds: mapped through the same map, not counted
    many = torch.randint(0, E, (17, K), dtype=torch.int64)
    rows = rt.route(runner.routed_experts, many)
    assert len(calls["count"]) == 1
    assert rows.dtype == torch.int64
    assert torch.equal(torch.tensor(table.row_to_expert)[rows], many)


def test_the_step_marks_decode_tokens_and_clears_stale_ones(runtime):
    rt, runner, _, _ = runtime
    rt.route(runner.routed_experts, torch.zeros((1, K), dtype=torch.int32))
    # three requests: a 5-token prefill chunk, then two decode tokens
    rt.prepare_step(np.array([0, 5, 6, 7]), np.array([True, False, False]))
    assert rt.mask[:8].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    rt.prepare_step(np.array([0, 1]), np.array([False]))
    assert rt.mask[:8].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    rt.prepare_step(None, None)  # a dummy run counts nothing
    assert not rt.mask.any()
    assert rt.decode_steps == 2


def test_a_step_like_the_one_before_copies_nothing(runtime, monkeypatch):
    """Steady decode (the same batch step after step) does no host work: the mask on the
    device already holds the step's tokens. A new layout is copied again."""
    rt, runner, _, _ = runtime
    rt.route(runner.routed_experts, torch.zeros((1, K), dtype=torch.int32))
    copies = []
    real_copy = rt._staging.copy
    monkeypatch.setattr(rt._staging, "copy", lambda d, s: (copies.append(1), real_copy(d, s)))
    for _ in range(5):
        rt.prepare_step(np.array([0, 1, 2]), np.array([False, False]))
    assert len(copies) == 1 and rt.decode_steps == 5
    assert rt.mask[:4].tolist() == [1, 1, 0, 0]
    rt.prepare_step(np.array([0, 3, 4]), np.array([True, False]))  # a prefill joins
    assert len(copies) == 2 and rt.mask[:5].tolist() == [0, 0, 0, 1, 0]
    for _ in range(3):  # prefill-only: copied once, and no decode steps
        rt.prepare_step(np.array([0, 2]), np.array([True]))
    assert len(copies) == 3 and rt.decode_steps == 6 and not rt.mask.any()
    rt.prepare_step(None, None)  # a dummy run in between: the next step is copied again
    rt.prepare_step(np.array([0, 1, 2]), np.array([False, False]))
    assert rt.mask[:4].tolist() == [1, 1, 0, 0] and rt.decode_steps == 7


def test_a_decision_every_interval_decode_steps_over_every_tensor(runtime):
    rt, runner, _, calls = runtime
    module = runner.routed_experts
    rt.route(module, torch.zeros((1, K), dtype=torch.int32))
    for _ in range(5):  # prefill-only steps do not advance the schedule
        rt.prepare_step(np.array([0, 4]), np.array([True]))
    for _ in range(16):
        rt.prepare_step(np.array([0, 1]), np.array([False]))
    assert len(calls["step"]) == 2 and rt.decisions == 2 and rt.decode_steps == 16
    tables = calls["step"][0]
    expected = [module.w13_weight.data, module.w2_weight.data]  # the gate never moves
    ptrs = tables.base[0].tolist()
    assert sorted(ptrs) == sorted(t.data_ptr() for t in expected)
    assert calls["step"][1] is tables  # built once


def test_the_layer_forward_routes_through_the_runtime(runtime, monkeypatch):
    """With the swap on, the forward takes its rows from the runtime's kernel (which maps
    and counts in one launch), not from the merge's fixed map."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    rt, runner, _, calls = runtime
    module = runner.routed_experts
    module.__dict__["swap"] = rt
    seen = []
    monkeypatch.setattr(
        RoutedExperts, "forward_modular", lambda self, x, w, ids, *a, **k: seen.append(ids) or x
    )
    picks = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    module.forward_modular(torch.zeros(1, 64), torch.full((1, K), 0.25), picks)
    assert torch.equal(seen[0], picks + 100) and len(calls["count"]) == 1


@pytest.mark.parametrize(
    "env", [{"VLLM_EXPERT_SWAP_INTERVAL": "0"}, {"VLLM_EXPERT_SWAP_HALF_LIFE": "-1"}]
)
def test_bad_swap_settings_are_refused(monkeypatch, env):
    from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime
    from vllm.model_executor.layers.fused_moe.expert_offload.config import (
        ExpertOffloadError,
    )

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ExpertOffloadError, match="VLLM_EXPERT_SWAP_INTERVAL >= 1"):
        swap_runtime.SwapSettings.from_env()
    assert swap_runtime.SwapSettings(8, 512.0, 2.0).decay == pytest.approx(0.5 ** (8 / 512))


def test_the_self_check_follows_rows_and_catches_a_row_that_did_not_move(runtime, caplog):
    rt, runner, table, _ = runtime
    module = runner.routed_experts
    rt.route(module, torch.zeros((1, K), dtype=torch.int32))
    assert rt.self_check()  # the reference fingerprints, before any swap
    g = table.gpu_rows
    tensors = [module.w13_weight.data, module.w2_weight.data]

    def exchange(a, b, data=True, ids=True, routes=True):  # what the swap kernels do
        if data:
            for t in tensors:
                t[[a, b]] = t[[b, a]].clone()
        r2e, e2r = rt.state.row_to_expert[0], rt.state.expert_to_row[0]
        if routes:
            e2r[r2e[[a, b]].long()] = e2r[r2e[[b, a]].long()].clone()
        if ids:
            r2e[[a, b]] = r2e[[b, a]].clone()

    for a, b in [(0, g), (3, g + 1), (0, g + 2), (g, g + 3)]:
        exchange(a, b)
    with caplog.at_level("INFO"):
        assert rt.self_check()
    assert "self-check passed" in caplog.text

    exchange(1, g + 1, ids=False)  # rows moved, bookkeeping did not
    with caplog.at_level("ERROR"):
        assert not rt.self_check()
    assert "self-check FAILED" in caplog.text and f"[1, {g + 1}]" in caplog.text
    exchange(1, g + 1, ids=False)
    assert rt.self_check()
    exchange(2, g + 2, routes=False)  # rows and row_to_expert moved, the routing did not
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert not rt.self_check()
    assert "expert_to_row sends elsewhere" in caplog.text and f"[2, {g + 2}]" in caplog.text
