# SPDX-License-Identifier: Apache-2.0
"""Checks of the runtime-swap kernels (the series' expert_offload/swap.py) shared by the CPU
tests (tests/cpu/test_swap_kernels.py, Triton interpreter) and the GPU tests
(tests/gpu/test_swap_kernels_gpu.py); each binds its module with `bind`.

The reference is ``eotools.swap_policy.SwapState`` driven in table rows: the
reference keeps an expert's count where the expert is and flips ``on_host``; the
kernels move the expert (and its count) to the other row, so after every reference
decision ``RowReference`` exchanges the two rows' counts and flags back. Its counts
are float32, like the kernels', so ties and the margin compare the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from eotools.swap_policy import SwapPolicy, SwapState

# The swap module under test: the series' module (GPU tests) or a copy whose kernels run in
# Triton's interpreter (CPU tests). Each test module binds its own before every test.
sk: ModuleType


def bind(module: ModuleType) -> None:
    global sk
    sk = module


class RowReference:
    """The reference policy with host rows kept at ``>= gpu_rows[l]``."""

    def __init__(
        self, gpu_rows: Sequence[int], num_experts: int, row_to_expert: np.ndarray
    ) -> None:
        self.gpu_rows = np.asarray(gpu_rows)
        layers = len(gpu_rows)
        host = {layer: range(g, num_experts) for layer, g in enumerate(gpu_rows)}
        self.state = SwapState(layers, num_experts, host)
        self.state.counts = self.state.counts.astype(np.float32)
        self.row_to_expert = np.array(row_to_expert, dtype=np.int64)
        self.host_reads = np.zeros(layers, dtype=np.int64)
        self.swaps = np.zeros(layers, dtype=np.int64)

    @property
    def counts(self) -> np.ndarray:
        return self.state.counts

    def expert_to_row(self) -> np.ndarray:
        return np.argsort(self.row_to_expert, axis=1)

    def observe(self, rows: np.ndarray) -> None:
        """One decode step: rows [L, T, k] picked by the router (T tokens)."""
        layers = np.arange(rows.shape[0])[:, None]
        for t in range(rows.shape[1]):
            picks = rows[:, t, :]
            self.host_reads += self.state.on_host[layers, picks].sum(axis=1)
            self.state.observe(picks)

    def decide(self, policy: SwapPolicy) -> np.ndarray:
        """Decision [L, 2] as the kernel writes it, with the rows exchanged."""
        decision = np.full((len(self.gpu_rows), 2), -1, dtype=np.int64)
        for layer, to_gpu, to_host in self.state.decide(policy):
            # to_gpu is the host row that wins, to_host the GPU row that loses.
            decision[layer] = (to_host, to_gpu)
            pair = [to_gpu, to_host]
            self.state.counts[layer, pair] = self.state.counts[layer, pair[::-1]]
            self.state.on_host[layer, to_gpu] = True
            self.state.on_host[layer, to_host] = False
            self.row_to_expert[layer, pair] = self.row_to_expert[layer, pair[::-1]]
            self.swaps[layer] += 1
        return decision


def random_permutations(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    return np.stack([rng.permutation(n) for _ in range(layers)])


class PickSource:
    """Router picks with per-layer popularity that drifts, so swaps keep coming."""

    def __init__(self, rng: np.random.Generator, layers: int, experts: int, top_k: int) -> None:
        self.rng = rng
        self.top_k = top_k
        self.logits = rng.normal(scale=2.0, size=(layers, experts))

    def drift(self, fraction: float = 0.1) -> None:
        redraw = self.rng.random(self.logits.shape) < fraction
        fresh = self.rng.normal(scale=2.0, size=self.logits.shape)
        self.logits = np.where(redraw, fresh, self.logits)

    def experts(self, tokens: int) -> np.ndarray:
        """Distinct experts per token, [L, T, k] (Gumbel top-k)."""
        layers, experts = self.logits.shape
        noise = self.rng.gumbel(size=(layers, tokens, experts))
        scores = self.logits[:, None, :] + noise
        return np.argsort(-scores, axis=2, kind="stable")[..., : self.top_k]


def rows_of(experts: np.ndarray, expert_to_row: np.ndarray) -> np.ndarray:
    layers = np.arange(experts.shape[0])[:, None, None]
    return expert_to_row[layers, experts]


def as_ids(rows: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows)).to(device, torch.int32)


def check_state(state: sk.SwapCounters, ref: RowReference, where: str) -> None:
    """Counters equal the reference's, counts bit for bit, and the routing map is the
    inverse of ``row_to_expert``."""
    counts = state.counts.cpu().numpy()
    if not np.array_equal(counts, ref.counts):
        bad = np.argwhere(counts != ref.counts)[:5].tolist()
        raise AssertionError(
            f"{where}: counts differ at (layer, row) {bad}: "
            f"{[(counts[i, j], ref.counts[i, j]) for i, j in bad]}"
        )
    r2e = state.row_to_expert.cpu().numpy()
    assert np.array_equal(r2e, ref.row_to_expert), f"{where}: row_to_expert"
    e2r = state.expert_to_row.cpu().numpy()
    assert np.array_equal(e2r, ref.expert_to_row()), f"{where}: expert_to_row"
    assert state.swaps.cpu().tolist() == ref.swaps.tolist(), f"{where}: swaps"
    hr = state.host_reads.cpu().tolist()
    assert hr == ref.host_reads.tolist(), f"{where}: host_reads"


def check_policy_match(
    device: str,
    num_experts: int,
    gpu_rows: Sequence[int],
    policy: SwapPolicy,
    rounds: int,
    top_k: int = 4,
    seed: int = 0,
) -> np.ndarray:
    """Run ``rounds`` decisions of random decode steps through the kernels and the
    reference; every routed row, decision, count, map entry and counter must agree.
    Returns the swaps per layer."""
    rng = np.random.default_rng(seed)
    layers = len(gpu_rows)
    r2e = random_permutations(rng, layers, num_experts)
    state = sk.SwapCounters.create(gpu_rows, num_experts, device, r2e)
    ref = RowReference(gpu_rows, num_experts, r2e)
    source = PickSource(rng, layers, num_experts, top_k)
    for rnd in range(rounds):
        if rnd % 16 == 0:
            source.drift()
        # One route_picks per layer for the whole round: every add is +1.0, so
        # counting the steps together gives the same float32 counts.
        steps = [source.experts(int(rng.integers(1, 4))) for _ in range(policy.interval)]
        for experts in steps:
            ref.observe(rows_of(experts, ref.expert_to_row()))
        picked = np.concatenate(steps, axis=1)
        want_rows = rows_of(picked, ref.expert_to_row())
        for layer in range(layers):
            rows = sk.route_picks(state, layer, as_ids(picked[layer], device))
            got = rows.cpu().numpy()
            assert np.array_equal(got, want_rows[layer]), f"round {rnd}: rows of {layer}"
        sk.decide(state, policy.decay, policy.margin)
        want = ref.decide(policy)
        got = state.decision.cpu().numpy()
        assert np.array_equal(got, want), f"round {rnd}: decision {got} != {want}"
        check_state(state, ref, f"round {rnd}")
    return ref.swaps


@dataclass
class LayerTensors:
    """One layer's swappable tensors; ``backing`` holds views' whole storage. The
    router ``gate`` stays in expert order: the swap never moves it."""

    tensors: list[torch.Tensor]
    backing: list[torch.Tensor]
    gate: torch.Tensor


def _random_tensor(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen)
    return raw.to(torch.uint8).view(dtype).reshape(*shape)


def make_layer(
    gen: torch.Generator,
    experts: int,
    hidden: int,
    device: str,
    variety: bool,
) -> LayerTensors:
    """Weights and scales of one layer, random bytes, and its router gate. ``variety``
    adds rows that are not a multiple of 4 bytes, strided rows, a 1-D tensor and a
    long row."""
    gate = torch.randn(experts, hidden, generator=gen, dtype=torch.float64)
    gate = gate.to(torch.float32).to(device)
    weights = _random_tensor(gen, (experts, 3, 8), torch.int32).to(device)
    scales = _random_tensor(gen, (experts, 4), torch.bfloat16).to(device)
    tensors = [weights, scales]
    backing = [weights, scales]
    if variety:
        odd = _random_tensor(gen, (experts, 7), torch.uint8).to(device)  # bytes
        bf16 = _random_tensor(gen, (experts, 5), torch.bfloat16).to(device)  # 10 B
        bias = torch.randn(experts, generator=gen).to(device)  # 1-D, 4 B rows
        long = _random_tensor(gen, (experts, 2600), torch.int32).to(device)
        wide = _random_tensor(gen, (experts, 12), torch.uint8).to(device)
        head = wide[:, :11]  # pitch 12, 11 B, aligned: 2 words and 3 bytes
        big = _random_tensor(gen, (experts, 9), torch.float32).to(device)
        strided = big[:, 2:7]  # pitch 36, 20 B: words, padding around
        tensors += [odd, bf16, bias, long, head, strided]
        backing += [odd, bf16, bias, long, wide, big]
    return LayerTensors(tensors, backing, gate)


def make_odd_layer(gen: torch.Generator, experts: int, device: str) -> LayerTensors:
    """A layer whose only rows are unaligned: a view starting 1 byte in."""
    wide = _random_tensor(gen, (experts, 12), torch.uint8).to(device)
    gate = torch.randn(experts, 6, generator=gen).to(device)
    return LayerTensors([wide[:, 1:12]], [wide], gate)


def row_bytes(t: torch.Tensor) -> list[bytes]:
    raw = t.detach().cpu().contiguous().view(torch.uint8).reshape(t.shape[0], -1)
    return [raw[r].numpy().tobytes() for r in range(t.shape[0])]


def padding_bytes(layer: LayerTensors) -> list[bytes]:
    """Bytes of the backing storage that no swapped view covers."""
    out = []
    for view, back in zip(layer.tensors, layer.backing, strict=True):
        if view.data_ptr() == back.data_ptr() and view.shape == back.shape:
            continue
        mask = torch.ones(back.shape, dtype=torch.bool)
        start = (view.data_ptr() - back.data_ptr()) // back.element_size()
        cols = view.shape[1]
        mask[:, start : start + cols] = False
        out.append(bytes(back.cpu()[mask].contiguous().view(torch.uint8).numpy()))
    return out


def router_experts(hidden: torch.Tensor, gate: torch.Tensor, k: int) -> np.ndarray:
    """The expert ids the router picks (the gate is in expert order)."""
    logits = hidden.double() @ gate.double().T
    return logits.topk(k, dim=1).indices.cpu().numpy()


class Integrity:
    """Per-row fingerprints at start, checked against ``row_to_expert`` and
    ``expert_to_row`` later."""

    def __init__(self, layers: list[LayerTensors], row_to_expert: np.ndarray, k: int = 4) -> None:
        self.layers = layers
        self.k = k
        self.start_rows = [[row_bytes(t) for t in lt.tensors] for lt in layers]
        self.start_padding = [padding_bytes(lt) for lt in layers]
        self.expert_row0 = np.argsort(row_to_expert, axis=1)
        gen = torch.Generator().manual_seed(7)
        self.hidden = [
            torch.randn(16, lt.gate.shape[1], generator=gen).to(lt.gate.device) for lt in layers
        ]
        self.start_router = [
            router_experts(h, lt.gate, k) for h, lt in zip(self.hidden, layers, strict=True)
        ]

    def check(self, row_to_expert: np.ndarray, expert_to_row: np.ndarray, where: str) -> None:
        for i, lt in enumerate(self.layers):
            perm = np.asarray(row_to_expert[i])
            assert sorted(perm.tolist()) == list(range(len(perm))), where
            routes = np.asarray(expert_to_row[i])
            assert np.array_equal(routes[perm], np.arange(len(perm))), (
                f"{where}: layer {i}: expert_to_row is not the inverse of row_to_expert"
            )
            src = self.expert_row0[i][perm]  # start row of the expert at each row
            picked = router_experts(self.hidden[i], lt.gate, self.k)
            assert np.array_equal(picked, self.start_router[i]), (
                f"{where}: layer {i}: the router picks other experts than before"
            )
            routed_rows = routes[picked].ravel()
            first_rows = self.expert_row0[i][picked].ravel()
            for t, tensor in enumerate(lt.tensors):
                now = row_bytes(tensor)  # one device-to-host copy per tensor and check
                start = self.start_rows[i][t]
                assert sorted(now) == sorted(start), (
                    f"{where}: layer {i} tensor {t} lost or duplicated a row"
                )
                wrong = [r for r in range(len(now)) if now[r] != start[src[r]]]
                assert not wrong, (
                    f"{where}: layer {i} tensor {t} rows {wrong[:5]} do not hold "
                    f"their expert (row_to_expert out of step, or a partial move)"
                )
                # the rows the router's picks are routed to hold those experts' bytes
                routed = [now[r] for r in routed_rows]
                assert routed == [start[r] for r in first_rows], (
                    f"{where}: layer {i} tensor {t}: a pick is routed to another expert's row"
                )
            assert padding_bytes(lt) == self.start_padding[i], (
                f"{where}: layer {i}: bytes between strided rows changed"
            )


def run_swaps(
    device: str,
    layers: list[LayerTensors],
    gpu_rows: Sequence[int],
    min_swaps: int,
    seed: int = 0,
    checks: int = 4,
    max_chunks: int = 2,
) -> int:
    """Drive ``step`` with counts that favour random host rows until ``min_swaps``
    swaps happened; check integrity ``checks`` times on the way, the last at the
    end. Returns the number of swaps."""
    experts = layers[0].tensors[0].shape[0]
    rng = np.random.default_rng(seed)
    r2e = random_permutations(rng, len(layers), experts)
    state = sk.SwapCounters.create(gpu_rows, experts, device, r2e)
    tables = sk.SwapTables.build([lt.tensors for lt in layers], max_chunks=max_chunks)
    integrity = Integrity(layers, r2e)
    g = np.asarray(gpu_rows)
    can_swap = (g > 0) & (g < experts)
    per_round = max(int(can_swap.sum()), 1)
    max_rounds = 2 * -(-min_swaps // per_round) + 10
    check_at = [min_swaps * (i + 1) // checks for i in range(checks)]
    total = rnd = 0
    while check_at:
        rnd += 1
        assert rnd <= max_rounds, f"only {total} swaps in {max_rounds} rounds"
        picks = np.zeros((len(layers), experts), dtype=np.float32)
        for layer, gl in enumerate(g):
            if gl < experts:
                hot = rng.integers(gl, experts, size=3)
                np.add.at(picks[layer], hot, 1.0)
        state.counts += torch.from_numpy(picks).to(device)
        sk.step(state, tables, 0.5, 0.0)
        decision = state.decision.cpu().numpy()
        assert np.all((decision[:, 0] < 0) == (decision[:, 1] < 0))
        swapped = decision[:, 0] >= 0
        assert not np.any(swapped & ~can_swap), f"round {rnd}: impossible swap"
        assert np.all(decision[swapped, 0] < g[swapped])
        assert np.all(decision[swapped, 1] >= g[swapped])
        total += int(swapped.sum())
        if total >= check_at[0]:
            while check_at and total >= check_at[0]:
                check_at.pop(0)
            integrity.check(
                state.row_to_expert.cpu().numpy(),
                state.expert_to_row.cpu().numpy(),
                f"round {rnd}",
            )
    assert state.swaps.sum().item() == total
    assert total >= min_swaps, f"only {total} swaps"
    return total


# Small checks, one per property, run on CPU (interpreter) and CUDA alike.


def decide_on(
    device: str,
    counts: list[list[float]],
    gpu_rows: list[int],
    decay: float,
    margin: float,
    row_to_expert: list[list[int]] | None = None,
) -> sk.SwapCounters:
    state = sk.SwapCounters.create(gpu_rows, len(counts[0]), device, row_to_expert)
    state.counts.copy_(torch.tensor(counts))
    sk.decide(state, decay, margin)
    return state


def check_ties(device: str) -> None:
    """Lowest row wins ties on both sides, as numpy's argmax/argmin."""
    # After decay (0.5), GPU rows 1 and 2 tie for least used and host rows 5 and 6
    # for most used. Rows hold experts in reverse order, so breaking ties by the
    # lowest expert id (not what the kernel does) would pick rows 2 and 6.
    counts = [[6.0, 2.0, 2.0, 4.0, 10.0, 14.0, 14.0, 12.0]]
    r2e = [[7, 6, 5, 4, 3, 2, 1, 0]]
    state = decide_on(device, counts, [4], 0.5, 2.0, r2e)
    assert state.decision.tolist() == [[1, 5]]
    assert state.counts.tolist() == [[3.0, 7.0, 1.0, 2.0, 5.0, 1.0, 7.0, 6.0]]
    assert state.row_to_expert.tolist() == [[7, 2, 5, 4, 3, 6, 1, 0]]
    assert state.expert_to_row.tolist() == [[7, 6, 1, 4, 3, 2, 5, 0]]
    assert state.swaps.tolist() == [1]
    ref = RowReference([4], 8, np.array(r2e))
    ref.state.counts[:] = counts
    policy = SwapPolicy(interval=8, half_life=8.0, margin=2.0)  # decay 0.5
    assert ref.decide(policy).tolist() == [[1, 5]]
    check_state(state, ref, "ties")
    # All equal (zeros): no swap, since 0 - 0 > 0 is false.
    state = decide_on(device, [[0.0] * 8], [3], 0.5, 0.0)
    assert state.decision.tolist() == [[-1, -1]]
    assert state.swaps.tolist() == [0]


