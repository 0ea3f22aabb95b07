# SPDX-License-Identifier: Apache-2.0
"""Side-by-side benchmark of the offload paths on one GPU, in one run (docs/benchmarks.md).

Configurations (--configs): unpatched; cpu-offload-gb (vLLM's --cpu-offload-gb with the
same host bytes as an offload configuration of the same size); offload-01 (whole layers on
host); offload-02 (cold file, two tables); offload-03 (cold file, one table, no swap) and
offload-03-swap (one table with runtime swap). Workloads: fresh (one held-out prompt of every
domain) and repeat (three domains' prompts four times each in a row, the swap's case), for
decode speed and TPOT percentiles; TTFT at 2k and 8k prompt tokens. Every repeat is kept.
Host reads per token come from the model's planted routing of the very tokens decoded (exact
for make-test-model checkpoints, whose routers are planted), and with runtime swap from its
own counters.

The reference table (bench/results/README.md) in one command, e.g. on a 16-layer model with
10% of the experts on host (51 of 512 per layer) and a sweep of the host fraction:

    bench-offload --model M --host-experts-per-layer 51 --host-layers 0,1
        --configs unpatched,cpu-offload-gb,offload-01,offload-02,offload-03,offload-03-swap
        --sweep 0.05,0.1,0.2,0.4 --host-read-us 55.7 --out FILE

Exit codes: 0 every configuration ran; 1 one or more failed (the report lists them under
"FAILED" and in the JSON's "failed", and keeps every configuration that ran); 2 usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
from eotools.selection import expert_bytes

from . import bench_streams
from . import gpu_harness as gh
from .bench import prefill_bound
from .bench.configs import parse_spec
from .bench.sweep import plot_sweep, sweep_lines
from .bench.uva_budget import budget_for, offload_boundaries
from .engine_probe import expert_block_slack
from .nvsmi import gpu_name
from .synthetic_cold import synthetic_cold_file
from .testmodel import data
from .testmodel.plant import Plan, load_plan

GiB = 1 << 30


def host_reads_per_token(
    plan: Plan, prompts, outputs, host: dict[int, set[int]], share: dict[int, float] | None = None
) -> float:
    """Mean number of (layer, expert) picks per decode step that land on host experts (the
    steps that feed generated tokens back: positions len(prompt) .. end - 1). `share`
    weights a layer's picks by the part of each expert's bytes on host (vLLM's
    --cpu-offload-gb may offload only some of a layer's tensors): reads in whole rows."""
    reads = 0.0
    tokens = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        seq = np.array(prompt + out)
        start = len(prompt)
        for layer, cold in host.items():
            picks = plan.router_topk(layer, seq[:-1])[start:]
            reads += int(np.isin(picks, list(cold)).sum()) * (share or {}).get(layer, 1.0)
        tokens += len(out) - 1
    return reads / max(tokens, 1)


def _one_table_placement(memory: dict, placed: dict[int, set[int]]) -> dict[int, set[int]]:
    """The host experts an engine ran with: one table can keep a few more GPU experts in
    host rows than the cold file (to keep its VRAM within offload-02's), and its probe
    says which, per layer; other layers are as placed."""
    table = memory.get("one_table_host_experts") or {}
    return {**placed, **{int(k): set(v) for k, v in table.items()}}


def _add_suite_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, its host experts, the configurations and the workloads' sizes."""
    ap.add_argument(
        "--model", type=pathlib.Path, required=True, help="a make-test-model INT4 checkpoint"
    )
    ap.add_argument(
        "--host-experts-per-layer",
        type=int,
        default=64,
        help="cold set size per layer for offload-02 (default 64 = 12.5%%)",
    )
    ap.add_argument("--host-layers", default="0", help="VLLM_EXPERT_HOST_LAYERS for offload-01")
    ap.add_argument(
        "--pp-size",
        type=int,
        default=1,
        help="pipeline parallel size of every engine (2: two GPUs, each engine on both; the "
        "engine probe merges the ranks' placement and swap counters)",
    )
    ap.add_argument(
        "--sweep",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[],
        metavar="FRACTIONS",
        help="host fractions, e.g. 0.05,0.1,0.2,0.4: adds offload-03-swap:N and "
        "cpu-offload-gb:N (N = fraction x experts per layer) for each, after --configs",
    )
    ap.add_argument(
        "--streams",
        type=bench_streams.parse_streams,
        default=None,
        metavar="N,N,...",
        help="also decode N requests of mixed domains together, for each N (e.g. 1,4,16): "
        "total tokens/s and TPOT per configuration; every engine then allows as many "
        "sequences and captures CUDA graphs up to that batch",
    )
    ap.add_argument(
        "--ttft-32k",
        action="store_true",
        help="also time the first token of a 32,768-token prompt (every engine's "
        f"max_model_len then rises to {LONG_MODEL_LEN:,})",
    )
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, each round in its own engine "
        "processes and in the reverse order of the one before; ratios are taken within a "
        "round and reported as their median and range (default 1)",
    )
    ap.add_argument(
        "--host-read-us",
        type=float,
        default=None,
        help="measured cost of one host-resident expert read in microseconds "
        "(scripts/bench-host-read, K=1 median): adds each configuration's physical bound, "
        "unpatched TPOT + host reads per token x this cost",
    )
    ap.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help="measured pinned-host-to-VRAM copy bandwidth in GB/s (55.3 on the H200 "
        "reference host): adds each configuration's TTFT bound, the larger of unpatched "
        "TTFT and its host expert bytes once per prefill chunk at this bandwidth",
    )
    ap.add_argument(
        "--configs",
        default="offload-02,offload-01,unpatched,cpu-offload-gb",
        help="comma-separated CONFIG[:N][+count][+churn|+hold|+fast][+stage][@TREE]: +count "
        "turns the usage-counting hook on, +churn makes offload-03-swap decide every decode "
        "step with no margin and a half-life of one step (and self-check every 500 "
        "decisions), +hold makes it count and decide as usual but never swap (the cost of "
        "counting and deciding alone, against offload-03), +fast makes it decide every step "
        "with a 64-step half-life and margin 1, +stage turns prefill staging on (offload-02/03), "
        "@TREE runs another patched vLLM folder (an A/B of two series in one run); a "
        "configuration that fails is reported as failed and the others still run",
    )


def _add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """How the engines run: side by side (--paired, --group), and their extra tasks."""
    ap.add_argument(
        "--paired",
        action="store_true",
        help="run every configuration side by side with an unpatched engine of its own on "
        "the same GPU, the two taking turns request by request, and take its ratios "
        "against that engine: a change of the host's speed during the run (20%% steps seen "
        "on H200 hosts) then hits both alike. Needs GPU memory for two engines "
        "(EO_GPU_MEMORY_UTILIZATION, default here 0.35). The same as --group 1",
    )
    ap.add_argument(
        "--group",
        type=int,
        default=0,
        metavar="K",
        help="run the configurations K at a time side by side with one unpatched engine on "
        "the same GPU, all taking turns request by request, and take their ratios against "
        "that engine: as --paired, with K+1 engines started at once instead of 2 per "
        "configuration (a sweep in a fraction of the time). Needs GPU memory for K+1 "
        "engines (EO_GPU_MEMORY_UTILIZATION, default here 1/(K+1), at most 0.35)",
    )
    ap.add_argument(
        "--unit-timeout-s",
        type=float,
        default=900,
        help="with --paired or --group: the longest one unit (its engines' start-up and all "
        "their tasks) may take before its engines are killed and it is reported failed "
        "(default 900)",
    )
    ap.add_argument(
        "--decide-ab",
        action="store_true",
        help="in every offload-03-swap engine (no variant), also time the decide kernel "
        "alone: the fresh prompts once with decisions every interval that never swap and "
        "once with no decisions, request by request in alternating order (robust to the "
        "host changing speed during the run)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="in every engine (paired partners too), after the other tasks, also profile "
        "the decode of the first two fresh prompts (decoded before by the fresh workload; "
        "the first once more as a warm-up), alone on the GPU: wall time and GPU busy time "
        "per token, and each kernel's time per token, beside the unpatched partner's (where "
        "a configuration loses time; the profiler slows the host, so these wall times are "
        "not the benchmark's)",
    )


