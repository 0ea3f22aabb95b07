# SPDX-License-Identifier: Apache-2.0
"""The result of a bench-offload run in the project's format (the JSON that --out names):
its rows, each against the unpatched engine it is compared with, and the run's other
sections."""

from __future__ import annotations

import datetime
import sys

from .. import bench_streams
from .. import gpu_harness as gh
from ..bench import prefill_bound
from ..nvsmi import gpu_name
from .agreement import agreement, prefill_agreement
from .engines import Collected
from .profiles import profiles
from .reproduction import reproduction
from .rows import merge_rounds, run_row
from .suite import Suite


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
    results: dict,
    specs: list[str],
    unit_bases: list[str],
    rounds: int,
    host_read_us: float | None,
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
                row = run_row(res["spec"]["config"], workload, res, base, host_read_us)
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