def check_margin(device: str) -> None:
    """Swap only when the difference is strictly above the margin."""
    # decay 0.5 is exact: host 10 -> 5, GPU 6 -> 3, difference 2 == margin.
    state = decide_on(device, [[6.0, 8.0, 10.0, 1.0]], [2], 0.5, 2.0)
    assert state.decision.tolist() == [[-1, -1]]
    assert state.counts.tolist() == [[3.0, 4.0, 5.0, 0.5]]
    assert state.swaps.tolist() == [0]
    # One float32 ulp above the margin swaps.
    above = float(np.nextafter(np.float32(10.0), np.float32(11.0)))
    state = decide_on(device, [[6.0, 8.0, above, 1.0]], [2], 0.5, 2.0)
    assert state.decision.tolist() == [[0, 2]]
    assert state.counts[0].tolist() == [above / 2, 4.0, 3.0, 0.5]
    # margin 0: equal counts do not swap, any excess does.
    state = decide_on(device, [[2.0, 2.0], [2.0, 2.5]], [1, 1], 1.0, 0.0)
    assert state.decision.tolist() == [[-1, -1], [0, 1]]
    assert state.swaps.tolist() == [0, 1]


def check_one_sided_layers(device: str) -> None:
    """G = 0 (no GPU rows) and G = E (no host rows) never swap."""
    counts = [[0.0, 0.0, 0.0, 9.0], [9.0, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, 9.0]]
    state = decide_on(device, counts, [0, 4, 3], 1.0, 0.0)
    assert state.decision.tolist() == [[-1, -1], [-1, -1], [0, 3]]
    assert state.swaps.tolist() == [0, 0, 1]
    # A later round without a swap clears the decision (swap_rows then idles).
    sk.decide(state, 1.0, 100.0)
    assert state.decision.tolist() == [[-1, -1]] * 3