def _add_report_arguments(ap: argparse.ArgumentParser) -> None:
    """Where the result goes, and reports assembled from earlier runs."""
    ap.add_argument(
        "--compare-with",
        type=pathlib.Path,
        metavar="EARLIER.json",
        help="an earlier run of the same suite: list each ratio beside that run's and say "
        "whether it lies within that run's per-repeat range (does a second run reproduce "
        "the first?)",
    )
    ap.add_argument("--out", type=pathlib.Path, required=True, help="result JSON path")
    ap.add_argument(
        "--from-runs",
        type=pathlib.Path,
        help="build the report from engine results already in this folder (a run cut short); "
        "configurations without a result are listed as not run",
    )
    ap.add_argument("--ran-as", help="with --from-runs: the command that made the engine runs")
    ap.add_argument("--ran-at", help="with --from-runs: when the engine runs were made")


def parser() -> argparse.ArgumentParser:
    """bench-offload's command line."""
    ap = argparse.ArgumentParser(
        prog="bench-offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_suite_arguments(ap)
    _add_engine_arguments(ap)
    _add_report_arguments(ap)
    return ap


def _earlier_run(ap: argparse.ArgumentParser, path: pathlib.Path) -> dict:
    """The earlier result of --compare-with, read before the GPU run so that a bad file
    costs none of it (a usage error)."""
    try:
        earlier = json.loads(_read_maybe_gzip(path))
    except (OSError, ValueError) as e:
        ap.error(f"--compare-with {path}: {e}")
    if not isinstance(earlier, dict) or not isinstance(earlier.get("runs"), list):
        ap.error(
            f"--compare-with {path}: not a bench-offload result (no runs); "
            "name the JSON file that an earlier run wrote with --out"
        )
    return earlier


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict | None]:
    """The checked command line and the earlier result of --compare-with (None without);
    also makes the output folder and, for engines side by side, sets their default share
    of GPU memory."""
    ap = parser()
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.group < 0 or (args.paired and args.group not in (0, 1)):
        ap.error("--group takes K >= 1 configurations at a time (--paired is --group 1)")
    earlier = None
    if args.compare_with is not None:
        earlier = _earlier_run(ap, args.compare_with)
    if (args.paired or args.group) and not args.from_runs:
        # vLLM's start-up check of free GPU memory; the KV cache has a fixed size
        engines = 1 + max(args.group, 1)
        os.environ.setdefault("EO_GPU_MEMORY_UTILIZATION", f"{min(0.35, 1 / engines):.2f}")
    return args, earlier


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


@dataclasses.dataclass
class Collected:
    """The engine results of a run as they come in, by (configuration, round), and the
    configurations that did not run or failed."""

    ran_model: str
    results: dict[tuple[str, int], dict] = dataclasses.field(default_factory=dict)
    not_run: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    # the unpatched engines of the second and later units of a round (--paired, --group),
    # reported as rows of their own: each unit's baseline
    unit_bases: list[str] = dataclasses.field(default_factory=list)
    units_run: int = 0

    def fail(self, member: dict, rnd: int, err: BaseException) -> None:
        """Record a configuration whose engine failed; the others of the run go on."""
        gh.log(f"configuration {member['spec']} (round {rnd}) FAILED: {err}")
        self.failed[member["label"].removeprefix("bench-")] = str(err)[-2000:]


def suite_engine(args: argparse.Namespace, **overrides) -> dict:
    """gpu_harness's engine settings with this run's pipeline parallel size (and room for
    --streams' largest batch, and --ttft-32k's prompt)."""
    if args.pp_size > 1:
        overrides["pipeline_parallel_size"] = args.pp_size
    if args.streams:
        overrides = {**bench_streams.engine_overrides(args.streams), **overrides}
    if args.ttft_32k:
        overrides.setdefault("max_model_len", LONG_MODEL_LEN)
    return gh.engine(**overrides)


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
    +stage) to `env`."""
    if "stage" in variant:
        env["VLLM_EXPERT_PREFILL_STAGING"] = "1"
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


def _unit_from_runs(
    suite: Suite,
    collected: Collected,
    members: list[dict],
    base_label: str,
    group: int,
) -> tuple[dict[str, dict], dict | None]:
    """A unit's engine results found in --from-runs: (results by spec, the unit's unpatched
    engine's result, None without); members without a result are listed as not run."""
    folder = suite.args.from_runs
    got: dict[str, dict] = {}
    base_res = _from_runs(folder, base_label) if group else None
    for m in members:
        res = _from_runs(folder, m["label"])
        if res is None or (group and base_res is None):
            collected.not_run.append(m["label"].removeprefix("bench-"))
            continue
        collected.ran_model = res.pop("ran_model", None) or collected.ran_model
        got[m["spec"]] = res
    return got, base_res


def _run_group_unit(
    suite: Suite,
    collected: Collected,
    members: list[dict],
    base_label: str,
    rnd: int,
) -> tuple[dict[str, dict], dict | None]:
    """Run a unit's engines side by side with one unpatched engine, all taking turns request
    by request: (results by spec, the unpatched engine's result, None if it failed)."""
    args = suite.args
    base_config = {
        "model": str(args.model),
        "env": {},
        "engine": suite_engine(args),
        "tasks": suite.tasks,
    }
    side = [(base_label, base_config, False, None)] + [
        (m["label"], m["run_config"], m["patched"], m["tree"]) for m in members
    ]
    # the first unit fills a cold compile cache with one engine of each kind before
    # the others start (vLLM's cache index is not written atomically): the
    # unpatched engine and the members up to the first patched one
    first_patched = next((i for i, m in enumerate(members) if m["patched"]), 0)
    stagger = 0 if collected.units_run else 2 + first_patched
    collected.units_run += 1
    try:
        # a unit that hangs is cut off alone; the run's other units still run
        outs = gh.run_engine_group(side, timeout=args.unit_timeout_s, stagger=stagger)
    except subprocess.TimeoutExpired as e:
        outs = [RuntimeError(str(e))] * len(side)
    base_res = None if isinstance(outs[0], Exception) else outs[0]
    got: dict[str, dict] = {}
    for m, out in zip(members, outs[1:], strict=True):
        # one configuration failing must not lose the others of the run; without
        # its unpatched partner none of the unit has a ratio
        err = out if isinstance(out, Exception) else outs[0]
        if isinstance(err, Exception):
            collected.fail(m, rnd, err)
        else:
            got[m["spec"]] = out
    return got, base_res


def _run_alone(collected: Collected, member: dict, rnd: int) -> dict[str, dict]:
    """Run one configuration's engine alone: its result by spec (empty if it failed)."""
    m = member
    try:
        return {m["spec"]: gh.run_engine(m["label"], m["run_config"], m["patched"], tree=m["tree"])}
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        collected.fail(m, rnd, e)
        return {}


def _keep_unit_base(
    collected: Collected,
    base_res: dict,
    members: list[dict],
    got: dict[str, dict],
    unit: list[str],
    rnd: int,
) -> None:
    """Keep a unit's unpatched engine as the round's unpatched row, or (second and later
    units of a round) as a row of its own beside its configurations."""
    base_res["spec"] = dict(config="unpatched", variant="", tree=None, per_layer=None)
    base_res["host_reads_per_token"] = {w: 0.0 for w in ("fresh", "repeat")}
    base_res["partner_of"] = [m["spec"] for m in members if m["spec"] in got]
    if collected.results.setdefault(("unpatched", rnd), base_res) is not base_res:
        label = f"unpatched (beside {', '.join(unit)})"
        collected.results[(label, rnd)] = base_res
        collected.unit_bases += [label] if label not in collected.unit_bases else []


