# SPDX-License-Identifier: Apache-2.0
"""The planted structure of the synthetic test model: vocabulary, domains, topics and routers.

The router of every MoE layer sees only a few reserved hidden dimensions that the model writes
on purpose, so which experts a token picks is an exact, known function of the token sequence:

    logit[e] = bias[e]                                   global popularity (skew)
             + own(t)  . (domain[e] + topic[e]) * w_own   the current word's topic and domain
             + ctx(t)  . (domain[e] + topic[e]) * w_ctx   the mean topic of the conversation so far
             + noise[e] . r(word)                        word-specific variation

`own(t)` is the one-hot topic of the current word; `ctx(t)` is the mean of `own` over every
position up to t (layer 0's attention computes that mean: its queries are zero, so attention is
uniform over the causal prefix). Expert outputs and the other attention layers never write the
reserved dimensions, and RMSNorm scales all logits of a token by the same positive factor, so the
top-k picks do not depend on the random expert weights: `router_topk` below reproduces them.

The reserved dimensions are the last ones of the hidden state, in this order:
    [const (1) | own topic (D*Z) | context topic (D*Z) | word noise (noise_rank)]
Everything before them is the "token" subspace that the language-model head reads.
"""

from __future__ import annotations

import json
import pathlib
import string
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# Domains come in opposite pairs (0-1, 2-3, 4-5): a domain suppresses its opposite's specialists,
# the way a code-only cold set starves English prose in the articles' measurements.
DOMAINS = ("code", "story", "math", "chat", "legal", "science")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
ROLE_WORDS = ("system", "user", "assistant")
EOS_ID = 0
ARCHS = ("qwen3_moe", "qwen4_exp")


@dataclass(frozen=True)
class Geometry:
    """Model shape; the defaults are the target model's expert geometry with fewer layers."""

    hidden_size: int = 2560
    num_experts: int = 512
    top_k: int = 10
    moe_intermediate_size: int = 640
    num_layers: int = 8
    vocab_size: int = 32000
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    arch: str = "qwen3_moe"  # qwen3_moe or qwen4_exp (layer mix and extras: qwen4exp.py)


@dataclass(frozen=True)
class Planting:
    """Parameters of the planted routing structure, in router-logit units.

    The defaults were calibrated (docs in tests/README.md, numbers measured by
    `scripts/make-test-model --report`) against the reference statistics in tests/README.md.
    """

    seed: int = 0
    domains: tuple[str, ...] = DOMAINS
    topics_per_domain: int = 8
    popularity_sigma: float = 0.5  # std of the per-expert bias
    domain_boost: float = 1.5  # mean boost of a domain's preferred experts
    domain_fraction: float = 0.1  # fraction of experts a domain prefers
    opposition: float = 1.0  # how much a domain suppresses its opposite domain's specialists
    topic_boost: float = 6.0  # mean boost of a topic's specialists (topics partition experts)
    noise_sigma: float = 1.1  # std of the word-specific logit noise
    noise_rank: int = 64  # hidden dimensions that carry the word noise
    own_weight: float = 0.5  # weight of the current word's topic
    context_weight: float = 0.5  # weight of the conversation's mean topic
    calibration_zipf: float = 3.0  # topic popularity exponent of the calibration split

    @property
    def num_topics(self) -> int:
        return len(self.domains) * self.topics_per_domain

    @property
    def reserved_dims(self) -> int:
        return 1 + 2 * self.num_topics + self.noise_rank


# Scales of the residual-stream components (the token part has norm 1). Their only effect is
# through RMSNorm; routing is invariant to them because the gate compensates.
TOKEN_NORM = 1.0
CONST_VALUE = 0.3
TOPIC_VALUE = 0.3
CONTEXT_VALUE = 0.3
NOISE_NORM = 0.3
# Language-model head: logit of the planted successor, random per-pair logits, and the boost of
# words of the conversation's dominant domain (what continues after a role word).
SUCCESSOR_LOGIT = 11.0
PAIR_LOGIT_SIGMA = 1.0
DOMAIN_LOGIT = 8.0
# Norm that every MoE layer's output adds to the residual stream (token subspace only).
MOE_OUTPUT_NORM = 0.15
DECODE_RUN = 32  # mean number of successive decode words that stay in one topic


