# SPDX-License-Identifier: Apache-2.0
"""Budget-only start: serve a model nobody has counted yet with a host budget in GiB per card,
and learn its cold set across restarts.

Every start writes the cold file it serves with, from what the state folder knows:

- **learned**: the counting hook (VLLM_EXPERT_COUNT_FILE, which this start sets) records the
  router's picks while the server runs and rewrites its file every minute and on shutdown.
  The next start adds those counts to the folder's usage history and selects, per pipeline
  stage, the least-used experts until the budget is reached, as `select-cold-set` does.
- **initial** (no history yet): each MoE layer of a stage gets an equal share of the stage's
  budget, its highest expert ids. Without usage data every choice is a guess of the same
  expected cost (a trained MoE's expert ids say nothing about popularity); spreading the
  share evenly keeps any one layer from reading most of its experts over PCIe.

Counts from another model, or files that cannot be read, are moved to `set-aside/` with a
warning and never used. State folder layout:

    usage.json          counts of all earlier runs (expert-counts format, cold/README.md)
    run/                the counting hook's files of the current run
    set-aside/          files that did not fit the model, renamed with the time
    cold-<GiB>GiB.json  the cold file of the current start
"""

from __future__ import annotations

import datetime
import pathlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .coldset import model_identity, write_cold_file
from .counts import Counts, CountsError, check_same_model, load_counts, merge_ranks
from .selection import GiB, SelectionError, expert_bytes, select_cold, stage_layers

Log = Callable[[str], None]


@dataclass(frozen=True)
class Start:
    kind: str  # "learned" or "initial"
    cold_file: pathlib.Path
    count_file: pathlib.Path
    tokens_learned: int

    def shell(self) -> str:
        """`export` lines for the entrypoint to eval."""
        return (
            f"export VLLM_EXPERT_COLD_FILE={shlex.quote(str(self.cold_file))}\n"
            f"export VLLM_EXPERT_COUNT_FILE={shlex.quote(str(self.count_file))}\n"
        )


def initial_placement(
    stages: Sequence[range], num_experts: int, budgets_gib: Sequence[float], per_expert: int
) -> dict[int, list[int]]:
    """Per stage, the budget's experts spread evenly over the stage's layers (the first
    layers take the remainder), each layer's highest ids."""
    if len(budgets_gib) == 1:
        budgets_gib = list(budgets_gib) * len(stages)
    cold: dict[int, list[int]] = {}
    for layers, gib in zip(stages, budgets_gib, strict=True):
        n = int(gib * GiB) // per_expert
        if n >= len(layers) * num_experts:
            raise SelectionError(
                f"a budget of {gib} GiB holds {n} experts, as many as or more than layers "
                f"{layers.start}-{layers.stop - 1} have: lower the budget"
            )
        share, extra = divmod(n, len(layers))
        for i, layer in enumerate(layers):
            k = share + (1 if i < extra else 0)
            if k:
                cold[layer] = list(range(num_experts - k, num_experts))
    return cold


def fold_run_counts(state: pathlib.Path, identity: dict, log: Log) -> None:
    """Add the previous run's hook files (state/run/) to state/usage.json, or set them
    aside when they do not fit this model."""
    run = state / "run"
    files = (
        sorted(p for p in run.glob("*.json") if not p.name.startswith(".")) if run.is_dir() else []
    )
    if not files:
        return
    try:
        parts = [load_counts(p) for p in files]
        counts = merge_ranks(parts)
        check_same_model([counts], identity)
    except CountsError as e:
        _set_aside(state, files, f"the last run's counts do not fit this model: {e}", log)
        return
    usage_path = state / "usage.json"
    history = _load_history(state, identity, log)
    if history is not None and history.prefill.shape != counts.prefill.shape:
        _set_aside(state, [usage_path], "the usage history has another shape", log)
        history = None
    runs = 1 + (int(history.extra.get("runs", 0)) if history is not None else 0)
    tokens = {p: counts.tokens(p) + (history.tokens(p) if history else 0) for p in _PHASES}
    merged = Counts(
        identity,
        {"name": "served traffic", "kind": "mixed", "source": str(state), "tokens": tokens},
        counts.prefill + (history.prefill if history is not None else 0),
        counts.decode + (history.decode if history is not None else 0),
        counts.top_k,
        "scripts/budget-start (counting hook, summed over runs)",
        {"runs": runs},
    )
    merged.save(usage_path)
    for p in files:
        p.unlink()
    log(
        f"budget-start: added the last run's counts ({sum(counts.tokens(p) for p in _PHASES)} "
        f"tokens) to {usage_path} ({runs} runs)"
    )


_PHASES = ("prefill", "decode")


def _load_history(state: pathlib.Path, identity: dict, log: Log) -> Counts | None:
    path = state / "usage.json"
    if not path.exists():
        return None
    try:
        history = load_counts(path)
        check_same_model([history], identity)
    except CountsError as e:
        _set_aside(state, [path], f"the usage history does not fit this model: {e}", log)
        return None
    return history


