# SPDX-License-Identifier: Apache-2.0
"""The runtime-swap policy (offload-03; docs/design.md), as a reference implementation.

Every decode step adds 1 to the count of each (layer, expert) the router picked. Every
`interval` steps the counts decay by 0.5 ** (interval / half_life); then, per layer, the most
used expert held on the host and the least used expert held on the GPU trade places when the
first's count exceeds the second's by more than `margin`. At most one swap per layer per
decision. This module is what the decide kernel implements; simulate-swap replays recorded
picks through it. Two settings exist here only, for what-if runs of the simulation:
`max_swaps` (pairs traded per layer per decision, the next most used host expert with the
next least used GPU expert while the margin holds) and prompt picks counted as decode picks
are (`simulate_steps(prompts=...)`); the runtime moves one pair and counts decode only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SwapPolicy:
    interval: int = 8  # decode steps between decisions
    half_life: float = 512.0  # decode steps for a count to halve
    # swap when host count - GPU count exceeds this; negative: also on equal counts, so every
    # layer swaps at every decision (the stress test of a live server)
    margin: float = 2.0
    max_swaps: int = 1  # per layer per decision (the runtime's decide kernel: 1)

    def __post_init__(self) -> None:
        if self.interval < 1 or self.half_life <= 0 or self.max_swaps < 1:
            raise ValueError(
                f"invalid swap policy {self}: interval >= 1, half_life > 0, max_swaps >= 1"
            )

    @property
    def decay(self) -> float:
        return 0.5 ** (self.interval / self.half_life)


class SwapState:
    """Which experts each layer keeps on the host, and the decayed pick counts."""

    def __init__(self, num_layers: int, num_experts: int, host: dict[int, Iterable[int]]) -> None:
        self.on_host = np.zeros((num_layers, num_experts), dtype=bool)
        for layer, ids in host.items():
            self.on_host[layer, list(ids)] = True
        self.counts = np.zeros((num_layers, num_experts), dtype=np.float64)
        self.steps = 0

    def host_reads(self, picks: np.ndarray) -> int:
        """Host experts one decode step reads: its picks, (layers, top_k) of one token or
        (tokens, layers, top_k) of a batch, each (layer, expert) once however many tokens
        picked it, as the kernel reads an expert once per batch."""
        picked = np.zeros_like(self.on_host)
        picked[self._rows(picks), picks] = True
        return int((picked & self.on_host).sum())

    def count(self, picks: np.ndarray) -> None:
        """Add every pick, (..., layers, top_k), to the counts."""
        np.add.at(self.counts, (self._rows(picks), picks), 1.0)

    def observe(self, picks: np.ndarray) -> None:
        """One decode step: its picks counted."""
        self.count(picks)
        self.steps += 1

    def _rows(self, picks: np.ndarray) -> np.ndarray:
        """Each pick's layer, broadcast against picks (..., layers, top_k)."""
        return np.arange(picks.shape[-2])[:, None]

    def decide(self, policy: SwapPolicy) -> list[tuple[int, int, int]]:
        """Decay, then per layer at most `max_swaps` swaps (ties to the lowest expert id).
        Returns (layer, to_gpu, to_host)."""
        self.counts *= policy.decay
        swaps = []
        host_counts = np.where(self.on_host, self.counts, -np.inf)
        gpu_counts = np.where(self.on_host, np.inf, self.counts)
        k = policy.max_swaps
        best_host = np.argsort(-host_counts, axis=1, kind="stable")[:, :k]
        worst_gpu = np.argsort(gpu_counts, axis=1, kind="stable")[:, :k]
        for layer in range(self.on_host.shape[0]):
            for h, g in zip(best_host[layer], worst_gpu[layer], strict=True):
                hc, gc = host_counts[layer, h], gpu_counts[layer, g]
                if not (np.isfinite(hc) and np.isfinite(gc)):
                    break  # no (more) host experts, or no GPU experts
                if hc - gc <= policy.margin:
                    break
                self.on_host[layer, h], self.on_host[layer, g] = False, True
                swaps.append((layer, int(h), int(g)))
        return swaps


