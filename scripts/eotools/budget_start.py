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
warning and never used; the start goes on. One server uses a state folder at a time: a start
takes the folder's lock and returns it (`Start.lock_fd`) for the server to hold; every file
is written atomically and durably, and each run's counts are added once, whatever is killed
when (state_dir, usage_state). State folder layout:

    .lock               held by the server that uses the folder (its pid, host and start time)
    usage.json          counts of all earlier runs (expert-counts format, cold/README.md) and
                        the ids of the runs they include
    run/<run id>/       the counting hook's files of one run
    set-aside/          files that did not fit the model, renamed with the time
    cold-<GiB>GiB.json  the cold file of the current start
"""

from __future__ import annotations

import os
import pathlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import state_dir, usage_state
from .coldset import model_identity, write_cold_file
from .selection import GiB, SelectionError, expert_bytes, select_cold, stage_layers

Log = Callable[[str], None]


@dataclass(frozen=True)
class Start:
    kind: str  # "learned" or "initial"
    cold_file: pathlib.Path
    count_file: pathlib.Path
    tokens_learned: int
    run_id: str = ""
    # the state folder's lock (state_dir.lock), inheritable: keep it open while the server
    # runs (exec it with the descriptor open); closing it lets another start take the folder
    lock_fd: int = -1

    def shell(self) -> str:
        """`export` lines for the entrypoint to eval."""
        return (
            f"export VLLM_EXPERT_COLD_FILE={shlex.quote(str(self.cold_file))}\n"
            f"export VLLM_EXPERT_COUNT_FILE={shlex.quote(str(self.count_file))}\n"
        )


def initial_placement(
    stages: Sequence[Sequence[int]], num_experts: int, budgets_gib: Sequence[float], per_expert: int
) -> dict[int, list[int]]:
    """Per stage, the budget's experts spread evenly over the stage's layers (the first
    layers take the remainder), each layer's highest ids. A stage without layers to split
    (all in VLLM_EXPERT_HOST_LAYERS) gets none."""
    if len(budgets_gib) == 1:
        budgets_gib = list(budgets_gib) * len(stages)
    cold: dict[int, list[int]] = {}
    for layers, gib in zip(stages, budgets_gib, strict=True):
        if not layers:
            continue
        n = int(gib * GiB) // per_expert
        if n >= len(layers) * num_experts:
            raise SelectionError(
                f"a budget of {gib} GiB holds {n} experts, as many as or more than layers "
                f"{_ranges(layers)} have: lower the budget"
            )
        share, extra = divmod(n, len(layers))
        for i, layer in enumerate(layers):
            k = share + (1 if i < extra else 0)
            if k:
                cold[layer] = list(range(num_experts - k, num_experts))
    return cold


def _ranges(layers: Sequence[int]) -> str:
    """Layer numbers as ranges: 0-3,6."""
    out: list[str] = []
    for x in sorted(layers):
        if out and int(out[-1].split("-")[-1]) == x - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ",".join(out)


def split_layers(stages: Sequence[range], host_layers: frozenset[int], log: Log) -> list[list[int]]:
    """Per pipeline stage, the layers a cold file may split: VLLM_EXPERT_HOST_LAYERS puts
    its layers wholly on host, and vLLM refuses a cold file that names one of them."""
    out = [[x for x in s if x not in host_layers] for s in stages]
    for i, (s, layers) in enumerate(zip(stages, out, strict=True)):
        if not layers:
            log(
                f"budget-start: warning: every layer of pipeline stage {i} "
                f"({_ranges(s)}) is in VLLM_EXPERT_HOST_LAYERS: its budget places no expert"
            )
    return out


def plan(
    model_dir: pathlib.Path,
    budget_gib: float,
    pp_size: int,
    state: pathlib.Path,
    partition: Sequence[int] | None = None,
    log: Log = print,
    host_layers: frozenset[int] = frozenset(),
) -> Start:
    """Write this start's cold file into `state` and say where the counts go. The stages
    are vLLM's (`partition`: VLLM_PP_LAYER_PARTITION's); layers in `host_layers`
    (VLLM_EXPERT_HOST_LAYERS) are left out of the cold file. Takes the state folder's
    lock (state_dir.StateDirBusy when another server holds it) and returns it open in
    `Start.lock_fd`, for the caller to keep until the server is done."""
    identity = model_identity(model_dir)
    num_layers, num_experts = identity["num_layers"], identity["num_experts"]
    if not num_experts:
        raise SelectionError(f"{model_dir}/config.json names no routed experts")
    stages = stage_layers(num_layers, pp_size, partition)
    beyond = sorted(x for x in host_layers if x >= num_layers)
    if beyond:
        raise SelectionError(
            f"VLLM_EXPERT_HOST_LAYERS names layer(s) {_ranges(beyond)}, but the model has "
            f"{num_layers} layers (0-{num_layers - 1})"
        )
    splittable = split_layers(stages, host_layers, log)
    lock_fd = state_dir.lock(state)
    try:
        return _plan_locked(
            model_dir, budget_gib, pp_size, state, identity, stages, splittable, log, lock_fd
        )
    except BaseException:
        os.close(lock_fd)
        raise


def _plan_locked(
    model_dir: pathlib.Path,
    budget_gib: float,
    pp_size: int,
    state: pathlib.Path,
    identity: dict,
    stages: Sequence[range],
    splittable: Sequence[Sequence[int]],
    log: Log,
    lock_fd: int,
) -> Start:
    num_experts = identity["num_experts"]
    per_expert = expert_bytes(model_dir)
    state_dir.remove_stale_temps(state)
    history = usage_state.fold_runs(state, identity, log)
    initial = initial_placement(splittable, num_experts, [budget_gib], per_expert)
    learned = history is not None and history.tokens("decode") > 0
    if learned:
        usage = history.decode.astype(np.float64) / history.decode.sum()
        # experts never picked tie at zero: prefer the initial placement's among them,
        # so a short history does not pile the budget into the first layers
        prior = np.zeros_like(usage)
        for layer, ids in initial.items():
            prior[layer, ids] = 1.0
        cold, _ = select_cold(
            usage - 1e-12 * prior, [s for s in splittable if s], [budget_gib], per_expert
        )
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
    run_id = usage_state.new_run_id()
    count_file = usage_state.begin_run(state, run_id)
    tokens = history.tokens("decode") if learned else 0
    return Start(kind, out, count_file, tokens, run_id, lock_fd)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import os
    import sys

    from . import serve_args
    from .settings import BY_NAME, Invalid

    env = os.environ
    ap = argparse.ArgumentParser(
        prog="budget-start",
        description="Write the cold file of a budget-only start (no hand-made cold file) "
        "and print the environment that serves with it and counts usage for the next "
        "start. Stdout: `export` lines for a shell to eval; messages go to stderr. The "
        "image's start program (scripts/start) runs this in-process.",
        epilog="Exit codes: 0 written, 1 the model or budget does not allow it, 2 usage, "
        "3 the state folder is in use by another server or cannot be used.",
    )
    ap.add_argument("--budget-gib", required=True, help="routed experts on host, GiB per card")
    ap.add_argument("--state-dir", type=pathlib.Path, required=True, help="persistent folder")
    ap.add_argument(
        "--model", type=pathlib.Path, help="checkpoint folder (default: from the serve arguments)"
    )
    ap.add_argument("--pp-size", help="pipeline stages (default: from the serve arguments)")
    ap.add_argument(
        "--layer-partition",
        default=env.get("VLLM_PP_LAYER_PARTITION") or None,
        help="layers per pipeline stage, as vLLM splits them (default: "
        "VLLM_PP_LAYER_PARTITION; unset: vLLM's even split)",
    )
    ap.add_argument(
        "--host-layers",
        default=env.get("VLLM_EXPERT_HOST_LAYERS", ""),
        help="layers wholly on host, left out of the cold file (default: VLLM_EXPERT_HOST_LAYERS)",
    )
    ap.add_argument("serve_args", nargs="*", help="after --: the `vllm serve` arguments")
    args = ap.parse_args(argv)

    def value(option: str, setting: str, text: str):
        try:
            return BY_NAME[setting].kind.parse(text)
        except Invalid as e:
            ap.error(f"{option} {text[:80]!r}: {e}; the range is {BY_NAME[setting].kind.range}")

    budget = value("--budget-gib", "EO_HOST_BUDGET_GIB", args.budget_gib)
    partition = (
        value("--layer-partition", "VLLM_PP_LAYER_PARTITION", args.layer_partition)
        if args.layer_partition
        else None
    )
    host_layers = value("--host-layers", "VLLM_EXPERT_HOST_LAYERS", args.host_layers)
    try:
        serve = serve_args.parse(args.serve_args)
        pp = serve_args.parse(["-pp", args.pp_size]).pp if args.pp_size else serve.pp
    except serve_args.ServeArgsError as e:
        ap.error(str(e))
    model_dir = args.model or (pathlib.Path(serve.model) if serve.model else None)
    if model_dir is None:
        ap.error("no model: give --model or the serve arguments after --")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    try:
        start = plan(model_dir, budget, pp, args.state_dir, partition, log, host_layers)
    except state_dir.StateDirError as e:
        log(f"budget-start: error: {e}")
        return 3
    except (OSError, KeyError, ValueError) as e:  # SelectionError and CountsError included
        log(
            f"budget-start: error: {e}\nfix: point the serve arguments (or --model) at a "
            "local checkpoint folder with config.json and safetensors files, give a budget "
            "smaller than the experts of a pipeline stage, and a layer partition and host "
            "layers that fit the model"
        )
        return 1
    # the lock ends with this command: only the image's start program (scripts/start), which
    # runs this in its own process and execs vLLM, holds the folder while the server runs
    log(
        f"budget-start: note: {args.state_dir} is not locked once this command exits: serve one "
        "server per state folder (the image's start program keeps it locked while vLLM runs)"
    )
    sys.stdout.write(start.shell())
    return 0