def _keep_member(
    suite: Suite, collected: Collected, m: dict, res: dict, base_res: dict | None, rnd: int
) -> None:
    """Keep one configuration's result with its host reads per token of each workload
    (from where its engine really put host experts)."""
    plan, name, per_layer, placed = suite.plan, m["name"], m["per_layer"], m["placed"]
    if base_res is not None:
        res["paired_base"] = base_res
    res.setdefault("engine_args", m["run_config"]["engine"])
    mem = res["memory"]
    if name.startswith("offload-0") and name != "offload-01":
        suite.host_bytes.setdefault(per_layer, mem["expert_host_bytes"])
    share = None
    if name == "cpu-offload-gb":
        placed, share = _uva_placement(mem, plan.geometry.num_layers, suite.every)
    placed = _one_table_placement(mem, placed)
    res["host_reads_per_token"] = {}
    for workload, ps in (("fresh", suite.prompts), ("repeat", suite.repeat_prompts)):
        if f"{workload}_tokens" not in res["tasks"]:  # a run made before this workload
            continue
        outs = [o["token_ids"] for o in res["tasks"][f"{workload}_tokens"]["outputs"]]
        res["host_reads_per_token"][workload] = host_reads_per_token(plan, ps, outs, placed, share)
    res["spec"] = {
        "config": name,
        "variant": m["variant"],
        "tree": m["tree"],
        "per_layer": per_layer,
    }
    collected.results[(m["spec"], rnd)] = res


def run_unit(suite: Suite, collected: Collected, rnd: int, unit: list[str], group: int) -> None:
    """Run (or, --from-runs, find) one unit's engines and keep their results."""
    members = [prepare(suite, spec, rnd) for spec in unit]
    in_round = f"-r{rnd}" if rnd > 1 else ""
    base_label = f"bench-unpatched-for-{'+'.join(map(spec_slug, unit))}{in_round}"
    base_res = None
    if suite.args.from_runs:
        got, base_res = _unit_from_runs(suite, collected, members, base_label, group)
    elif group:
        got, base_res = _run_group_unit(suite, collected, members, base_label, rnd)
    else:
        (m,) = members
        got = _run_alone(collected, m, rnd)
    if base_res is not None and got:
        _keep_unit_base(collected, base_res, members, got, unit, rnd)
    for m in members:
        if m["spec"] in got:
            _keep_member(suite, collected, m, got[m["spec"]], base_res, rnd)


def _machines(results: dict) -> list[dict]:
    """The hosts the engines ran on, each once, where recorded."""
    machines: list[dict] = []
    for res in results.values():
        if res.get("machine") and res["machine"] not in machines:
            machines.append(res["machine"])
    return machines


def base_of(results: dict, spec: str, rnd: int, unit_bases: list[str]) -> dict | None:
    """The unpatched engine a configuration's ratios are taken against: a unit's unpatched
    engine is its own baseline; others, the engine paired with them, else the round's."""
    res = results[(spec, rnd)]
    if spec in unit_bases:
        return res
    return res.get("paired_base") or results.get(("unpatched", rnd))


def collect_runs(
    results: dict, specs: list[str], unit_bases: list[str], rounds: int, host_read_us
) -> list[dict]:
    """The report's rows, per configuration and workload: ratios against the paired
    unpatched engine, else within the round, merged over the rounds."""
    runs = []
    for spec in specs + unit_bases:
        for workload in ("fresh", "repeat"):
            per_round = []
            for rnd in range(1, rounds + 1):
                res = results.get((spec, rnd))
                if res is None or workload not in res["tasks"]:
                    continue
                base = base_of(results, spec, rnd, unit_bases)
                row = _run_row(res["spec"]["config"], workload, res, base, host_read_us)
                if spec != res["spec"]["config"]:
                    row["variant"] = spec
                if res["spec"]["config"] != "unpatched":
                    row["host_experts_per_layer"] = res["spec"]["per_layer"]
                row.update(agreement(res, base, workload))
                row.update(prefill_agreement(res, base))
                per_round.append(row)
            if per_round:
                runs.append(merge_rounds(per_round) if rounds > 1 else per_round[0])
    return runs


def result_doc(
    suite: Suite,
    collected: Collected,
    specs: list[str],
    earlier: dict | None,
    argv: list[str] | None,
) -> dict:
    """The run's result in the project's format (the JSON that --out names)."""
    args, results = suite.args, collected.results
    doc = {
        "suite": "bench-offload",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "command": "scripts/bench-offload " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": {
            "path": collected.ran_model,
            "geometry": suite.plan.geometry.__dict__,
            "quantization": "gptq-int4 (Marlin MoE)",
            "host_experts_per_layer": args.host_experts_per_layer,
        },
        "engine": gh.BASE_ENGINE,
        "host_read_us": args.host_read_us,
        "rounds": args.rounds,
        # the hosts the engines ran on (CPU, driver, PCIe link, clocks), where recorded
        "machines": _machines(results),
        "copy_gbps": args.copy_gbps,
        "runs": collect_runs(results, specs, collected.unit_bases, args.rounds, args.host_read_us),
        # the decide kernel alone, inside one engine (--decide-ab): TPOT ratio per pair
        "decide_ab": {
            f"{spec} (round {rnd})": res["tasks"]["decide_ab"]
            for (spec, rnd), res in results.items()
            if "decide_ab" in res["tasks"]
        },
        "profiles": profiles(results),
        "streams": bench_streams.rows(
            [
                (spec, results[(spec, 1)], base_of(results, spec, 1, collected.unit_bases))
                for spec in specs + collected.unit_bases
                if (spec, 1) in results
            ]
        ),
        "not_run": collected.not_run,
        "failed": collected.failed,
    }
    prefill_bound.annotate(doc["runs"], args.copy_gbps)
    if earlier is not None:
        doc["reproduction"] = {
            "against": str(args.compare_with),
            "against_date": earlier.get("date"),
            "rows": reproduction(doc, earlier),
        }
    if args.from_runs:
        doc["engine_runs_command"] = args.ran_as
        doc["date"] = f"{args.ran_at or 'unknown'} (report assembled {doc['date']})"
        doc["gpu"] = doc["gpu"] if doc["gpu"] != "unknown" else "NVIDIA H200 (from the runs)"
    return doc


def write_report(doc: dict, out: pathlib.Path) -> None:
    """The JSON, its markdown table and (with matplotlib) its plots."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    try:
        from .bench.report import plot

        plot(doc, out.with_suffix(".png"))
        if plot_sweep(doc, out.with_suffix(".sweep.png")):
            gh.log(f"wrote the sweep's plot {out.with_suffix('.sweep.png')}")
        if prefill_bound.plot(doc, out.with_suffix(".prefill.png")):
            gh.log(f"wrote the prefill plot {out.with_suffix('.prefill.png')}")
        if bench_streams.plot(doc, out.with_suffix(".streams.png")):
            gh.log(f"wrote the many-streams plot {out.with_suffix('.streams.png')}")
    except ImportError:
        gh.log("no plot: matplotlib is not installed")
    gh.log(f"wrote {out} and its .md table (and .png plot)")


def main(argv: list[str] | None = None) -> int:
    args, earlier = parse_args(argv)
    suite = make_suite(args)
    collected = Collected(ran_model=args.model.name)
    specs = suite_specs(args, suite.plan.geometry.num_experts)
    group = 1 if args.paired else args.group  # 0: every configuration alone
    for rnd, unit in run_units(specs, args.rounds, group):
        run_unit(suite, collected, rnd, unit, group)
    write_report(result_doc(suite, collected, specs, earlier, argv), args.out)
    failed = collected.failed
    if failed:  # the report keeps what ran; the exit status says that not everything did
        gh.log(f"{len(failed)} configuration(s) failed: {', '.join(failed)}")
        return 1
    return 0


def _from_runs(folder: pathlib.Path, label: str) -> dict | None:
    """The engine run `label` of a suite run in `folder` (None: not there), with the model it
    really ran as "ran_model" where its config says. Raw runs may be gzip-compressed."""
    # bench-<slug>-<16 hex>.json exactly: offload-03's must not match offload-03-swap's
    pattern = re.compile(rf"({re.escape(label)}-[0-9a-f]{{16}})\.json(\.gz)?")
    found = [f for f in sorted(folder.iterdir()) if pattern.fullmatch(f.name)]
    if len(found) > 1:
        raise SystemExit(
            f"{folder} holds {len(found)} engine runs of {label}: keep the one of this "
            "suite run only"
        )
    if not found:
        return None
    res = json.loads(_read_maybe_gzip(found[0]))
    stem = pattern.fullmatch(found[0].name).group(1)
    for c in (folder / f"{stem}.config.json", folder / f"{stem}.config.json.gz"):
        if c.exists():
            config = json.loads(_read_maybe_gzip(c))
            res["ran_model"] = pathlib.Path(config["model"]).name
            res["engine_args"] = config.get("engine")
            break
    return res


def _read_maybe_gzip(path: pathlib.Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode()


def profile_task(prompts: list, decode_tokens: int) -> dict:
    """engine_probe's decode_profile on the first two fresh prompts."""
    return {
        "kind": "decode_profile",
        "name": "profile",
        "prompts": prompts[:2],
        "max_tokens": decode_tokens,
    }


