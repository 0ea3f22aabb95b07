# SPDX-License-Identifier: Apache-2.0
"""GPU test fixtures: synthetic checkpoints, cold files and engine runs (eodev.gpu_harness).

Run on a GPU host (README.md, "GPU tests"); every test here is marked `gpu`."""

from __future__ import annotations

import os
import pathlib

import pytest
from eodev import gpu_harness as gh
from eodev.testmodel import data
from eodev.testmodel.plant import Plan, load_plan

INT4_LAYERS = int(os.environ.get("EO_GPU_LAYERS", "8"))
HOST_EXPERTS_PER_LAYER = 64  # 12.5% of 512: one layer's worth over eight layers


def plan_of(model: pathlib.Path) -> Plan:
    return load_plan(model)


def heldout_prompts(plan: Plan, words: int = 256) -> list[list[int]]:
    """One held-out conversation per domain (token ids; no chat template)."""
    return [
        list(next(data.conversations(plan, d, "heldout", 1, words, seed=11)).token_ids)
        for d in plan.planting.domains
    ]


def compared_tasks(
    short: list[list[int]], long: list[int], decode: int, rebatched: bool, stress: int
) -> list[dict]:
    """The greedy tasks the correctness tests compare: two of four prompts (three short, one
    long), one decoded alone (c1) and one two at a time (c2); `rebatched` swaps the two
    batchings (what a request computes depends on what it is batched with: the unpatched
    noise of batching). With `stress` > 0, a task of that many decode steps (three prompts,
    one at a time) comes first, so that the compared tasks run after it."""
    c1, c2 = (2, 1) if rebatched else (1, 2)
    pre = {
        "kind": "greedy",
        "name": "stress",
        "prompts": short[:3],
        "max_tokens": -(-stress // 3),
        "concurrency": 1,
    }
    return [pre] * bool(stress) + [
        {
            "kind": "greedy",
            "name": "c1",
            "prompts": [short[0], short[1], short[2], long],
            "max_tokens": decode,
            "concurrency": c1,
        },
        {
            "kind": "greedy",
            "name": "c2",
            "prompts": [short[3], short[4], short[5], long],
            "max_tokens": decode,
            "concurrency": c2,
        },
    ]


@pytest.fixture(scope="session")
def int4_model() -> pathlib.Path:
    return gh.make_model(f"target-int4-{INT4_LAYERS}l", "--layers", str(INT4_LAYERS))


@pytest.fixture(scope="session")
def bf16_model() -> pathlib.Path:
    return gh.make_model("target-bf16-2l", "--layers", "2", "--quant", "bf16")


def _cold_file(model: pathlib.Path) -> pathlib.Path:
    from eodev.synthetic_cold import synthetic_cold_file

    out = gh.WORK / f"cold-{model.name}.json"
    if not out.exists():
        synthetic_cold_file(model, out, HOST_EXPERTS_PER_LAYER)
    return out


@pytest.fixture(scope="session")
def int4_cold_file(int4_model) -> pathlib.Path:
    return _cold_file(int4_model)


@pytest.fixture(scope="session")
def bf16_cold_file(bf16_model) -> pathlib.Path:
    return _cold_file(bf16_model)
