# SPDX-License-Identifier: Apache-2.0
"""One bench-offload run as a whole: what its configurations share (the planted routing, the
workloads, cold files made once per size), which configurations it runs and in which units."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import pathlib
from typing import Any

from .. import bench_streams
from .. import gpu_harness as gh
from ..bench.configs import parse_spec
from ..bench.uva_budget import offload_boundaries
from ..synthetic_cold import synthetic_cold_file
from ..testmodel.plant import Plan, load_plan
from .workloads import LONG_MODEL_LEN, engine_tasks, workload_prompts


@dataclasses.dataclass
class Suite:
    """What every configuration of one run shares: the command line, the model's planted
    routing, the workloads and the engines' tasks, and what earlier configurations leave
    for later ones (cold files made once per size, measured host bytes)."""

    args: argparse.Namespace
    plan: Plan
    prompts: list[list[int]]
    repeat_prompts: list[list[int]]
    tasks: list[dict]
    host_layers: set[int]
    every: set[int]
    # where vLLM's --cpu-offload-gb can stop (None for a weightless model)
    uva_stops: list[tuple[int, int]] | None
    cold_files: dict[int, tuple[pathlib.Path, dict[int, set[int]]]] = dataclasses.field(
        default_factory=dict
    )
    # measured bytes on host, by host experts per layer
    host_bytes: dict[int, int] = dataclasses.field(default_factory=dict)

    def cold_set(self, per_layer: int) -> tuple[pathlib.Path, dict[int, set[int]]]:
        """The cold file of `per_layer` host experts per layer (made once per size)."""
        if per_layer not in self.cold_files:
            suffix = "" if per_layer == self.args.host_experts_per_layer else f"-{per_layer}"
            path = self.args.out.with_suffix(f".cold{suffix}.json")
            doc = synthetic_cold_file(self.args.model, path, per_layer)
            layers = {int(k): set(v) for k, v in doc["layers"].items()}
            self.cold_files[per_layer] = (path, layers)
        return self.cold_files[per_layer]


def make_suite(args: argparse.Namespace) -> Suite:
    """The suite of this command line, on the model's planted routing."""
    plan = load_plan(args.model)
    host_layers = {int(x) for x in args.host_layers.split(",") if x}
    every = set(range(plan.geometry.num_experts))
    uva_stops = offload_boundaries(args.model, plan.geometry.num_layers, len(every))
    prompts, repeat_prompts, long_words = workload_prompts(plan, 32768 if args.ttft_32k else 10240)
    tasks = engine_tasks(args, prompts, repeat_prompts, long_words)
    if args.streams:
        tasks.append(bench_streams.task(plan, args.streams, args.decode_tokens, args.repeats))
    return Suite(args, plan, prompts, repeat_prompts, tasks, host_layers, every, uva_stops)


def suite_engine(args: argparse.Namespace, **overrides: Any) -> dict:
    """gpu_harness's engine settings with this run's pipeline parallel size (and room for
    --streams' largest batch, and --ttft-32k's prompt)."""
    if args.pp_size > 1:
        overrides["pipeline_parallel_size"] = args.pp_size
    if args.streams:
        overrides = {**bench_streams.engine_overrides(args.streams), **overrides}
    if args.ttft_32k:
        overrides.setdefault("max_model_len", LONG_MODEL_LEN)
    return gh.engine(**overrides)


def suite_specs(args: argparse.Namespace, num_experts: int) -> list[str]:
    """The configurations to run: --configs, then the sweep's sizes of offload-03-swap and
    cpu-offload-gb that are not already there."""
    specs = args.configs.split(",")
    for fraction in args.sweep:
        n = max(1, round(fraction * num_experts))
        for name in ("offload-03-swap", "cpu-offload-gb"):
            spec = name if n == args.host_experts_per_layer else f"{name}:{n}"
            if spec not in specs:  # the main table's size is not run twice
                specs.append(spec)
    return specs


def run_units(specs: list[str], rounds: int, group: int) -> list[tuple[int, list[str]]]:
    """The engine runs of a suite, in order: (round, configurations run together). Rounds
    after the first run the configurations in reverse order, so that a drift of the
    machine over the run (clocks, other tenants) favours none of them. group 0: every
    configuration alone; group K: the configurations other than "unpatched" K at a time,
    each unit beside an unpatched engine of its own."""
    units = []
    for rnd in range(1, rounds + 1):
        ordered = specs if rnd % 2 else specs[::-1]
        if not group:
            units += [(rnd, [spec]) for spec in ordered]
            continue
        offload = [s for s in ordered if parse_spec(s)[0] != "unpatched"]
        units += [(rnd, offload[i : i + group]) for i in range(0, len(offload), group)]
    return units


def spec_slug(spec: str) -> str:
    """A file-name-safe form of a --configs entry (cache and raw-run file names)."""
    name, variant, tree, per_layer = parse_spec(spec)
    slug = name + (f"-h{per_layer}" if per_layer else "") + (f"+{variant}" if variant else "")
    if tree:
        slug += "@" + hashlib.sha256(tree.encode()).hexdigest()[:8]
    return slug