def _uva_placement(
    mem: dict, num_layers: int, every: set[int]
) -> tuple[dict[int, set[int]], dict[int, float] | None]:
    """Where vLLM's --cpu-offload-gb put experts: it offloads parameter by parameter, first
    layers first, and may stop inside a layer (e.g. one layer's w13 but not its w2). From
    the probe's per-layer bytes: every layer with bytes on host, weighted by its host share.
    Runs made before the probe recorded them: whole layers, rounded."""
    host, total = mem.get("expert_host_bytes_by_layer"), mem.get("expert_bytes_by_layer")
    if host and total:
        placed = {x: every for x, h in enumerate(host) if h}
        return placed, {x: host[x] / total[x] for x in placed}
    layer_bytes = (mem["expert_gpu_bytes"] + mem["expert_host_bytes"]) / max(num_layers, 1)
    whole = round(mem["expert_host_bytes"] / max(layer_bytes, 1))
    return {x: every for x in range(num_layers) if x < whole}, None


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


def profiles(results: dict) -> dict:
    """Each engine's decode profile (--profile); an unpatched partner (--paired, --group) as
    'unpatched beside CONFIG[, CONFIG...]', once."""
    out = {}
    partners = {id(r["paired_base"]) for r in results.values() if r.get("paired_base")}
    seen = set()
    for (spec, rnd), res in results.items():
        suffix = f" (round {rnd})" if rnd > 1 else ""
        if res["spec"]["config"] == "unpatched":  # listed beside its configurations if a partner
            if id(res) not in partners and "profile" in res["tasks"]:
                out["unpatched" + suffix] = res["tasks"]["profile"]
            continue
        if "profile" in res["tasks"]:
            out[spec + suffix] = res["tasks"]["profile"]
        base = res.get("paired_base")
        if base is not None and "profile" in base["tasks"] and id(base) not in seen:
            seen.add(id(base))
            beside = ", ".join(base.get("partner_of") or [spec])
            out[f"unpatched beside {beside}{suffix}"] = base["tasks"]["profile"]
    return out


def _partner_profile(profs: dict, label: str) -> dict | None:
    """The profile of the unpatched engine that ran beside `label`, else the run's own."""
    spec, _, rnd = label.partition(" (round ")
    suffix = f" (round {rnd}" if rnd else ""
    for key, prof in profs.items():
        beside = key.removeprefix("unpatched beside ")
        if suffix:
            listed = beside.removesuffix(suffix).split(", ") if beside.endswith(suffix) else []
        else:  # round 1: no round in the name
            listed = [] if " (round " in beside else beside.split(", ")
        if key != beside and spec in listed:
            return prof
    return profs.get("unpatched" + suffix) or profs.get("unpatched")


def profile_lines(doc: dict, top: int = 6) -> list[str]:
    """The --profile section of the report: per engine, wall and GPU busy time per token;
    per configuration, the kernels whose time per token differs most from its unpatched
    partner's (--paired), else from the unpatched engine's."""
    profs = doc.get("profiles") or {}
    if not profs:
        return []
    lines = [
        "",
        "Decode profiles (torch profiler, CUDA activity; the profiler slows the host, so wall "
        "times compare only with each other):",
        "",
        "| engine | tokens | wall us/token | GPU busy us/token | GPU idle "
        "| largest kernels, us/token |",
        "|---|---|---|---|---|---|",
    ]
    for label, p in profs.items():
        if "error" in p:
            first = (p["error"].strip().splitlines() or [""])[0].replace("|", "\\|")
            lines.append(f"| {label} | - | - | - | - | profile failed: {first} |")
            continue
        big = ", ".join(f"`{k['name'][:40]}` {k['us_per_token']:.1f}" for k in p["kernels"][:3])
        reads = p.get("swap_delta", {}).get("host_reads")
        if reads is not None:  # the runtime swap's counters over the task, warm-up included
            big += f"; host reads in the task: {reads}"
        lines.append(
            f"| {label} | {p['tokens']} | {p['wall_us_per_token']:.1f} | "
            f"{p['gpu_busy_us_per_token']:.1f} | {p['gpu_idle_fraction']:.1%} | {big} |"
        )
    for label, p in profs.items():
        base = _partner_profile(profs, label)
        if label.startswith("unpatched") or base is None or "error" in p or "error" in base:
            continue
        mine = {k["name"]: k["us_per_token"] for k in p["kernels"]}
        theirs = {k["name"]: k["us_per_token"] for k in base["kernels"]}
        diff = sorted(
            ((n, mine.get(n, 0.0) - theirs.get(n, 0.0)) for n in mine.keys() | theirs.keys()),
            key=lambda x: -abs(x[1]),
        )[:top]
        busy = p["gpu_busy_us_per_token"] - base["gpu_busy_us_per_token"]
        wall = p["wall_us_per_token"] - base["wall_us_per_token"]
        lines += [
            "",
            f"{label} minus unpatched: wall {wall:+.1f} us/token, GPU busy "
            f"{busy:+.1f} us/token; kernels: "
            + ", ".join(f"`{n[:60]}` {d:+.1f}" for n, d in diff)
            + ".",
        ]
    return lines


def decide_ab_task(prompts: list, decode_tokens: int, repeats: int) -> dict:
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


def merge_rounds(rows: list[dict]) -> dict:
    """One configuration x workload over several rounds: every repeat kept, medians of the
    per-round percentiles, and the ratio to unpatched as the median of the per-round
    ratios (each against the unpatched run of its own round) with their range."""
    out = dict(rows[0])

    def med(key: str) -> float:
        return float(np.median([r[key] for r in rows if r.get(key) is not None]))

    out["decode_tok_s"] = [x for r in rows for x in r["decode_tok_s"]]
    out["tpot_ms_by_request"] = [x for r in rows for x in r.get("tpot_ms_by_request", [])]
    for k in ("tpot_ms_p50", "tpot_ms_p90", "ttft_ms", "startup_s", "peak_vram_gib"):
        out[k] = med(k)
    out["peak_host_gib"] = max(r["peak_host_gib"] for r in rows)
    merged = [r.get("one_table_layers") for r in rows]
    if None not in merged:  # the round furthest from its configuration's path
        out["one_table_layers"] = (min if out["config"].startswith("offload-03") else max)(merged)
    for k in ("host_reads_per_token", "swaps_per_token"):
        out[k] = float(np.mean([r[k] for r in rows]))
    out["ttft_2k_ms"] = [x for r in rows for x in r["ttft_2k_ms"]]
    out["ttft_8k_ms"] = [x for r in rows for x in r["ttft_8k_ms"]]
    if all(r.get("ttft_32k_ms") for r in rows):
        out["ttft_32k_ms"] = [x for r in rows for x in r["ttft_32k_ms"]]
    out["itl_samples"] = sum(r["itl_samples"] for r in rows)
    ratios = [r["decode_vs_unpatched"] for r in rows if r.get("decode_vs_unpatched")]
    out["decode_vs_unpatched_rounds"] = ratios
    out["decode_vs_unpatched"] = float(np.median(ratios)) if ratios else None
    by_repeat = [x for r in rows for x in r.get("decode_vs_unpatched_by_repeat") or []]
    out.pop("decode_vs_unpatched_by_repeat", None)
    out.pop("decode_vs_unpatched_range", None)
    if by_repeat:
        out["decode_vs_unpatched_by_repeat"] = by_repeat
        out["decode_vs_unpatched_range"] = [min(by_repeat), max(by_repeat)]
    bounds = [r["tpot_vs_bound"] for r in rows if r.get("tpot_vs_bound")]
    out["tpot_vs_bound"] = float(np.median(bounds)) if bounds else None
    if out.get("physical_bound_tpot_ms") is not None:
        out["physical_bound_tpot_ms"] = med("physical_bound_tpot_ms")
    for same, worst in (
        ("sequences_identical_to_unpatched", "decode_logprob_max_abs_diff"),
        ("ttft_first_tokens_identical_to_unpatched", "ttft_first_logprob_max_abs_diff"),
    ):
        if all(same in r for r in rows):  # "a/b" per round: summed; the worst difference
            counts = [tuple(map(int, r[same].split("/"))) for r in rows]
            out[same] = f"{sum(a for a, _ in counts)}/{sum(b for _, b in counts)}"
            out[worst] = max(r[worst] for r in rows)
    if all("ttft_first_logprob_unpatched_spread" in r for r in rows):
        out["ttft_first_logprob_unpatched_spread"] = max(
            r["ttft_first_logprob_unpatched_spread"] for r in rows
        )
    if any("divergences" in r for r in rows):
        out["divergences"] = [d for r in rows for d in r.get("divergences", [])]
    out["rounds"] = len(rows)
    return out


