# SPDX-License-Identifier: Apache-2.0
"""What one --configs entry runs: its environment (VLLM_EXPERT_*), its engine arguments,
which vLLM (patched or not, which tree) and where its host experts are meant to be."""

from __future__ import annotations

import pathlib

from eotools.selection import GiB, expert_bytes

from ..bench.configs import parse_spec
from ..bench.uva_budget import budget_for
from .suite import Suite, spec_slug, suite_engine
from .workloads import decide_ab_task


def _placement_env(
    suite: Suite, name: str, per_layer: int
) -> tuple[dict[str, str], dict, bool, dict[int, set[int]]]:
    """A configuration's environment, engine arguments, whether it runs the patched vLLM,
    and where its host experts are."""
    args, plan = suite.args, suite.plan
    env, engine, patched, placed = {}, suite_engine(args), True, {}
    if name == "offload-02":
        cold_path, placed = suite.cold_set(per_layer)
        env = {"VLLM_EXPERT_COLD_FILE": str(cold_path)}
    elif name in ("offload-03", "offload-03-swap"):
        cold_path, placed = suite.cold_set(per_layer)
        env = {"VLLM_EXPERT_COLD_FILE": str(cold_path), "VLLM_EXPERT_ONE_TABLE": "1"}
        env["VLLM_EXPERT_SWAP"] = "1" if name == "offload-03-swap" else "0"
    elif name == "offload-01":
        env = {"VLLM_EXPERT_HOST_LAYERS": args.host_layers}
        placed = {x: suite.every for x in suite.host_layers}
    elif name == "unpatched":
        patched = False
    elif name == "cpu-offload-gb":
        # the same host bytes as an offload run of this size made earlier in this run
        # (in an earlier unit: members of one unit are prepared before any runs), else
        # the checkpoint's expert bytes for that many experts in every layer
        same = suite.host_bytes.get(per_layer) or (
            per_layer * plan.geometry.num_layers * expert_bytes(args.model)
        )
        # vLLM stops at the first parameter boundary at or above its budget: aim at
        # the boundary nearest the bytes instead (bench/uva_budget.py)
        budget = budget_for(same, suite.uva_stops)[0] if suite.uva_stops else same
        engine = suite_engine(args, cpu_offload_gb=budget / GiB, cpu_offload_params=["experts"])
        patched = False
    return env, engine, patched, placed


def _variant_env(env: dict[str, str], variant: str, name: str, out: pathlib.Path) -> None:
    """Add the environment of a configuration's variants (+count, +churn, +hold, +fast,
    +stage, +prefetch) to `env`."""
    if "stage" in variant:
        env["VLLM_EXPERT_PREFILL_STAGING"] = "1"
    if "prefetch" in variant:
        env["VLLM_EXPERT_DECODE_PREFETCH"] = "1"
    if "count" in variant:
        env["VLLM_EXPERT_COUNT_FILE"] = str(out.with_suffix(f".{name}.counts.json"))
    if "churn" in variant:
        # a decision every decode step on the last step's picks alone, no margin: swaps
        # all the time; the live self-check verifies every row every 500 decisions
        env.update(
            VLLM_EXPERT_SWAP_INTERVAL="1",
            VLLM_EXPERT_SWAP_HALF_LIFE="1",
            VLLM_EXPERT_SWAP_MARGIN="0",
            VLLM_EXPERT_SWAP_SELF_CHECK="500",
        )
    if "hold" in variant:
        # counts and decisions as by default, but no count can exceed this margin
        env["VLLM_EXPERT_SWAP_MARGIN"] = "1e30"
    if "fast" in variant:
        # what simulate-swap finds best for streams of mixed domains on the planted model:
        # a decision every step on counts that forget quickly, with a smaller margin
        env.update(
            VLLM_EXPERT_SWAP_INTERVAL="1",
            VLLM_EXPERT_SWAP_HALF_LIFE="64",
            VLLM_EXPERT_SWAP_MARGIN="1",
        )


def prepare(suite: Suite, spec: str, rnd: int) -> dict:
    """One configuration's engine run: its label, run config, and where its host
    experts are (for host reads per token)."""
    args = suite.args
    name, variant, tree, per_layer = parse_spec(spec)
    per_layer = per_layer or args.host_experts_per_layer
    in_round = f"-r{rnd}" if rnd > 1 else ""
    env, engine, patched, placed = _placement_env(suite, name, per_layer)
    _variant_env(env, variant, name, args.out)
    config_tasks = suite.tasks
    if args.decide_ab and name == "offload-03-swap" and not variant:
        config_tasks = [
            *suite.tasks,
            decide_ab_task(suite.prompts, args.decode_tokens, args.repeats),
        ]
    return {
        "spec": spec,
        "name": name,
        "variant": variant,
        "tree": tree,
        "per_layer": per_layer,
        "label": f"bench-{spec_slug(spec)}{in_round}",
        "patched": patched,
        "placed": placed,
        "run_config": {
            "model": str(args.model),
            "env": env,
            "engine": engine,
            "tasks": config_tasks,
        },
    }