def check_route_picks(device: str, dtype: torch.dtype, seed: int = 1) -> None:
    """Rows, counts and host_reads against numpy, with masks, strides and sizes: the
    router's expert ids go to the rows a permuted table holds them in."""
    rng = np.random.default_rng(seed)
    experts, gpu_rows = 20, [0, 7, 20]
    r2e = random_permutations(rng, 3, experts)
    e2r = np.argsort(r2e, axis=1)
    state = sk.SwapCounters.create(gpu_rows, experts, device, r2e)
    counts = np.zeros((3, experts), dtype=np.float32)
    reads = np.zeros(3, dtype=np.int64)
    for i in range(30):
        layer = i % 3
        tokens = int(rng.integers(1, 700))  # > one program's block at times
        ids = rng.integers(0, experts, size=(tokens, 6))
        valid = None
        keep = np.ones(tokens, dtype=bool)
        if i % 4 == 1:
            keep = rng.random(tokens) < 0.5
            valid = torch.from_numpy(keep).to(device)
        elif i % 4 == 2:
            keep = rng.random(tokens) < 0.5
            valid = torch.from_numpy(keep.astype(np.int32)).to(device)
        topk = torch.from_numpy(ids).to(device, dtype)
        if i % 5 == 3:  # a transposed (non-contiguous) view
            topk = torch.from_numpy(np.ascontiguousarray(ids.T)).to(device, dtype).T
        rows = sk.route_picks(state, layer, topk, valid)
        assert rows.dtype == dtype and rows.shape == topk.shape
        # every pick is routed, counted or not
        assert np.array_equal(rows.cpu().numpy(), e2r[layer][ids]), f"call {i}"
        kept = e2r[layer][ids[keep]]
        np.add.at(counts[layer], kept.ravel(), 1.0)
        reads[layer] += int((kept >= gpu_rows[layer]).sum())
    empty = sk.route_picks(state, 1, torch.zeros((0, 6), dtype=dtype, device=device))
    assert empty.shape == (0, 6)
    outside = torch.tensor([[-1, experts], [experts + 5, -7]], device=device)
    rows = sk.route_picks(state, 1, outside.to(dtype))  # passed through, counted nowhere
    assert rows.tolist() == outside.tolist()
    assert np.array_equal(state.counts.cpu().numpy(), counts)
    assert state.host_reads.tolist() == reads.tolist()
    assert reads[0] > 0 and reads[2] == 0