def _set_aside(state: pathlib.Path, files: Sequence[pathlib.Path], why: str, log: Log) -> None:
    aside = state / "set-aside"
    aside.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for p in files:
        if p.exists():
            p.rename(aside / f"{stamp}-{p.name}")
    log(f"budget-start: warning: {why}; moved to {aside}, not used")


def plan(
    model_dir: pathlib.Path,
    budget_gib: float,
    pp_size: int,
    state: pathlib.Path,
    partition: Sequence[int] | None = None,
    log: Log = print,
) -> Start:
    """Write this start's cold file into `state` and say where the counts go."""
    identity = model_identity(model_dir)
    num_layers, num_experts = identity["num_layers"], identity["num_experts"]
    if not num_experts:
        raise SelectionError(f"{model_dir}/config.json names no routed experts")
    stages = stage_layers(num_layers, pp_size, partition)
    per_expert = expert_bytes(model_dir)
    state.mkdir(parents=True, exist_ok=True)
    fold_run_counts(state, identity, log)
    history = _load_history(state, identity, log)
    initial = initial_placement(stages, num_experts, [budget_gib], per_expert)
    learned = history is not None and history.tokens("decode") > 0
    if learned:
        usage = history.decode.astype(np.float64) / history.decode.sum()
        # experts never picked tie at zero: prefer the initial placement's among them,
        # so a short history does not pile the budget into the first layers
        prior = np.zeros_like(usage)
        for layer, ids in initial.items():
            prior[layer, ids] = 1.0
        cold, _ = select_cold(usage - 1e-12 * prior, stages, [budget_gib], per_expert)
        runs, tokens = history.extra.get("runs"), history.tokens("decode")
        how = (
            "least-used per pipeline stage by decode picks counted over "
            f"{runs} earlier runs ({tokens} decode tokens)"
        )
    else:
        cold = initial
        how = "no usage data yet: an equal share of the budget per layer, highest expert ids"
    out = state / f"cold-{budget_gib:g}GiB.json"
    write_cold_file(
        out,
        cold,
        identity,
        {"tool": "scripts/budget-start", "data": str(state / "usage.json"), "selection": how},
        budget={
            "pipeline_parallel_size": pp_size,
            "layer_partition": [len(s) for s in stages],
            "gib_per_stage": [budget_gib] * len(stages),
            "bytes_per_expert": per_expert,
            "experts_per_stage": [sum(len(cold.get(x, [])) for x in s) for s in stages],
        },
    )
    kind = "learned" if learned else "initial"
    log(f"budget-start: {kind} placement, {budget_gib:g} GiB per card: {how}; wrote {out}")
    return Start(
        kind, out, state / "run" / "counts.json", history.tokens("decode") if learned else 0
    )


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import sys

    from .preflight import parse_serve_args

    ap = argparse.ArgumentParser(
        prog="budget-start",
        description="Write the cold file of a budget-only start (no hand-made cold file) "
        "and print the environment that serves with it and counts usage for the next "
        "start. Stdout: `export` lines for a shell to eval; messages go to stderr.",
        epilog="Exit codes: 0 written, 1 the model or budget does not allow it, 2 usage.",
    )
    ap.add_argument(
        "--budget-gib", type=float, required=True, help="routed experts on host, GiB per card"
    )
    ap.add_argument("--state-dir", type=pathlib.Path, required=True, help="persistent folder")
    ap.add_argument(
        "--model", type=pathlib.Path, help="checkpoint folder (default: from the serve arguments)"
    )
    ap.add_argument(
        "--pp-size", type=int, help="pipeline stages (default: from the serve arguments)"
    )
    ap.add_argument("--layer-partition", help="VLLM_PP_LAYER_PARTITION, if set")
    ap.add_argument("serve_args", nargs="*", help="after --: the `vllm serve` arguments")
    args = ap.parse_args(argv)
    try:
        model, pp, _ = parse_serve_args(args.serve_args)
    except ValueError as e:
        ap.error(str(e))
    model_dir = args.model or (pathlib.Path(model) if model else None)
    if model_dir is None:
        ap.error("no model: give --model or the serve arguments after --")
    if args.budget_gib <= 0:
        ap.error("--budget-gib must be positive")
    partition = [int(x) for x in args.layer_partition.split(",")] if args.layer_partition else None

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    try:
        start = plan(model_dir, args.budget_gib, args.pp_size or pp, args.state_dir, partition, log)
    except (OSError, KeyError, ValueError) as e:  # SelectionError and CountsError included
        log(
            f"budget-start: error: {e}\nfix: point the serve arguments (or --model) at a "
            "local checkpoint folder with config.json and safetensors files, and give a "
            "budget smaller than the experts of a pipeline stage"
        )
        return 1
    sys.stdout.write(start.shell())
    return 0