def spec_slug(spec: str) -> str:
    """A file-name-safe form of a --configs entry (cache and raw-run file names)."""
    name, variant, tree, per_layer = parse_spec(spec)
    slug = name + (f"-h{per_layer}" if per_layer else "") + (f"+{variant}" if variant else "")
    if tree:
        slug += "@" + hashlib.sha256(tree.encode()).hexdigest()[:8]
    return slug


def agreement(res: dict, base: dict | None, workload: str) -> dict:
    """Greedy tokens and their logprobs against the unpatched run of the same suite run: a
    correctness check riding along with the speed numbers."""
    task = f"{workload}_tokens"
    if base is None or task not in res["tasks"] or task not in base["tasks"]:
        return {}
    same, total, worst, diverged = 0, 0, 0.0, []
    outputs = zip(res["tasks"][task]["outputs"], base["tasks"][task]["outputs"], strict=True)
    for i, (a, b) in enumerate(outputs):
        total += 1
        d = divergence(a, b)
        if d is None:
            same += 1
        else:
            diverged.append({"prompt": i, **d})
        # logprobs of the tokens both chose, up to where they part
        agreed = d["at"] if d else len(a["token_ids"])
        for p, q in zip(a["logprobs"][:agreed], b["logprobs"][:agreed], strict=False):
            worst = max(worst, abs(p - q))
    return {
        "sequences_identical_to_unpatched": f"{same}/{total}",
        "decode_logprob_max_abs_diff": worst,
        "divergences": diverged,
    }


def divergence(a: dict, b: dict) -> dict | None:
    """Where greedy output `a` first leaves the unpatched engine's `b`: the token index,
    both tokens and each engine's logprob of its own token there. Two logprobs a few 1e-4
    apart are a near tie that a rounding difference flipped; a wrong expert row leaves the
    unpatched token far behind. None where the outputs are the same."""
    ta, tb = a["token_ids"], b["token_ids"]
    at = next((k for k, (t, u) in enumerate(zip(ta, tb, strict=False)) if t != u), None)
    if at is None:
        if len(ta) == len(tb):
            return None
        return {"at": min(len(ta), len(tb)), "of": len(tb)}  # one stopped early
    return {
        "at": at,
        "of": len(tb),
        "token": ta[at],
        "unpatched_token": tb[at],
        "logprob": a["logprobs"][at],
        "unpatched_logprob": b["logprobs"][at],
    }


def prefill_agreement(res: dict, base: dict | None) -> dict:
    """The first token of every TTFT prompt (2k, 8k, 32k, every repeat) against the
    unpatched engine's: the check on what prefill staging computed, whose prompts the
    decode workloads' short ones never reach. Empty for runs made before it was kept."""
    if base is None or res is base:
        return {}
    same = total = 0
    worst = spread = 0.0
    for name, task in res["tasks"].items():
        theirs = base["tasks"].get(name, {}).get("first_tokens")
        if not name.startswith("ttft_") or not task.get("first_tokens") or not theirs:
            continue
        for a, b in zip(task["first_tokens"], theirs, strict=True):
            total += 1
            if a["token_id"] == b["token_id"]:
                same += 1
                worst = max(worst, abs(a["logprob"] - b["logprob"]))
        spread = max(spread, _logprob_spread(theirs))
    if not total:
        return {}
    return {
        "ttft_first_tokens_identical_to_unpatched": f"{same}/{total}",
        "ttft_first_logprob_max_abs_diff": worst,
        "ttft_first_logprob_unpatched_spread": spread,
    }


def _logprob_spread(first_tokens: list[dict]) -> float:
    """How far the unpatched engine's own logprobs of one prompt's first token lie apart
    over its repeats (same token only): the yardstick for a patched engine's difference,
    since a long prompt's prefill need not repeat itself bit for bit."""
    by_token: dict[int, list[float]] = {}
    for t in first_tokens:
        by_token.setdefault(t["token_id"], []).append(t["logprob"])
    return max((max(v) - min(v) for v in by_token.values()), default=0.0)


def divergence_lines(doc: dict) -> list[str]:
    """Where each configuration's greedy tokens leave its unpatched engine's: the first
    differing token of each such output, a divergence that repeated prompts share once."""
    out = []
    for r in doc["runs"]:
        seen: dict[tuple, tuple[str, list[int]]] = {}  # divergence -> (text, its prompts)
        for d in r.get("divergences") or []:
            key = tuple(d.get(k) for k in ("at", "of", "token", "unpatched_token"))
            if key not in seen:
                what = f"token {d['at']} of {d['of']}"
                if "token" in d:
                    what += (
                        f": {d['token']} (logprob {d['logprob']:.4f}) against unpatched "
                        f"{d['unpatched_token']} ({d['unpatched_logprob']:.4f}), "
                        f"{abs(d['logprob'] - d['unpatched_logprob']):.4f} apart"
                    )
                seen[key] = (what, [])
            seen[key][1].append(d["prompt"])
        label = f"{r.get('variant', r['config'])}, {r['workload']}"
        for what, prompts in seen.values():
            which = ", ".join(map(str, prompts))
            out.append(f"- {label}, prompt{'s' * (len(prompts) > 1)} {which}: {what}")
    if not out:
        return []
    head = "Where greedy tokens differ from the unpatched engine's (first differing token):"
    return ["", head, *out]


def prefill_agreement_lines(doc: dict) -> list[str]:
    """One sentence: each configuration's first tokens of the TTFT prompts against the
    unpatched engine's."""
    rows = [
        r
        for r in doc["runs"]
        if r["workload"] == "fresh" and r.get("ttft_first_tokens_identical_to_unpatched")
    ]
    if not rows:
        return []

    def one(r: dict) -> str:
        text = (
            f"{r.get('variant', r['config'])} {r['ttft_first_tokens_identical_to_unpatched']} "
            f"(logprob max |diff| {r['ttft_first_logprob_max_abs_diff']:.4f}"
        )
        if r.get("ttft_first_logprob_unpatched_spread") is not None:
            text += f"; unpatched's own repeats {r['ttft_first_logprob_unpatched_spread']:.4f}"
        return text + ")"

    each = "; ".join(one(r) for r in rows)
    return [
        "",
        "First token of every TTFT prompt (each prompt length, every repeat and the "
        f"warm-up), identical to its unpatched engine's: {each}.",
    ]


def _vram_bytes(mem: dict) -> int:
    """The engine process's VRAM where the driver reported it, else the device's used memory
    (the earliest runs of 2026-12-01 have only that)."""
    return mem.get("process_vram_bytes") or mem["device_used_bytes"]


