# SPDX-License-Identifier: Apache-2.0
"""What every engine of a bench-offload run is asked to do: the prompts of its workloads,
drawn from the model's planted data so that every engine decodes the very same tokens, and
the engine_probe tasks built on them."""

from __future__ import annotations

import argparse

from ..testmodel import data
from ..testmodel.plant import Plan

# --ttft-32k: the 32,768-token prompt and room for its decode
LONG_MODEL_LEN = 34816


def workload_prompts(
    plan: Plan, long_tokens: int = 10240
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The fresh prompts (one held-out prompt of every domain), the repeat prompts and at
    least `long_tokens` of the long prompt, which the TTFT tasks cut to length (the same first
    tokens whatever the length)."""
    prompts = [
        list(next(data.conversations(plan, d, "heldout", 1, 256, seed=21)).token_ids)
        for d in plan.planting.domains
    ]
    # the swap's case: each domain's prompt several times in a row, as a conversation that
    # stays in one domain would run
    repeat_prompts = [p for p in prompts[:3] for _ in range(4)]
    long_words = [
        t
        for c in data.conversations(plan, "science", "heldout", -(-long_tokens // 256), 256, seed=5)
        for t in c.token_ids
    ]
    return prompts, repeat_prompts, long_words


def engine_tasks(
    args: argparse.Namespace,
    prompts: list[list[int]],
    repeat_prompts: list[list[int]],
    long_words: list[int],
) -> list[dict]:
    """The tasks every engine runs: decode timing and greedy tokens of both workloads, TTFT
    at 2k and 8k prompt tokens, and (--profile) the decode profile."""
    decode = {"max_tokens": args.decode_tokens, "warmup": 1, "repeats": args.repeats}
    greedy = {"max_tokens": args.decode_tokens, "prompt_logprobs": False}
    tasks = [
        {"kind": "decode_timing", "name": "fresh", "prompts": prompts, **decode},
        {"kind": "greedy", "name": "fresh_tokens", "prompts": prompts, **greedy},
        {"kind": "decode_timing", "name": "repeat", "prompts": repeat_prompts, **decode},
        {"kind": "greedy", "name": "repeat_tokens", "prompts": repeat_prompts, **greedy},
        {"kind": "ttft", "name": "ttft_2k", "prompt": long_words[:2048], "repeats": args.repeats},
        {"kind": "ttft", "name": "ttft_8k", "prompt": long_words[:8192], "repeats": args.repeats},
    ]
    if args.ttft_32k:
        tasks.append(
            {
                "kind": "ttft",
                "name": "ttft_32k",
                "prompt": long_words[:32768],
                "repeats": args.repeats,
            }
        )
    if args.profile:
        tasks.append(profile_task(prompts, args.decode_tokens))
    return tasks


def profile_task(prompts: list[list[int]], decode_tokens: int) -> dict:
    """engine_probe's decode_profile on the first two fresh prompts."""
    return {
        "kind": "decode_profile",
        "name": "profile",
        "prompts": prompts[:2],
        "max_tokens": decode_tokens,
    }


def decide_ab_task(prompts: list[list[int]], decode_tokens: int, repeats: int) -> dict:
    """engine_probe's decode_ab: decisions every interval with a margin no count reaches
    (decide and swap kernels run, nothing moves) against no decisions at all."""
    return {
        "kind": "decode_ab",
        "name": "decide_ab",
        "prompts": prompts,
        "max_tokens": decode_tokens,
        "warmup": 1,
        "repeats": repeats,
        "variants": {"decide": {"margin": 1e30}, "no-decide": {"interval": 10**9}},
    }
