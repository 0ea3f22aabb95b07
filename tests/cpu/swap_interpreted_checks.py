# SPDX-License-Identifier: Apache-2.0
"""The runtime-swap kernels (the series' expert_offload/swap.py) on the CPU, through Triton's
interpreter: every kernel runs on CPU tensors, the pointer-table swap included (raw int64
addresses of CPU tensors are dereferenced as they are on the GPU).

Triton fixes the interpreter mode when it is first imported, so these checks run in a
process of their own, started by tests/cpu/test_swap_kernels.py with TRITON_INTERPRET=1:

    scripts/test tests/cpu/test_swap_kernels.py
"""

from __future__ import annotations

import os

import pytest
import swap_harness as h
import torch
from eotools.swap_policy import SwapPolicy

DEVICE = "cpu"


if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "run through tests/cpu/test_swap_kernels.py (or with TRITON_INTERPRET=1 set before "
        "Python starts): Triton fixes the interpreter mode when it is first imported"
    )
from vllm.model_executor.layers.fused_moe.expert_offload import swap as sk  # noqa: E402

assert type(sk._decide_kernel).__name__ == "InterpretedFunction", "not interpreted"


@pytest.fixture(autouse=True)
def _bind_module() -> None:
    h.bind(sk)


@pytest.mark.parametrize(
    ("experts", "gpu_rows", "policy", "rounds"),
    [
        # G = 0 and G = E never swap; 1 and E - 1 leave one row on a side.
        (48, [0, 48, 1, 47, 24, 12], SwapPolicy(8, 64.0, 2.0), 250),
        (40, [5, 20, 35], SwapPolicy(4, 32.0, 0.0), 250),
        (48, [0, 16, 40], SwapPolicy(), 150),
        # a negative margin (the live stress test): every two-sided layer, every decision
        (40, [0, 5, 20, 40], SwapPolicy(1, 1.0, -1.0), 120),
    ],
)
def test_decide_matches_reference(
    experts: int, gpu_rows: list[int], policy: SwapPolicy, rounds: int
) -> None:
    h.check_decide(DEVICE, experts, gpu_rows, policy, rounds)


def test_ties_pick_the_lowest_row() -> None:
    h.check_ties(DEVICE)


def test_margin_is_strict() -> None:
    h.check_margin(DEVICE)


def test_no_swap_without_rows_on_both_sides() -> None:
    h.check_one_sided_layers(DEVICE)


def test_decide_rejects_bad_parameters() -> None:
    state = sk.SwapCounters.create([1], 2, DEVICE)
    for decay, margin in ((0.0, 1.0), (1.5, 1.0), (-0.5, -1.0)):
        with pytest.raises(ValueError):
            sk.decide(state, decay, margin)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_picks(dtype: torch.dtype) -> None:
    h.check_route_picks(DEVICE, dtype)


def test_one_tables_map_kernel() -> None:
    """offload-03's id -> row kernel (swap off), launched as it is on the GPU."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    def map_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ids = ids.contiguous()
        rows = torch.empty_like(ids)
        n = ids.numel()
        if n:
            grid = (-(-n // one_table._MAP_BLOCK),)
            one_table._map_to_rows_kernel[grid](
                ids, rows, table, n, table.numel(), BLOCK=one_table._MAP_BLOCK
            )
        return rows

    h.check_map_to_rows(DEVICE, map_rows)
    h.check_map_to_rows(DEVICE, one_table.map_to_rows)  # its torch path on the CPU


def test_route_picks_on_fractional_counts_is_exact() -> None:
    h.check_count_rounding(DEVICE)


def test_swap_rows_moves_exactly_the_decided_rows() -> None:
    h.check_exact_pairs(DEVICE)


def test_swap_rows_through_step_keeps_integrity() -> None:
    assert h.check_step_integrity(DEVICE, min_swaps=240) >= 240


@pytest.mark.slow
def test_integrity_over_2000_swaps() -> None:
    # ~12 ms per swap in the interpreter; the GPU test runs 20,000
    assert h.check_many_swaps(DEVICE, min_swaps=2_000) >= 2_000


def test_tables_reject_bad_layouts() -> None:
    a = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="rows"):
        sk.SwapTables.build([[a, torch.zeros(5, 3)]])
    with pytest.raises(ValueError, match="contiguous"):
        sk.SwapTables.build([[torch.zeros(3, 4).T]])
    with pytest.raises(ValueError, match="overlap"):
        sk.SwapTables.build([[torch.zeros(3).expand(4, 3)]])
    with pytest.raises(ValueError):
        sk.SwapTables.build([])
    state = sk.SwapCounters.create([1, 1], 4, DEVICE)
    with pytest.raises(ValueError, match="layers"):
        sk.swap_rows(state, sk.SwapTables.build([[a]]))
    with pytest.raises(ValueError, match="rows per layer"):
        sk.swap_rows(state, sk.SwapTables.build([[a], [torch.zeros(5)]]))


def test_counters_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="gpu_rows"):
        sk.SwapCounters.create([5], 4, DEVICE)
    with pytest.raises(ValueError, match="permutation"):
        sk.SwapCounters.create([1], 3, DEVICE, [[0, 0, 1]])
    state = sk.SwapCounters.create([1, 2], 3, DEVICE, [[2, 0, 1], [0, 1, 2]])
    assert state.row_to_expert.dtype == torch.int32
    assert state.decision.tolist() == [[-1, -1], [-1, -1]]