def _run_row(
    name: str, workload: str, res: dict, base: dict | None, host_read_us: float | None = None
) -> dict:
    """One configuration x workload in the project's result format, with its physical bound
    when the cost of one host read is known: the unpatched TPOT plus the host reads it must
    make per token, each at that cost (TPOT here is the median inter-token time)."""
    dec = res["tasks"][workload]
    mem = res["memory"]
    total = mem["expert_gpu_bytes"] + mem["expert_host_bytes"]
    delta = dec.get("swap_delta")
    if delta is not None and dec.get("decoded_all"):  # runtime swap: its own counters
        reads = delta["host_reads"] / dec["decoded_all"]
        swaps = delta["swaps"] / dec["decoded_all"]
        source = "the runtime swap's counters (decode tokens, warm-up included)"
    else:
        reads = res["host_reads_per_token"].get(workload, float("nan"))
        swaps = 0.0
        source = "planted routing of the decoded tokens"
    ref = base["tasks"].get(workload) if base else None
    bound = None
    if ref is not None and host_read_us is not None and reads == reads:  # not NaN
        bound = ref["tpot_ms_p50"] + reads * host_read_us / 1e3
    return {
        "config": name,
        "workload": workload,
        "host_fraction": mem["expert_host_bytes"] / total if total else 0.0,
        "decode_tok_s": dec["decode_tok_s"],
        "tpot_ms_p50": dec["tpot_ms_p50"],
        "tpot_ms_p90": dec["tpot_ms_p90"],
        # every request's TPOT (prompts x repeats): the spread within one engine
        "tpot_ms_by_request": [x["tpot_ms"] for x in dec.get("runs", []) if "tpot_ms" in x],
        "ttft_ms": dec["ttft_ms"],
        "ttft_2k_ms": res["tasks"]["ttft_2k"]["ttft_ms"],
        "ttft_8k_ms": res["tasks"]["ttft_8k"]["ttft_ms"],
        "ttft_32k_ms": res["tasks"].get("ttft_32k", {}).get("ttft_ms"),
        "host_reads_per_token": reads,
        "host_reads_source": source,
        "swaps_per_token": swaps,
        "startup_s": res["startup_s"],
        "peak_vram_gib": _vram_bytes(mem) / GiB,
        "vram_source": (
            "this engine's process (driver accounting, after load and graph capture)"
            if mem.get("process_vram_bytes")
            else "the whole device (after load; with --paired or --group, every engine on it)"
        ),
        "peak_host_gib": mem["host_peak_rss_bytes"] / GiB,
        "expert_host_gib": mem["expert_host_bytes"] / GiB,
        "expert_gpu_gib": mem["expert_gpu_bytes"] / GiB,
        "moe_layers": mem.get("moe_layers"),
        "one_table_layers": mem.get("one_table_layers"),
        "itl_samples": dec["itl_samples"],
        "physical_bound_tpot_ms": bound,
        "tpot_vs_bound": dec["tpot_ms_p50"] / bound if bound else None,
        "decode_vs_unpatched": (
            np.median(dec["decode_tok_s"]) / np.median(ref["decode_tok_s"]) if ref else None
        ),
        **_repeat_ratios(dec["decode_tok_s"], ref["decode_tok_s"] if ref else None),
        **prefill_bound.row_fields(res, base),
        "census_vs_unpatched": census_diff(
            mem.get("census"), base["memory"].get("census") if base else None
        ),
        "alloc_sites_vs_unpatched": sites_diff(
            mem.get("alloc_sites"), base["memory"].get("alloc_sites") if base else None
        ),
        "vram_saved": vram_saved(mem, base["memory"] if base else None),
    }


def vram_saved(mem: dict, base: dict | None) -> dict | None:
    """What a configuration saves in VRAM against its unpatched engine, beside the expert
    bytes it placed on host: the process's VRAM (the driver's), torch's allocated and
    reserved bytes, and, where the probe recorded them, how far the expert weights'
    allocator blocks exceed their tensors' bytes in each engine (torch counts whole
    blocks) and the free bytes each engine's allocator strands in partly used segments
    (the process's VRAM counts them, torch's allocated bytes do not)."""
    if base is None or base is mem or not mem.get("expert_host_bytes"):
        return None
    out = {
        "host_bytes": mem["expert_host_bytes"],
        "process_vram": _vram_bytes(base) - _vram_bytes(mem),
    }
    # one table's expert rows live in VMM ranges, outside torch's allocator
    if not mem.get("one_table_layers") and "torch_allocated_bytes" in mem.keys() & base.keys():
        out["torch_allocated"] = base["torch_allocated_bytes"] - mem["torch_allocated_bytes"]
    if not mem.get("one_table_layers") and "torch_reserved_bytes" in mem.keys() & base.keys():
        out["torch_reserved"] = base["torch_reserved_bytes"] - mem["torch_reserved_bytes"]
    if "stranded_free" in mem.keys() & base.keys():
        out["stranded_free"] = mem["stranded_free"]["stranded_bytes"]
        out["unpatched_stranded_free"] = base["stranded_free"]["stranded_bytes"]
        top = mem["stranded_free"].get("top")
        if top and top[0].get("live"):
            out["stranded_worst_segment"] = top[0]
    mine, theirs = mem.get("weight_blocks"), base.get("weight_blocks")
    if mine and theirs:
        out["expert_block_slack"] = expert_block_slack(mine)
        out["unpatched_expert_block_slack"] = expert_block_slack(theirs)
    return out


def vram_saved_lines(doc: dict) -> list[str]:
    """One line per configuration with experts on host: the VRAM it saved against the
    bytes it placed there (the target is within 2%), and the block slack where
    recorded."""
    lines = []
    for r in doc["runs"]:
        saved = r.get("vram_saved")
        if r["workload"] != "fresh" or not saved:
            continue
        host, pv = saved["host_bytes"], saved["process_vram"]
        parts = [f"{pv:,} B of the process's VRAM ({pv / host:.1%})"]
        if "torch_allocated" in saved:
            ta = saved["torch_allocated"]
            parts.append(f"{ta:,} B of torch's allocated bytes ({ta / host:.1%})")
        if "torch_reserved" in saved:
            tr = saved["torch_reserved"]
            parts.append(f"{tr:,} B of its reserved bytes ({tr / host:.1%})")
        line = (
            f"VRAM saved by {r.get('variant', r['config'])} for {host:,} B of experts on "
            f"host: {'; '.join(parts)}."
        )
        if "expert_block_slack" in saved:
            line += (
                f" Its expert weights' allocator blocks hold {saved['expert_block_slack']:,} B "
                f"more than their tensors asked for (unpatched: "
                f"{saved['unpatched_expert_block_slack']:,} B)."
            )
        if "stranded_free" in saved:
            line += (
                f" Free memory the allocator holds in segments it cannot give back: "
                f"{saved['stranded_free']:,} B (unpatched: "
                f"{saved['unpatched_stranded_free']:,} B)."
            )
        worst = saved.get("stranded_worst_segment")
        if worst:
            beside = ", ".join(
                f"{b['name'] or 'a tensor'} ({b['bytes']:,} B)" for b in worst["live"]
            )
            line += (
                f" The worst segment, {worst['segment_bytes']:,} B, has "
                f"{worst['free_bytes']:,} B free beside {beside}."
            )
        lines += ["", line]
    return lines


def census_diff(mine: dict | None, base: dict | None, top: int = 8) -> dict | None:
    """What an engine holds on the GPU beside its weights that its unpatched engine does
    not (both from the probe's census): the difference of the totals, and the tensor
    groups (shape, dtype) of which it holds more, largest first."""
    return _groups_diff(mine, base, lambda g: (tuple(g["shape"]), g["dtype"]), top)


def sites_diff(mine: dict | None, base: dict | None, top: int = 8) -> dict | None:
    """The same for the allocation sites (EO_ALLOC_HISTORY=1): the code locations at which
    an engine holds more GPU memory beside its weights than its unpatched engine."""
    return _groups_diff(mine, base, lambda g: g["site"], top)


def _groups_diff(mine: dict | None, base: dict | None, key, top: int) -> dict | None:
    if not mine or not base or mine is base:
        return None
    theirs = {key(g): g for g in base["top"]}
    extra = []
    for g in mine["top"]:
        if _aliased(g):
            continue
        other = theirs.get(key(g), {"count": 0, "bytes": 0})
        if g["bytes"] > other["bytes"]:
            extra.append(
                {**g, "count": g["count"] - other["count"], "bytes": g["bytes"] - other["bytes"]}
            )
    extra.sort(key=lambda g: -g["bytes"])
    aliased = sum(g["bytes"] for g in mine["top"] if _aliased(g))
    delta = mine["other_bytes"] - aliased - base["other_bytes"]
    return {"other_bytes_delta": delta, "extra": extra[:top]}