@dataclass(frozen=True)
class SimulationResult:
    tokens: int
    host_reads: int
    swaps: int
    steps: int = 0  # decode steps (batches); 0: one token per step

    @property
    def reads_per_step(self) -> float:
        return self.host_reads / max(self.steps or self.tokens, 1)

    @property
    def reads_per_token(self) -> float:
        return self.host_reads / max(self.tokens, 1)

    @property
    def swaps_per_token(self) -> float:
        return self.swaps / max(self.tokens, 1)

    def read_equivalents_per_token(self, reads_per_swap: float = 2.0) -> float:
        """Cost in host reads, counting a swap as `reads_per_swap` reads (2 by default, the
        weight the cold-set evaluation gives a swap)."""
        return self.reads_per_token + reads_per_swap * self.swaps_per_token


def simulate(
    decode_picks: Iterable[np.ndarray],
    num_layers: int,
    num_experts: int,
    host: dict[int, Iterable[int]],
    policy: SwapPolicy | None,
) -> SimulationResult:
    """Replay per-token picks (each (layers, top_k), decode steps in order) through a fixed
    cold set (policy None) or the runtime swap: one stream, a token per step."""
    steps = (picks[None] for picks in decode_picks)
    r = simulate_steps(steps, num_layers, num_experts, host, policy)
    return SimulationResult(r.tokens, r.host_reads, r.swaps)


def simulate_steps(
    steps: Iterable[np.ndarray],
    num_layers: int,
    num_experts: int,
    host: dict[int, Iterable[int]],
    policy: SwapPolicy | None,
    prompts: dict[int, np.ndarray] | None = None,
) -> SimulationResult:
    """Replay decode steps of several streams decoded together (each step (streams,
    layers, top_k)): a step reads each host expert its batch picks once per layer, however
    many of its tokens picked it, as the kernel does; every pick counts, and decisions
    come every `interval` steps. `prompts` (what-if): before step i, the picks of the
    prompts prefilled then (tokens, layers, top_k) count too."""
    state = SwapState(num_layers, num_experts, host)
    tokens = reads = swaps = n = 0
    for step in steps:
        if policy is not None and prompts and n in prompts:
            state.count(prompts[n])
        reads += state.host_reads(step)
        tokens += step.shape[0]
        n += 1
        if policy is None:
            continue
        state.observe(step)
        if state.steps % policy.interval == 0:
            swaps += len(state.decide(policy))
    return SimulationResult(tokens, reads, swaps, n)


def hindsight_host(
    steps: np.ndarray, num_experts: int, host: dict[int, Iterable[int]]
) -> dict[int, list[int]]:
    """The fixed placement with each layer's host count that the whole run (steps,
    streams, layers, top_k) picks least: the best any fixed cold set could do on it,
    known only afterwards, and the floor the swap is measured against."""
    out = {}
    for layer, ids in host.items():
        ids = list(ids)
        counts = np.bincount(steps[:, :, layer, :].ravel(), minlength=num_experts)
        moved = np.ones(num_experts, dtype=np.int64)
        moved[ids] = 0  # among equal counts, keep what is on the host already
        order = np.lexsort((moved, counts))  # by count, then moved, then id
        out[layer] = sorted(int(e) for e in order[: len(ids)])
    return out


def placed_per_batch(
    steps: np.ndarray,
    num_experts: int,
    host: dict[int, Iterable[int]],
    starts: list[int],
    prompts: dict[int, np.ndarray] | None = None,
) -> SimulationResult:
    """Each batch of streams (steps from each of `starts` to the next) on a placement
    rebuilt when it starts: the experts that batch's decode picks least, known only
    afterwards (a floor for any policy that rebuilds per batch), or, given `prompts` (the
    picks of each batch's prompts, (tokens, layers, top_k) by its start step), the experts
    its prompts pick least, which a server knows once the prompts are prefilled. The swaps
    are the pairs traded to get there from the placement before (the cold set for the
    first)."""
    bounds = [*starts, steps.shape[0]]
    before = {layer: set(ids) for layer, ids in host.items()}
    tokens = reads = swaps = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        basis = steps[a:b] if prompts is None else prompts[a][:, None]
        placed = hindsight_host(basis, num_experts, before)
        r = simulate_steps(iter(steps[a:b]), steps.shape[2], num_experts, placed, None)
        tokens, reads = tokens + r.tokens, reads + r.host_reads
        swaps += sum(len(set(ids) - before[layer]) for layer, ids in placed.items())
        before = {layer: set(ids) for layer, ids in placed.items()}
    return SimulationResult(tokens, reads, swaps, steps.shape[0])
