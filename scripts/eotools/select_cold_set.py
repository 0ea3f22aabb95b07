# SPDX-License-Identifier: Apache-2.0
"""Command line of scripts/select-cold-set: make a cold file from usage counts, or evaluate
one on held-out counts."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from .coldcheck import ColdFileError, load_cold_file
from .coldset import model_identity, write_cold_file
from .counts import CountsError, check_same_model, load_counts
from .selection import (
    GiB,
    SelectionError,
    evaluate,
    expert_bytes,
    normalised_usage,
    select_cold,
    stage_layers,
)

EPILOG = """exit codes: 0 done; 1 bad input (counts from another model, an empty or corrupt
counts file, a budget the stage cannot hold, a cold file that does not load); 2 usage.

examples:
  select-cold-set select --model /models/m --counts counts/*.json --budget-gib 3 \\
      --pp-size 2 --out cold/3GiB-per-card.json
  select-cold-set evaluate --cold cold/3GiB-per-card.json --counts heldout/*.json"""


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_select(args: argparse.Namespace) -> int:
    sets = [load_counts(p) for p in args.counts]
    identity = model_identity(args.model)
    check_same_model(sets, identity)
    num_layers = identity["num_layers"]
    usage = normalised_usage(sets, _floats(args.weights) if args.weights else None, args.phase)
    if usage.shape[0] != num_layers:
        raise SelectionError(f"counts cover {usage.shape[0]} layers, the model has {num_layers}")
    partition = [int(x) for x in args.layer_partition.split(",")] if args.layer_partition else None
    stages = stage_layers(num_layers, args.pp_size, partition)
    per_expert = args.expert_bytes or expert_bytes(args.model)
    budgets = _floats(args.budget_gib)
    cold, picks = select_cold(usage, stages, budgets, per_expert)
    data = [
        {
            "name": c.data.get("name"),
            "kind": c.data.get("kind"),
            "source": c.data.get("source"),
            "tokens": c.data.get("tokens"),
            "counted_by": c.tool,
        }
        for c in sets
    ]
    write_cold_file(
        args.out,
        cold,
        identity,
        {
            "tool": "scripts/select-cold-set select",
            "data": data,
            "weights": _floats(args.weights) if args.weights else None,
            "phase": args.phase,
            "selection": "least-used per pipeline stage by normalised, summed counts",
        },
        budget={
            "pipeline_parallel_size": args.pp_size,
            "layer_partition": [len(s) for s in stages],
            "gib_per_stage": [p.budget_bytes / GiB for p in picks],
            "bytes_per_expert": per_expert,
            "experts_per_stage": [p.experts for p in picks],
        },
    )
    for p in picks:
        print(
            f"stage {p.stage} (layers {p.layers.start}-{p.layers.stop - 1}): "
            f"{p.experts} host experts, {p.bytes / GiB:.3f} GiB of {p.budget_bytes / GiB:.3f}"
        )
    print(f"wrote {args.out}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    doc = load_cold_file(pathlib.Path(args.cold))
    cold = doc["layers"]
    sets = [load_counts(p) for p in args.counts]
    check_same_model(sets, doc["model"])
    layers, experts = sets[0].prefill.shape
    beyond = sorted(x for x in cold if x >= layers)
    if beyond or doc["model"]["num_experts"] != experts:
        what = f"layer(s) {beyond[:8]}" if beyond else f"{doc['model']['num_experts']} experts"
        raise ColdFileError(
            f"it lists {what}, but the counts cover {layers} layers x {experts} experts",
            "evaluate it on counts of the model it was made for",
        )
    print(
        f"{'data':<24} {'tokens':>8} {'host reads/token':>17} {'uniform random':>15} {'ratio':>6}"
    )
    rows = []
    for c in sets:
        e = evaluate(cold, c, args.phase)
        rows.append(e)
        print(
            f"{e.data:<24} {e.tokens:>8} {e.host_reads_per_token:>17.3f} "
            f"{e.uniform_reads_per_token:>15.3f} {e.ratio:>6.3f}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "data": e.data,
                        "tokens": e.tokens,
                        "host_reads_per_token": e.host_reads_per_token,
                        "uniform_reads_per_token": e.uniform_reads_per_token,
                        "ratio": e.ratio,
                    }
                    for e in rows
                ],
                indent=1,
            )
            + "\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="select-cold-set",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("select", help="make a cold file from counts")
    s.add_argument(
        "--model",
        type=pathlib.Path,
        required=True,
        help="the checkpoint (its config.json and safetensors headers)",
    )
    s.add_argument(
        "--counts",
        type=pathlib.Path,
        nargs="+",
        required=True,
        help="counts files, one per data set (scripts/count-experts)",
    )
    s.add_argument("--weights", help="comma-separated weight per counts file (default 1)")
    s.add_argument(
        "--budget-gib",
        required=True,
        help="host GiB per pipeline stage: one value, or one per stage",
    )
    s.add_argument("--pp-size", type=int, default=1)
    s.add_argument("--layer-partition", help="layers per stage, as VLLM_PP_LAYER_PARTITION")
    s.add_argument("--expert-bytes", type=int, help="override bytes per expert")
    s.add_argument("--phase", choices=("all", "prefill", "decode"), default="all")
    s.add_argument("--out", type=pathlib.Path, required=True)
    s.set_defaults(run=cmd_select)
    e = sub.add_parser("evaluate", help="host reads per token of a cold file on counts")
    e.add_argument("--cold", required=True)
    e.add_argument("--counts", type=pathlib.Path, nargs="+", required=True)
    e.add_argument("--phase", choices=("all", "prefill", "decode"), default="decode")
    e.add_argument("--json", help="also write the rows as JSON here")
    e.set_defaults(run=cmd_evaluate)
    args = ap.parse_args(argv)
    try:
        return args.run(args)
    except ColdFileError as err:
        print(f"error: {getattr(args, 'cold', '')}: {err}; {err.fix}", file=sys.stderr)
        return 1
    except (CountsError, SelectionError, OSError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
