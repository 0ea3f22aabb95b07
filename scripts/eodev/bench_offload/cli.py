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
import json
import os
import pathlib

from .. import bench_streams
from .. import gpu_harness as gh
from .engines import Collected, run_unit
from .report import write_report
from .results import result_doc
from .saved_runs import read_maybe_gzip
from .suite import make_suite, run_units, suite_specs
from .workloads import LONG_MODEL_LEN


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
        help="comma-separated CONFIG[:N][+count][+churn|+hold|+fast][+stage][+prefetch][@TREE]: "
        "+count "
        "turns the usage-counting hook on, +churn makes offload-03-swap decide every decode "
        "step with no margin and a half-life of one step (and self-check every 500 "
        "decisions), +hold makes it count and decide as usual but never swap (the cost of "
        "counting and deciding alone, against offload-03), +fast makes it decide every step "
        "with a 64-step half-life and margin 1, +stage turns prefill staging on (offload-02/03), "
        "+prefetch turns decode prefetch on (offload-03 and offload-03-swap, with +stage), "
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
        earlier = json.loads(read_maybe_gzip(path))
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


def main(argv: list[str] | None = None) -> int:
    """Run (or, with --from-runs, find) every unit's engines and write the result; the exit
    status says whether every configuration ran."""
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
