# SPDX-License-Identifier: Apache-2.0
"""GPU tests of the runtime-swap kernels: the CPU checks with compiled kernels on
CUDA, the kernels inside CUDA graphs, host-memory rows of a VMM table; and, marked
`measurement` (run with --measurements), their timings.

Needs compiled kernels (TRITON_INTERPRET unset; tests/cpu/test_swap_kernels.py sets it
only in a process of its own):

    scripts/test-gpu tests/gpu/test_swap_kernels_gpu.py
    scripts/test-gpu tests/gpu/test_swap_kernels_gpu.py -k timing --measurements -s

``-s`` shows the timing lines. The measurements assert only that the timed kernels did
their work (no decision where none is due, the decided rows exchanged, others untouched).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import pytest
import swap_harness as h
import torch
from eotools.swap_policy import SwapPolicy
from vllm.model_executor.layers.fused_moe.expert_offload import swap as sk
from vllm.model_executor.layers.fused_moe.expert_offload import vmm

if os.environ.get("TRITON_INTERPRET") == "1" and torch.cuda.is_available():
    raise RuntimeError("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels (unset it)")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _bind_module() -> None:
    h.bind(sk)


@pytest.mark.parametrize(
    ("experts", "gpu_rows", "policy", "rounds"),
    [
        (48, [0, 48, 1, 47, 24, 12], SwapPolicy(8, 64.0, 2.0), 1500),
        (40, [5, 20, 35], SwapPolicy(4, 32.0, 0.0), 1500),
        (512, [0, 512, 384, 448, 100], SwapPolicy(), 600),  # BLOCK = E, 16 warps
        (300, [150, 299], SwapPolicy(8, 128.0, 1.0), 600),
    ],
)
def test_decide_matches_reference(
    experts: int, gpu_rows: list[int], policy: SwapPolicy, rounds: int
) -> None:
    h.check_decide(DEVICE, experts, gpu_rows, policy, rounds, top_k=8)


def test_ties_pick_the_lowest_row() -> None:
    h.check_ties(DEVICE)


def test_margin_is_strict() -> None:
    h.check_margin(DEVICE)


def test_no_swap_without_rows_on_both_sides() -> None:
    h.check_one_sided_layers(DEVICE)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_picks(dtype: torch.dtype) -> None:
    h.check_route_picks(DEVICE, dtype)


def test_one_tables_map_kernel() -> None:
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    h.check_map_to_rows(DEVICE, one_table.map_to_rows)


def test_route_picks_on_fractional_counts_is_exact() -> None:
    h.check_count_rounding(DEVICE)


def test_swap_rows_moves_exactly_the_decided_rows() -> None:
    h.check_exact_pairs(DEVICE)


def test_swap_rows_through_step_keeps_integrity() -> None:
    assert h.check_step_integrity(DEVICE, min_swaps=3000) >= 3000


def test_integrity_over_10000_swaps() -> None:
    assert h.check_many_swaps(DEVICE, min_swaps=20_000) >= 20_000


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm up (compiles the kernels) on a side stream, then capture ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def test_route_picks_in_cuda_graph() -> None:
    rng = np.random.default_rng(11)
    layers, experts, tokens, top_k = 4, 64, 8, 8
    gpu_rows = [0, 20, 40, 64]
    r2e = h.random_permutations(rng, layers, experts)
    e2r = np.argsort(r2e, axis=1)
    state = sk.SwapCounters.create(gpu_rows, experts, DEVICE, r2e)
    ids = [
        torch.from_numpy(rng.integers(0, experts, (tokens, top_k))).to(DEVICE)
        for _ in range(layers)
    ]
    ids = [i.to(torch.int32) for i in ids]
    valid = torch.from_numpy(rng.random(tokens) < 0.7).to(DEVICE)
    routed: list[torch.Tensor] = []

    def count() -> None:
        routed.clear()
        for layer in range(layers):
            valid_or_none = valid if layer % 2 else None
            routed.append(sk.route_picks(state, layer, ids[layer], valid_or_none))

    graph = _capture(count)
    state.counts.zero_()
    state.host_reads.zero_()
    replays = 50
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    keep = valid.cpu().numpy()
    for layer in range(layers):
        picks = e2r[layer][ids[layer].cpu().numpy()]
        assert np.array_equal(routed[layer].cpu().numpy(), picks), layer
        if layer % 2:
            picks = picks[keep]
        want = np.bincount(picks.ravel(), minlength=experts) * replays
        assert np.array_equal(state.counts[layer].cpu().numpy(), want), layer
        reads = int((picks >= gpu_rows[layer]).sum()) * replays
        assert state.host_reads[layer].item() == reads, layer


def test_count_decide_and_swap_in_cuda_graphs() -> None:
    """Counting (from a static id buffer) and step, each in a CUDA graph, replayed
    round by round against the reference; integrity checked on the way."""
    rng = np.random.default_rng(12)
    gen = torch.Generator().manual_seed(12)
    experts, top_k, policy = 24, 4, SwapPolicy(8, 32.0, 0.5)
    layers = [h.make_layer(gen, experts, 8, DEVICE, variety=True) for _ in range(3)]
    layers.append(h.make_odd_layer(gen, experts, DEVICE))
    gpu_rows = [12, 1, 23, 6]
    r2e = h.random_permutations(rng, len(layers), experts)
    state = sk.SwapCounters.create(gpu_rows, experts, DEVICE, r2e)
    tables = sk.SwapTables.build([lt.tensors for lt in layers], max_chunks=2)
    integrity = h.Integrity(layers, r2e)
    ref = h.RowReference(gpu_rows, experts, r2e)
    source = h.PickSource(rng, len(layers), experts, top_k)
    tokens = 2 * policy.interval  # 2 tokens per decode step
    ids = torch.zeros(len(layers), tokens, top_k, dtype=torch.int32, device=DEVICE)
    routed: list[torch.Tensor] = []

    def count() -> None:
        routed.clear()
        for layer in range(len(layers)):
            routed.append(sk.route_picks(state, layer, ids[layer]))

    def swap() -> None:
        sk.step(state, tables, policy.decay, policy.margin)

    # Warm-up runs on zero counts: no decision, nothing moves.
    count_graph = _capture(count)
    state.counts.zero_()
    state.host_reads.zero_()
    step_graph = _capture(swap)
    assert state.swaps.sum().item() == 0
    total = 0
    for rnd in range(400):
        if rnd % 16 == 0:
            source.drift()
        experts_picked = source.experts(tokens)
        rows = h.rows_of(experts_picked, ref.expert_to_row())
        for s in range(policy.interval):
            ref.observe(rows[:, 2 * s : 2 * s + 2])
        ids.copy_(h.as_ids(experts_picked, DEVICE))
        count_graph.replay()
        got_rows = torch.stack(routed).cpu().numpy()
        assert np.array_equal(got_rows, rows), f"round {rnd}: routed rows"
        step_graph.replay()
        want = ref.decide(policy)
        got = state.decision.cpu().numpy()
        assert np.array_equal(got, want), f"round {rnd}: {got} != {want}"
        h.check_state(state, ref, f"round {rnd}")
        total += int((want[:, 0] >= 0).sum())
        if rnd % 100 == 99:
            integrity.check(
                state.row_to_expert.cpu().numpy(),
                state.expert_to_row.cpu().numpy(),
                f"round {rnd}",
            )
    assert total >= 50, f"too few swaps: {total}"


def _need_host_mapping() -> None:
    """Skip where this host's driver refuses host-NUMA mappings (the probe says why;
    test_vmm_gpu.py::test_probe_ok fails for it); any other VMM error fails the test."""
    reason = vmm.probe_host_mapping(0)
    if reason is not None:
        pytest.skip(f"this host refuses host-NUMA VMM mappings: {reason}")


def test_swap_across_the_vram_host_boundary_of_a_vmm_table() -> None:
    """Rows in host-NUMA memory of a VMM table move with SM loads and stores."""
    _need_host_mapping()
    experts, row_bytes = 32, 256 << 10
    with vmm.SplitTable(experts, row_bytes, gpu_bytes=4 << 20, device=0) as table:
        assert 0 < table.gpu_rows < experts, table
        weights = table.row_view(torch.int32, (row_bytes // 4,))
        gen = torch.Generator().manual_seed(13)
        data = torch.randint(-(2**31), 2**31 - 1, weights.shape, generator=gen)
        weights.copy_(data.to(torch.int32))
        gate = torch.randn(experts, 16, generator=gen).to(DEVICE)
        layer = h.LayerTensors([weights], [weights], gate)
        total = h.run_swaps(DEVICE, [layer], [table.gpu_rows], min_swaps=200)
        assert total >= 200
        del weights, layer
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], None], iters: int) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` calls, after one untimed call."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as uint8 [rows, bytes of a row] (a view: writes go through)."""
    assert t.is_contiguous(), "the measured tables are contiguous"
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def check_one_swap_launch(state: sk.SwapCounters, tables: sk.SwapTables, seed: int) -> None:
    """One more ``swap_rows`` launch, with random bytes first written into the rows it
    concerns: in every layer with a decision the two decided rows trade their bytes in
    every tensor and a third row keeps them; a layer without one keeps its first and last
    rows. What the timings measured is then a swap that moves the right bytes."""
    dev = tables.base.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    watched = []  # (layer, rows, order of the old rows expected in them afterwards)
    for layer, (gpu_row, host_row) in enumerate(state.decision.cpu().tolist()):
        n = tables.num_rows[layer]
        if gpu_row >= 0:
            other = next(r for r in range(n) if r not in (gpu_row, host_row))
            watched.append((layer, [gpu_row, host_row, other], [1, 0, 2]))
        else:
            watched.append((layer, [0, n - 1], [0, 1]))
    before = {}
    for layer, rows, _ in watched:
        for slot, t in enumerate(tables.tensors[layer]):
            b = _row_bytes(t)
            fill = (len(rows), b.shape[1])
            b[rows] = torch.randint(0, 256, fill, dtype=torch.uint8, device=dev, generator=gen)
            before[layer, slot] = b[rows].clone()
    sk.swap_rows(state, tables)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    for layer, rows, order in watched:
        for slot, t in enumerate(tables.tensors[layer]):
            got = _row_bytes(t)[rows]
            want = before[layer, slot][order]
            assert torch.equal(got, want), f"layer {layer} tensor {slot} rows {rows}"


