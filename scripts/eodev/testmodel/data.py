# SPDX-License-Identifier: Apache-2.0
"""Synthetic conversations for the planted test model: named domains, two splits.

A conversation belongs to one domain and centres on two of its topics: 75% of its words come
from the main topic, 20% from the second, 5% from anywhere in the domain. The `calibration`
split draws topics with Zipf-like popularity (a few topics dominate, as in any data set one
counts on); the `heldout` split draws them uniformly, so it also exercises the rare topics that
calibration data barely saw. That shift is what separates in-sample and held-out cold-set reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .plant import Plan

SPLITS = ("calibration", "heldout")
MAIN_SHARE, SECOND_SHARE = 0.75, 0.2


@dataclass(frozen=True)
class Conversation:
    domain: str
    split: str
    topics: tuple[int, int]
    token_ids: tuple[int, ...]

    def text(self, plan: Plan) -> str:
        vocab = plan.vocabulary
        return " ".join(vocab[i] for i in self.token_ids)


def _topic_weights(plan: Plan, split: str) -> np.ndarray:
    z = plan.planting.topics_per_domain
    if split == "calibration":
        w = 1.0 / np.arange(1, z + 1) ** plan.planting.calibration_zipf
    elif split == "heldout":
        w = np.ones(z)
    else:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return w / w.sum()


def conversations(
    plan: Plan, domain: str, split: str, count: int, length: int, seed: int = 0
) -> Iterator[Conversation]:
    """`count` conversations of `length` words each, deterministic in (plan seed, seed, domain,
    split)."""
    if domain not in plan.planting.domains:
        raise ValueError(f"unknown domain {domain!r}; the model has {plan.planting.domains}")
    d = plan.planting.domains.index(domain)
    z = plan.planting.topics_per_domain
    rng = np.random.default_rng([plan.planting.seed, 5, seed, d, SPLITS.index(split)])
    weights = _topic_weights(plan, split)
    domain_words = plan.words_of_domain(d)
    for _ in range(count):
        main, second = rng.choice(z, 2, replace=False, p=weights) + d * z
        pools = (plan.words_of_topic(main), plan.words_of_topic(second), domain_words)
        which = rng.choice(3, length, p=[MAIN_SHARE, SECOND_SHARE, 1 - MAIN_SHARE - SECOND_SHARE])
        ids = [int(pools[w][rng.integers(0, pools[w].size)]) for w in which]
        yield Conversation(domain, split, (int(main), int(second)), tuple(ids))


def greedy_continuation(plan: Plan, token_ids: tuple[int, ...], n: int) -> list[int]:
    """The `n` words the model decodes greedily after `token_ids` (its planted successor chain),
    valid when the last token is a word; the model decides role-word successors itself."""
    out, cur = [], token_ids[-1]
    for _ in range(n):
        cur = int(plan.successor[cur])
        if cur < 0:
            raise ValueError("greedy_continuation needs a conversation that ends in a word")
        out.append(cur)
    return out