def check_map_to_rows(device: str, map_rows) -> None:
    """One table's id -> row map (swap off): ``map_rows(ids, expert_to_row)`` against
    numpy, both id dtypes, a transposed view, and ids outside the map passed through."""
    rng = np.random.default_rng(2)
    experts = 40
    e2r = rng.permutation(experts)
    table = torch.from_numpy(e2r).to(device, torch.int32)
    for dtype in (torch.int32, torch.int64):
        ids = rng.integers(-3, experts + 3, size=(1500, 8))
        for topk in (
            torch.from_numpy(ids).to(device, dtype),
            torch.from_numpy(np.ascontiguousarray(ids.T)).to(device, dtype).T,
        ):
            rows = map_rows(topk, table)
            assert rows.dtype == dtype and rows.shape == topk.shape
            inside = (ids >= 0) & (ids < experts)
            want = np.where(inside, e2r[np.clip(ids, 0, experts - 1)], ids)
            assert np.array_equal(rows.cpu().numpy(), want)
    assert map_rows(torch.zeros((0, 8), dtype=torch.int32, device=device), table).shape == (0, 8)


def check_count_rounding(device: str) -> None:
    """+1.0 atomics onto decayed counts round as numpy's sequential adds do."""
    state = sk.SwapCounters.create([2], 4, device)
    start = np.float32([0.1, 1.7, 3.3, 1e7])
    state.counts.copy_(torch.from_numpy(start)[None])
    ids = np.array([[3, 3], [3, 0], [2, 3], [0, 1]])
    sk.route_picks(state, 0, torch.from_numpy(ids).to(device))  # identity map
    want = start.copy()
    np.add.at(want, ids.ravel(), np.float32(1.0))
    assert np.array_equal(state.counts[0].cpu().numpy(), want)