@pytest.mark.measurement
def test_measure_kernel_timings() -> None:
    """Timings at L=48, E=512: decide alone, route_picks of 48 layers, swap_rows idle and
    with every layer swapping. Asserted: the timed calls did their work."""
    layers, experts = 48, 512
    gpu_rows = [384] * layers
    state = sk.SwapCounters.create(gpu_rows, experts, DEVICE)
    state.counts.copy_(torch.rand(layers, experts, device=DEVICE) * 10)
    decay = SwapPolicy().decay

    def decide() -> None:
        sk.decide(state, decay, 1e9)  # the margin keeps every round a no-swap

    eager = _time_ms(decide, 1000)
    per_graph = 100
    graph = _capture(lambda: [decide() for _ in range(per_graph)])
    in_graph = _time_ms(graph.replay, 20) / per_graph
    print(
        f"\ndecide L={layers} E={experts}: {eager * 1e3:.1f} us/call eager "
        f"(launch included), {in_graph * 1e3:.1f} us/call in a CUDA graph"
    )
    assert (state.decision == -1).all() and state.swaps.sum().item() == 0

    ids = torch.randint(0, experts, (layers, 1, 8), dtype=torch.int32, device=DEVICE)
    graph = _capture(lambda: [sk.route_picks(state, i, ids[i]) for i in range(layers)])
    replays = 100
    count = _time_ms(graph.replay, replays)
    print(f"route_picks x{layers} layers (1 token, k=8) in a graph: {count * 1e3:.1f} us")
    # ran once before capture and 1 + `replays` times as a graph; no swap: rows are ids
    runs = 1 + 1 + replays
    want = (ids.reshape(layers, -1) >= gpu_rows[0]).sum(1).cpu() * runs
    assert torch.equal(state.host_reads.cpu(), want)

    # Idle swap (no decision) over 48 layers of 256 KiB rows: 64 chunks, as for
    # real expert rows (~1 MiB); fewer layers where memory is short.
    shapes = [((experts, 65536), torch.int32), ((experts, 128), torch.bfloat16)]
    shapes += [((experts, 2048), torch.bfloat16), ((experts,), torch.float32)]
    free, _ = torch.cuda.mem_get_info()
    layer_bytes = sum(math.prod(s) * d.itemsize for s, d in shapes)
    layers = max(1, min(layers, int(free * 0.5) // layer_bytes))
    state = sk.SwapCounters.create([384] * layers, experts, DEVICE)
    per_layer = [[torch.empty(s, dtype=d, device=DEVICE) for s, d in shapes] for _ in range(layers)]
    tables = sk.SwapTables.build(per_layer)
    state.decision.fill_(-1)
    idle = _time_ms(lambda: sk.swap_rows(state, tables), 200)
    graph = _capture(lambda: [sk.swap_rows(state, tables) for _ in range(20)])
    idle_graph = _time_ms(graph.replay, 20) / 20
    print(
        f"swap_rows idle, grid {tables.num_layers}x{tables.num_slots}x"
        f"{tables.num_chunks}: {idle * 1e3:.1f} us eager, {idle_graph * 1e3:.1f} us "
        "in a graph"
    )
    check_one_swap_launch(state, tables, seed=21)  # idle: nothing moves
    # All layers swapping 256 KiB + small rows in VRAM (the host case is PCIe bound).
    state.decision[:, 0] = 0
    state.decision[:, 1] = 400
    busy = _time_ms(lambda: sk.swap_rows(state, tables), 50)
    moved = 2 * 2 * sum(t[0].numel() * t.element_size() for t in per_layer[0])
    print(
        f"swap_rows all {layers} layers swapping (VRAM rows): "
        f"{busy * 1e3:.1f} us, {moved * layers / busy / 1e6:.1f} GB/s"
    )
    check_one_swap_launch(state, tables, seed=22)


@pytest.mark.measurement
def test_measure_timing_of_a_swap_across_pcie() -> None:
    """One swap of a target-model expert (the INT4 row's four tensors: w13, w2 and their
    scales) between a VRAM row and a host row of VMM tables, against the copy engine
    moving the same bytes both ways. A swap round reads the host row and writes it back
    over PCIe; this is what each swap adds to a decode step. Asserted: the timed swap
    exchanges the two rows' bytes in all four tables."""
    _need_host_mapping()
    from eodev.host_read import EXPERT_BYTES, EXPERT_PARTS

    # enough rows that even the smallest tensor's table has rows past its first 2 MiB
    experts = 128
    parts = EXPERT_PARTS  # w13, w2, w13 scales, w2 scales
    assert sum(parts) == EXPERT_BYTES
    gran = vmm.granularity(0)
    tables: list[vmm.SplitTable] = []
    try:
        for part in parts:
            gpu = -(-(experts // 2) * part // gran) * gran  # half the rows, rounded up
            tables.append(vmm.SplitTable(experts, part, gpu_bytes=gpu, device=0))
        views = [t.row_view(torch.uint8, (part,)) for t, part in zip(tables, parts, strict=True)]
        host_row = experts - 1
        assert all(0 < t.gpu_rows <= host_row for t in tables), tables
        state = sk.SwapCounters.create([min(t.gpu_rows for t in tables)], experts, DEVICE)
        swap_tables = sk.SwapTables.build([views])
        state.decision[0, 0] = 0
        state.decision[0, 1] = host_row
        per_swap = _time_ms(lambda: sk.swap_rows(state, swap_tables), 50)
        graph = _capture(lambda: [sk.swap_rows(state, swap_tables) for _ in range(10)])
        in_graph = _time_ms(graph.replay, 10) / 10
        staging = torch.empty(EXPERT_BYTES, dtype=torch.uint8, device=DEVICE)
        pinned = torch.empty(EXPERT_BYTES, dtype=torch.uint8).pin_memory()

        def copy_both_ways() -> None:
            staging.copy_(pinned, non_blocking=True)
            pinned.copy_(staging, non_blocking=True)

        copies = _time_ms(copy_both_ways, 50)
        print(
            f"\nswap_rows, one {EXPERT_BYTES} B expert VRAM<->host in {len(parts)} tables, "
            f"grid 1x{swap_tables.num_slots}x{swap_tables.num_chunks}: "
            f"{per_swap * 1e3:.1f} us eager, {in_graph * 1e3:.1f} us in a graph "
            f"({2 * EXPERT_BYTES / in_graph / 1e6:.1f} GB/s both ways); the copy engine "
            f"moves the same bytes both ways in {copies * 1e3:.1f} us"
        )
        check_one_swap_launch(state, swap_tables, seed=23)
        del views
        torch.cuda.synchronize()
    finally:
        for t in tables:
            t.close()