@dataclass
class LayerRouter:
    """One MoE layer's planted router, in logit units (numpy float64)."""

    bias: np.ndarray  # (E,)
    domain: np.ndarray  # (D, E)
    topic: np.ndarray  # (D*Z, E)
    noise: np.ndarray  # (E, noise_rank)

    def topic_affinity(self, topics_per_domain: int) -> np.ndarray:
        """(D*Z, E): what a word of topic z adds to each expert's logit (before weights)."""
        return np.repeat(self.domain, topics_per_domain, axis=0) + self.topic


@dataclass
class Plan:
    """Everything planted in one synthetic model, derived deterministically from the seed."""

    geometry: Geometry
    planting: Planting = field(default_factory=Planting)

    def __post_init__(self) -> None:
        g, p = self.geometry, self.planting
        if g.hidden_size - p.reserved_dims < 32:
            raise ValueError(
                f"hidden_size {g.hidden_size} is too small: the planted structure reserves "
                f"{p.reserved_dims} dimensions and the token subspace needs at least 32 more"
            )
        if p.num_topics > g.head_dim:
            raise ValueError(f"{p.num_topics} topics do not fit one attention head of {g.head_dim}")
        if g.arch not in ARCHS:
            raise ValueError(f"unknown architecture {g.arch!r}: expected one of {ARCHS}")
        if g.top_k > g.num_experts:
            raise ValueError("top_k must not exceed num_experts")
        first_word = len(SPECIAL_TOKENS) + len(ROLE_WORDS)
        if g.vocab_size - first_word < 4 * p.num_topics:
            raise ValueError(f"vocab_size {g.vocab_size} leaves too few words per topic")

    # ---- layout of the hidden state ------------------------------------------------------
    @property
    def token_dims(self) -> int:
        return self.geometry.hidden_size - self.planting.reserved_dims

    @property
    def const_dim(self) -> int:
        return self.token_dims

    @property
    def own_slice(self) -> slice:
        start = self.token_dims + 1
        return slice(start, start + self.planting.num_topics)

    @property
    def context_slice(self) -> slice:
        start = self.own_slice.stop
        return slice(start, start + self.planting.num_topics)

    @property
    def noise_slice(self) -> slice:
        start = self.context_slice.stop
        return slice(start, start + self.planting.noise_rank)

    # ---- vocabulary ------------------------------------------------------------------------
    @cached_property
    def first_word_id(self) -> int:
        return len(SPECIAL_TOKENS) + len(ROLE_WORDS)

    @cached_property
    def word_topic(self) -> np.ndarray:
        """(V,) topic of each token id; -1 for special tokens and role words."""
        v, t = self.geometry.vocab_size, self.planting.num_topics
        topic = np.full(v, -1, dtype=np.int64)
        n_words = v - self.first_word_id
        # contiguous blocks, one per topic (domain-major), sizes differing by at most one
        topic[self.first_word_id :] = np.arange(n_words) * t // n_words
        return topic

    def words_of_topic(self, topic: int) -> np.ndarray:
        return np.flatnonzero(self.word_topic == topic)

    def words_of_domain(self, domain: int) -> np.ndarray:
        z = self.planting.topics_per_domain
        wt = self.word_topic
        return np.flatnonzero((wt >= domain * z) & (wt < (domain + 1) * z))

    @cached_property
    def vocabulary(self) -> list[str]:
        """Token strings: special tokens, role words, then unique pronounceable pseudo-words."""
        rng = np.random.default_rng([self.planting.seed, 1])
        cons, vows = "bdfgklmnprstvz", "aeiou"
        syll = [c + v for c in cons for v in vows]
        words: list[str] = [*SPECIAL_TOKENS, *ROLE_WORDS]
        seen = set(words)
        while len(words) < self.geometry.vocab_size:
            n = int(rng.integers(2, 5))
            w = "".join(syll[i] for i in rng.integers(0, len(syll), n))
            if rng.random() < 0.3:
                w += string.ascii_lowercase[int(rng.integers(0, 26))]
            if w not in seen:
                seen.add(w)
                words.append(w)
        return words

    # ---- router ----------------------------------------------------------------------------
    def _rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.planting.seed, *stream])

    @cached_property
    def routers(self) -> list[LayerRouter]:
        """Per-layer planted routers; drawn from streams that do not depend on the hidden size."""
        g, p = self.geometry, self.planting
        e, d, t = g.num_experts, len(p.domains), p.num_topics
        out = []
        for layer in range(g.num_layers):
            rng = self._rng(2, layer)
            bias = rng.normal(0.0, p.popularity_sigma, e)
            domain = np.zeros((d, e))
            for i in range(d):
                pick = rng.choice(e, max(1, round(p.domain_fraction * e)), replace=False)
                domain[i, pick] = p.domain_boost * rng.uniform(0.5, 1.5, pick.size)
            # topics partition the experts: every expert is some topic's specialist, so how
            # often calibration data visits that topic decides whether it looks cold
            topic = np.zeros((t, e))
            for i, pick in enumerate(np.array_split(rng.permutation(e), t)):
                topic[i, pick] = p.topic_boost * rng.uniform(0.5, 1.5, pick.size)
            z = p.topics_per_domain
            specialists = [
                (domain[i] > 0) | (topic[i * z : (i + 1) * z] > 0).any(0) for i in range(d)
            ]
            for i in range(d):
                opposite = i ^ 1
                if opposite < d:
                    domain[i, specialists[opposite]] -= p.opposition
            noise = rng.normal(0.0, p.noise_sigma, (e, p.noise_rank))
            out.append(LayerRouter(bias, domain, topic, noise))
        return out

    @cached_property
    def word_noise(self) -> np.ndarray:
        """(V, noise_rank) unit vectors: each word's direction in the noise subspace."""
        rng = self._rng(3)
        r = rng.normal(size=(self.geometry.vocab_size, self.planting.noise_rank))
        return r / np.linalg.norm(r, axis=1, keepdims=True)

    def topic_onehots(self, token_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids)
        own = np.zeros((ids.size, self.planting.num_topics))
        topics = self.word_topic[ids]
        has = topics >= 0
        own[np.flatnonzero(has), topics[has]] = 1.0
        return own

    def context(self, token_ids: np.ndarray) -> np.ndarray:
        """(T, D*Z) mean topic one-hot over each causal prefix (what layer 0's attention adds)."""
        own = self.topic_onehots(token_ids)
        return np.cumsum(own, axis=0) / np.arange(1, own.shape[0] + 1)[:, None]

    def router_logits(self, layer: int, token_ids: np.ndarray) -> np.ndarray:
        """(T, E) planted router logits of one conversation at one layer, up to a positive scale
        per token (the model's RMSNorm), which does not change the top-k."""
        p, r = self.planting, self.routers[layer]
        ids = np.asarray(token_ids)
        aff = r.topic_affinity(p.topics_per_domain)
        mix = p.own_weight * self.topic_onehots(ids) + p.context_weight * self.context(ids)
        return r.bias[None, :] + mix @ aff + self.word_noise[ids] @ r.noise.T

    def router_topk(self, layer: int, token_ids: np.ndarray) -> np.ndarray:
        """(T, top_k) expert ids the planted router picks (unordered)."""
        k = self.geometry.top_k
        logits = self.router_logits(layer, token_ids)
        return np.argpartition(-logits, k - 1, axis=1)[:, :k]

    # ---- language-model head ---------------------------------------------------------------
    @cached_property
    def successor(self) -> np.ndarray:
        """(V,) the planted greedy successor of each word (-1: none; the domain term decides).

        Per domain, one cycle through all of its words that stays in one topic for runs of
        about DECODE_RUN words, so decoding wanders through the domain with topic locality."""
        rng = self._rng(4)
        nxt = np.full(self.geometry.vocab_size, -1, dtype=np.int64)
        z = self.planting.topics_per_domain
        for d in range(len(self.planting.domains)):
            chunks = []
            for t in range(d * z, (d + 1) * z):
                words = rng.permutation(self.words_of_topic(t))
                chunks += np.array_split(words, max(1, words.size // DECODE_RUN))
            order = np.concatenate([chunks[i] for i in rng.permutation(len(chunks))])
            nxt[order] = np.roll(order, -1)
        return nxt


def load_plan(model_dir: pathlib.Path) -> Plan:
    """The Plan of a make-test-model checkpoint, from its synthetic_model.json."""
    desc_file = pathlib.Path(model_dir) / "synthetic_model.json"
    if not desc_file.exists():
        raise ValueError(
            f"{model_dir} is not a make-test-model checkpoint (no synthetic_model.json)"
        )
    desc = json.loads(desc_file.read_text())
    planting = dict(desc["planting"], domains=tuple(desc["planting"]["domains"]))
    return Plan(Geometry(**desc["geometry"]), Planting(**planting))