def check_exact_pairs(device: str, seed: int = 3) -> None:
    """swap_rows exchanges exactly the decided rows, in every tensor, and nothing in
    layers without a decision; the same decision again undoes it."""
    gen = torch.Generator().manual_seed(seed)
    experts = 24
    layers = [make_layer(gen, experts, 8, device, variety=True) for _ in range(3)]
    layers.append(make_odd_layer(gen, experts, device))
    state = sk.SwapCounters.create([12, 12, 1, 23], experts, device)
    tables = sk.SwapTables.build([lt.tensors for lt in layers], max_chunks=2)
    assert tables.num_slots == 8 and tables.num_chunks == 2
    before = [[row_bytes(t) for t in lt.tensors] for lt in layers]
    padding = [padding_bytes(lt) for lt in layers]
    decisions = [[3, 20], [-1, -1], [0, 23], [22, 23]]
    state.decision.copy_(torch.tensor(decisions, dtype=torch.int32))
    sk.swap_rows(state, tables)
    for i, lt in enumerate(layers):
        g, hr = decisions[i]
        for t, tensor in enumerate(lt.tensors):
            now, old = row_bytes(tensor), before[i][t]
            want = list(old)
            if g >= 0:
                want[g], want[hr] = old[hr], old[g]
            assert now == want, f"layer {i} tensor {t}"
        assert padding_bytes(lt) == padding[i], f"layer {i}: padding changed"
    sk.swap_rows(state, tables)
    assert [[row_bytes(t) for t in lt.tensors] for lt in layers] == before