def _aliased(group: dict) -> bool:
    """A census group that only alias ranges hold (prefill staging's second address of a
    one-table layer's VRAM): memory the table and the slots already count. The probe
    leaves these out since it learned of them; runs made before list them."""
    held = group.get("held_by") or []
    return bool(held) and all(h.startswith("AliasRange.") for h in held)


def census_lines(doc: dict, threshold: int = 1 << 20) -> list[str]:
    """One line per configuration that holds more than ``threshold`` bytes beside its
    weights over its unpatched engine, naming the largest extra tensor groups; one more
    naming the code that allocated them where the engines recorded it."""
    lines = []

    def tensors(g: dict) -> str:
        held = f", held by {', '.join(g['held_by'])}" if g.get("held_by") else ""
        return f"{g['count']} x {g['dtype']}{g['shape']} ({g['bytes'] / 1e6:.1f} MB{held})"

    def site(g: dict) -> str:
        return f"{g['site']} ({g['count']:+d} blocks, {g['bytes'] / 1e6:.1f} MB)"

    kinds = [
        (
            "census_vs_unpatched",
            tensors,
            "Beside its weights, {name} holds {mb:.1f} MB more GPU memory in tensors than "
            "its unpatched engine: {what}.",
            "no single group of tensors stands out",
        ),
        (
            "alloc_sites_vs_unpatched",
            site,
            "Allocated beside its weights, {name} holds {mb:.1f} MB more than its unpatched "
            "engine, made at: {what}.",
            "no single site stands out",
        ),
    ]
    for field, fmt, sentence, nothing in kinds:
        for r in doc["runs"]:
            diff = r.get(field)
            if r["workload"] != "fresh" or not diff or diff["other_bytes_delta"] <= threshold:
                continue
            what = "; ".join(fmt(g) for g in diff["extra"][:4]) or nothing
            name = r.get("variant", r["config"])
            lines += ["", sentence.format(name=name, mb=diff["other_bytes_delta"] / 1e6, what=what)]
    return lines


def _repeat_ratios(mine: list[float], theirs: list[float] | None) -> dict:
    """Repeat i against the unpatched engine's repeat i, and their range: the spread a
    ratio carries. With --paired or --group the two repeats ran interleaved, request by
    request; otherwise one after the other."""
    if not theirs or len(mine) != len(theirs):
        return {}
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {
        "decode_vs_unpatched_by_repeat": ratios,
        "decode_vs_unpatched_range": [min(ratios), max(ratios)],
    }


def reproduction(doc: dict, previous: dict) -> list[dict]:
    """Each configuration x workload of `doc` against the same row of an earlier run of the
    suite (a second run should reproduce each ratio within the spread the first reports).
    A row is reproduced when this run's ratio lies within the earlier run's per-repeat
    range; rows without a range on both sides, or whose engines ran different paths (one
    table on a different number of layers), are listed, undecided."""

    def rows(d: dict) -> dict:
        return {
            (r.get("variant", r["config"]), r["workload"]): r
            for r in d["runs"]
            if r["config"] != "unpatched" and r.get("decode_vs_unpatched") is not None
        }

    before, now = rows(previous), rows(doc)
    out = []
    for key in [k for k in now if k in before]:
        a, b = before[key], now[key]
        lo_hi = a.get("decode_vs_unpatched_range")
        within = None if not lo_hi else bool(lo_hi[0] <= b["decode_vs_unpatched"] <= lo_hi[1])
        paths = a.get("one_table_layers"), b.get("one_table_layers")
        differ = None not in paths and paths[0] != paths[1]
        out.append(
            {
                "config": key[0],
                "workload": key[1],
                "before": a["decode_vs_unpatched"],
                "before_range": lo_hi,
                "now": b["decode_vs_unpatched"],
                "now_range": b.get("decode_vs_unpatched_range"),
                "reproduced": None if differ else within,
                "baseline_off": [baseline_offset(previous, a), baseline_offset(doc, b)],
                **({"one_table_layers": list(paths)} if differ else {}),
            }
        )
    return out


def baseline_offset(doc: dict, row: dict) -> float | None:
    """How far the unpatched engine that ``row``'s ratio divides by decoded from the median
    of ``doc``'s unpatched engines (same workload), as a fraction: -0.23 for the slow
    group-1 engine of one 2026-12-01 run. Its speed is the row's median over its ratio, so
    rows of runs made before rows named their baseline work too. None with fewer than two
    unpatched engines to compare."""
    ratio, mine = row.get("decode_vs_unpatched"), row.get("decode_tok_s")
    bases = [v[row["workload"]] for v in unpatched_speeds(doc).values() if row["workload"] in v]
    if not ratio or not mine or len(bases) < 2:
        return None
    return float(np.median(mine)) / ratio / float(np.median(bases)) - 1


def _ratio_cell(r: dict) -> str:
    ratio = r["decode_vs_unpatched"]
    if ratio is None:
        return "-"
    rounds = r.get("decode_vs_unpatched_rounds")
    if rounds and len(rounds) > 1:
        return f"{ratio:.3f}x ({min(rounds):.3f}-{max(rounds):.3f} over {len(rounds)} rounds)"
    if r.get("decode_vs_unpatched_range") and r["config"] != "unpatched":
        lo, hi = r["decode_vs_unpatched_range"]
        return f"{ratio:.3f}x (repeats {lo:.3f}-{hi:.3f})"
    return f"{ratio:.3f}x"


