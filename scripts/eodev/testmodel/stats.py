# SPDX-License-Identifier: Apache-2.0
"""Routing statistics of a planted model: pick counts and cold-set shares.

Used to calibrate the planting (make-test-model --report) and by tests that compare the counts
a real forward pass produces with what the plan predicts.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .data import Conversation, conversations, greedy_continuation
from .plant import Plan


def count_picks(plan: Plan, token_streams: Iterable[list[int] | tuple[int, ...]]) -> np.ndarray:
    """(layers, experts) number of times each expert is among a token's top-k."""
    g = plan.geometry
    counts = np.zeros((g.num_layers, g.num_experts), dtype=np.int64)
    for ids in token_streams:
        arr = np.asarray(ids)
        for layer in range(g.num_layers):
            np.add.at(counts[layer], plan.router_topk(layer, arr).ravel(), 1)
    return counts


def count_picks_from_ids(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(layers, experts) counts from recorded picks of shape (tokens, layers, top_k)."""
    t, layers, k = topk_ids.shape
    counts = np.zeros((layers, num_experts), dtype=np.int64)
    for layer in range(layers):
        np.add.at(counts[layer], topk_ids[:, layer, :].ravel(), 1)
    return counts


def streams(plan: Plan, convs: Iterable[Conversation], decode_tokens: int) -> Iterable[list[int]]:
    """Prompt words followed by the model's greedy continuation (what a server would see)."""
    for c in convs:
        yield list(c.token_ids) + greedy_continuation(plan, c.token_ids, decode_tokens)


def least_used(counts: np.ndarray, fraction: float) -> list[np.ndarray]:
    """Per layer, the `fraction` of experts with the fewest picks (ties broken by expert id)."""
    n = int(round(fraction * counts.shape[1]))
    return [np.argsort(row, kind="stable")[:n] for row in counts]


def cold_share(cold: list[np.ndarray], counts: np.ndarray) -> float:
    """Fraction of all picks (all layers) that land on the cold experts."""
    hit = sum(int(counts[layer, ids].sum()) for layer, ids in enumerate(cold))
    return hit / int(counts.sum())


def normalised_mix(per_set: list[np.ndarray]) -> np.ndarray:
    """Sum of per-data-set counts, each normalised to sum 1 per layer (docs/cold-sets.md)."""
    return sum(c / np.maximum(c.sum(axis=1, keepdims=True), 1) for c in per_set)


def calibration_report(
    plan: Plan,
    conversations_per_domain: int = 16,
    prompt_words: int = 256,
    decode_tokens: int = 128,
    fraction: float = 0.1,
) -> dict:
    """The reference statistics of the planted model (simulated from the plan, no weights):

    - in_sample_share: per layer, the least-used `fraction` of experts over all domains'
      calibration data, and the share of that same data's picks they get (reference ~0.3%).
    - heldout_share: the least-used `fraction` by normalised counts over every domain's
      calibration data, evaluated on held-out conversations of all domains (reference ~2.5%).
    - heldout_share_by_domain, single_domain_share: the same cold set per held-out domain, and
      a cold set counted on one domain only, evaluated on each other domain (uniform = fraction).
    """
    domains = plan.planting.domains

    def counts(domain: str, split: str) -> np.ndarray:
        convs = conversations(plan, domain, split, conversations_per_domain, prompt_words)
        return count_picks(plan, streams(plan, convs, decode_tokens))

    cal = {d: counts(d, "calibration") for d in domains}
    held = {d: counts(d, "heldout") for d in domains}
    cal_all = sum(cal.values())
    mixed_cold = least_used(normalised_mix(list(cal.values())), fraction)
    single = {
        d: {o: cold_share(least_used(cal[d], fraction), held[o]) for o in domains if o != d}
        for d in domains
    }
    return {
        "fraction": fraction,
        "in_sample_share": cold_share(least_used(cal_all, fraction), cal_all),
        "heldout_share": cold_share(mixed_cold, sum(held.values())),
        "heldout_share_by_domain": {d: cold_share(mixed_cold, held[d]) for d in domains},
        "single_domain_share": single,
        "tokens_per_split": int(cal_all.sum() // (plan.geometry.num_layers * plan.geometry.top_k)),
    }