def check_step_integrity(device: str, min_swaps: int, seed: int = 4) -> int:
    """All tensor kinds, plus layers that cannot swap, through ``step``."""
    gen = torch.Generator().manual_seed(seed)
    experts = 24
    layers = [make_layer(gen, experts, 8, device, variety=True) for _ in range(3)]
    layers.append(make_odd_layer(gen, experts, device))
    layers.append(make_layer(gen, experts, 8, device, variety=False))  # G = 0
    layers.append(make_layer(gen, experts, 8, device, variety=False))  # G = E
    gpu_rows = [1, 12, 23, 6, 0, experts]
    return run_swaps(device, layers, gpu_rows, min_swaps=min_swaps, seed=seed)


def check_many_swaps(device: str, min_swaps: int, layers: int = 16) -> int:
    """The integrity test proper: >= min_swaps swaps, weights and scales per layer,
    and the router's picks routed to their experts' rows."""
    gen = torch.Generator().manual_seed(5)
    experts = 32
    tensors = [make_layer(gen, experts, 8, device, variety=False) for _ in range(layers)]
    gpu_rows = [1 + (i * 5) % (experts - 1) for i in range(layers)]
    return run_swaps(device, tensors, gpu_rows, min_swaps=min_swaps, checks=3)


def check_decide(device, experts, gpu_rows, policy, rounds, top_k=None) -> None:
    """check_policy_match, then: no swaps in one-sided layers, and enough swaps to mean much."""
    kw = {} if top_k is None else {"top_k": top_k}
    swaps = check_policy_match(device, experts, gpu_rows, policy, rounds, **kw)
    for layer, g in enumerate(gpu_rows):
        if g in (0, experts):
            assert swaps[layer] == 0
    assert swaps.sum() >= 20, f"too few swaps to mean much: {swaps}"