def reproduction_lines(doc: dict) -> list[str]:
    """The --compare-with section: each ratio beside the earlier run's, and whether it lies
    within the earlier run's per-repeat range."""
    rep = doc.get("reproduction")
    if not rep:
        return []

    def cell(ratio: float, rng: list[float] | None) -> str:
        return f"{ratio:.3f}x" + (f" ({rng[0]:.3f}-{rng[1]:.3f})" if rng else "")

    def off(x: float | None) -> str:
        flag = "**" if x is not None and abs(x) > BASELINE_TOLERANCE else ""
        return "-" if x is None else f"{flag}{x:+.0%}{flag}"

    def flagged(r: dict) -> bool:
        return any(x is not None and abs(x) > BASELINE_TOLERANCE for x in r.get("baseline_off", []))

    misses = [r for r in rep["rows"] if r["reproduced"] is False]
    lines = [
        "",
        f"Against the earlier run `{rep['against']}` ({rep['against_date']}): "
        f"{sum(r['reproduced'] is True for r in rep['rows'])} of {len(rep['rows'])} ratios "
        "within that run's per-repeat range"
        + (
            f"; {sum(flagged(r) for r in misses)} of the {len(misses)} outside it divide by an "
            f"unpatched engine more than {BASELINE_TOLERANCE:.0%} off its run's median."
            if misses
            else "."
        ),
        "",
        "| config | workload | earlier run (repeats) | this run (repeats) | within | "
        "its unpatched engine vs its run's median (earlier / this) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        verdict = {True: "yes", False: "**no**", None: "no range"}[r["reproduced"]]
        if "one_table_layers" in r:  # not the same path: no verdict
            verdict = "not the same path (one table on {} then {} layers)".format(
                *r["one_table_layers"]
            )
        base_off = r.get("baseline_off") or [None, None]
        lines.append(
            f"| {r['config']} | {r['workload']} | {cell(r['before'], r['before_range'])} | "
            f"{cell(r['now'], r['now_range'])} | {verdict} | "
            f"{off(base_off[0])} / {off(base_off[1])} |"
        )
    return lines


def path_warnings(doc: dict) -> list[str]:
    """Rows whose engine did not run the path its configuration names: a one-table
    configuration with layers that fell back to two tables (the driver refused a range,
    VRAM ran out while merging), or offload-02 with one-table layers."""
    out = []
    for r in doc["runs"]:
        n, m = r.get("one_table_layers"), r.get("moe_layers")
        if n is None or not m or r["workload"] != "fresh":
            continue
        want = m if r["config"].startswith("offload-03") else 0
        if r["config"] in ("offload-02", "offload-03", "offload-03-swap") and n != want:
            why = (
                "the engine log says why the other layers kept two tables"
                if n < want
                else "VLLM_EXPERT_ONE_TABLE was on"
            )
            out.append(
                f"WARNING: {r.get('variant', r['config'])} ran with {n} of {m} MoE layers "
                f"as one table (expected {want}): its rows are not {r['config']}'s ({why})."
            )
    return out


# how far one unpatched engine's decode speed may sit from the median of a run's unpatched
# engines before the report says so (repeats inside one engine spread by up to 10%)
BASELINE_TOLERANCE = 0.10


def unpatched_speeds(doc: dict) -> dict[str, dict[str, float]]:
    """Each unpatched engine of a run (with --group, one per unit, by its label) and its
    median decode tok/s per workload."""
    by_label: dict[str, dict[str, float]] = {}
    for r in doc["runs"]:
        if r["config"] == "unpatched" and r.get("decode_tok_s"):
            label = r.get("variant", "unpatched")
            by_label.setdefault(label, {})[r["workload"]] = float(np.median(r["decode_tok_s"]))
    return by_label


def baseline_lines(doc: dict) -> list[str]:
    """The run's unpatched engines side by side (with --group, one per unit). They run the
    same configuration, so they should agree; one that decodes well off the others' median
    lifts (or lowers) every ratio of its unit by about as much. In one run of 2026-12-01 one of
    three decoded 23% below the others for its whole life, and its unit's ratios could not be
    reproduced."""
    by_label = unpatched_speeds(doc)
    if len(by_label) < 2:
        return []
    workloads = [w for w in ("fresh", "repeat") if all(w in v for v in by_label.values())]
    if not workloads:
        return []
    medians = {w: float(np.median([v[w] for v in by_label.values()])) for w in workloads}
    spread = " / ".join(
        f"{max(v[w] for v in by_label.values()) / min(v[w] for v in by_label.values()):.2f}x"
        for w in workloads
    )
    lines = [
        "",
        f"Unpatched engines of this run, decode tok/s ({' / '.join(workloads)}): "
        + "; ".join(
            f"{label} {' / '.join(f'{v[w]:.1f}' for w in workloads)}"
            for label, v in by_label.items()
        )
        + f" ({spread} apart).",
    ]
    for label, v in by_label.items():
        for w in workloads:
            off = v[w] / medians[w] - 1
            if abs(off) > BASELINE_TOLERANCE:
                lines += [
                    "",
                    f"WARNING: {label} decoded {abs(off):.0%} "
                    f"{'below' if off < 0 else 'above'} the median of this run's unpatched "
                    f"engines on {w} prompts: the ratios against it are "
                    f"{'lifted' if off < 0 else 'lowered'} by about as much.",
                ]
    return lines


def request_lines(doc: dict) -> list[str]:
    """Every engine's per-request TPOT as mean +- standard error and range. Engines bound
    by the host's step loop vary from request to request far more than their three
    per-repeat medians show (one unpatched engine of 2026-12-01 took 1.38-2.23 ms per token
    on the same prompts), so two configurations differ only where their means do by
    more than a few standard errors."""
    rows = [r for r in doc["runs"] if len(r.get("tpot_ms_by_request") or []) > 1]
    if not rows:
        return []
    lines = [
        "",
        "Per-request TPOT (ms), every request of every repeat:",
        "",
        "| config | workload | requests | mean +- s.e. | min-max |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        t = np.asarray(r["tpot_ms_by_request"], dtype=float)
        sem = float(t.std(ddof=1)) / np.sqrt(len(t))
        lines.append(
            f"| {r.get('variant', r['config'])} | {r['workload']} | {len(t)} | "
            f"{t.mean():.3f} +- {sem:.3f} | {t.min():.2f}-{t.max():.2f} |"
        )
    return lines


def _ttft_cell(r: dict) -> str:
    """TTFT medians: 2k / 8k, and 32k where it was timed."""
    keys = ("ttft_2k_ms", "ttft_8k_ms", "ttft_32k_ms")
    return " / ".join(f"{np.median(r[k]):.1f}" for k in keys if r.get(k))


def _memory_cell(r: dict) -> str:
    """The engine's peak VRAM and host memory; the VRAM is the whole device's (marked *)
    in runs made before the probe read its own process's."""
    if r.get("peak_vram_gib") is None or r.get("peak_host_gib") is None:
        return "-"
    device = "" if str(r.get("vram_source", "")).startswith("this engine") else "*"
    return f"{r['peak_vram_gib']:.2f}{device} / {r['peak_host_gib']:.2f}"


def _bound_cell(r: dict) -> str:
    if r.get("tpot_vs_bound") is None:
        return "-"
    return f"{r['tpot_vs_bound']:.2f}x of {r['physical_bound_tpot_ms']:.3f} ms"


def markdown(doc: dict) -> str:
    """A short table of one suite run: medians of the repeats, every repeat in the JSON."""
    lines = [
        f"# {doc['suite']} on {doc['gpu']} ({doc['date']})",
        "",
        f"Command: `{doc.get('engine_runs_command') or doc['command']}`",
        "",
        "| config | workload | host fraction | same tokens as unpatched | "
        "decode tok/s (median of repeats) | "
        "TPOT p50 / p90 ms | TTFT 2k / 8k (/ 32k) ms | host reads/token | swaps/token | start-up s "
        "| peak VRAM / host GiB | vs unpatched | TPOT vs physical bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r.get('variant', r['config'])} | {r['workload']} | {r['host_fraction']:.3f} | "
            f"{r.get('sequences_identical_to_unpatched', '-')} | "
            f"{np.median(r['decode_tok_s']):.1f} "
            f"({', '.join(f'{x:.1f}' for x in r['decode_tok_s'])}) | "
            f"{r['tpot_ms_p50']:.3f} / {r['tpot_ms_p90']:.3f} | "
            f"{_ttft_cell(r)} | "
            f"{r['host_reads_per_token']:.2f} | {r['swaps_per_token']:.3f} | "
            f"{r['startup_s']:.0f} | {_memory_cell(r)} | "
            f"{_ratio_cell(r)} | {_bound_cell(r)} |"
        )
    lines += [
        "",
        "The first configuration of a run pays torch.compile and Triton JIT on a cold "
        "cache: compare start-up times between the later configurations only. Host "
        "reads per token come from the planted routing of the decoded tokens, or, with "
        "runtime swap, from its counters. Peak VRAM is the engine process's after load "
        "and graph capture (* the whole device's, in runs from before it was recorded per "
        "process); host memory is the process's peak resident set, pinned memory included.",
    ]
    for label, ab in doc.get("decide_ab", {}).items():
        lo, hi = ab["pair_ratio_range"]
        p50 = ab["tpot_ms_p50"]
        lines += [
            "",
            f"Decide kernel alone, {label}: TPOT {ab['ratio']} = {ab['pair_ratio_p50']:.3f} "
            f"(median of {len(ab['pair_ratios'])} request pairs in one engine, alternating "
            f"order; range {lo:.3f}-{hi:.3f}); TPOT p50 "
            + ", ".join(f"{n} {v:.3f} ms" for n, v in p50.items())
            + ".",
        ]
    lines += prefill_bound.lines(doc)
    lines += divergence_lines(doc)
    lines += prefill_agreement_lines(doc)
    lines += sweep_lines(doc)
    lines += bench_streams.lines(doc)
    lines += baseline_lines(doc)
    lines += request_lines(doc)
    lines += vram_saved_lines(doc)
    lines += census_lines(doc)
    lines += [x for w in path_warnings(doc) for x in ("", w)]
    lines += profile_lines(doc)
    lines += reproduction_lines(doc)
    for spec, err in doc.get("failed", {}).items():
        lines += ["", f"FAILED: {spec}: `{err.strip().splitlines()[0] if err.strip() else ''}`"]
    if doc.get("not_run"):
        lines += ["", f"Not run in this suite run: {', '.join(doc['not_run'])}."]
    return "\n".join(lines) + "\n"
