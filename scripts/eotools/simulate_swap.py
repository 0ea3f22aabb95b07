# SPDX-License-Identifier: Apache-2.0
"""Command line of scripts/simulate-swap: replay per-token router picks through a fixed cold
set and through the runtime-swap policy (eotools.swap_policy), and report host reads and swaps
per decoded token; optionally sweep the policy's parameters."""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
from collections.abc import Iterator

import numpy as np

from .coldcheck import REMAKE, ColdFileError, load_cold_file
from .devtools import DevToolsMissing, dev_module
from .swap_policy import (
    SwapPolicy,
    hindsight_host,
    placed_per_batch,
    simulate,
    simulate_steps,
)

EPILOG = """Picks come from a recorded file (--picks: .npy or .npz array 'picks' of shape
(decode tokens, layers, top_k), in order; a serving trace, VLLM_EXPERT_COUNT_TRACE_TOKENS, also
names its layers in 'layers') or, for a make-test-model checkpoint, from its
planted routers over conversations that stay in one domain (--model with --domain), or over
N streams of mixed domains decoded together, as bench-offload --streams runs them (--model
with --streams N: a warm-up batch and --batches more, each of N new prompts; a step reads a
host expert once however many of its streams picked it, and the table adds two floors known
only afterwards: the fixed placement that the run picks least, and the placement that each
batch picks least, rebuilt at every batch, with the experts it moves counted as swaps; and
one a server could build: each batch's placement from what its prompts picked).

exit codes: 0 done; 1 bad input; 2 usage."""


def synthetic_picks(
    model_dir: pathlib.Path, domain: str, conversations: int, words: int, decode: int, seed: int
) -> Iterator[np.ndarray]:
    """Decode-step picks of `conversations` held-out conversations of one domain, back to
    back (the swap state carries over between them, as in a server)."""
    data = dev_module("testmodel.data", "--model with --domain")
    plan = dev_module("testmodel.plant", "--model with --domain").load_plan(model_dir)
    for conv in data.conversations(plan, domain, "heldout", conversations, words, seed=seed):
        seq = np.array(
            list(conv.token_ids) + data.greedy_continuation(plan, conv.token_ids, decode)
        )
        p = len(conv.token_ids)
        layers = [
            plan.router_topk(layer, seq[: len(seq) - 1])[p:]
            for layer in range(plan.geometry.num_layers)
        ]
        yield from np.stack(layers, axis=1)  # (decode steps, layers, top_k)


class BadInput(Exception):
    """Input the simulation cannot run on; main prints it as one `error:` line, exit 1."""


def parser() -> argparse.ArgumentParser:
    """simulate-swap's command line."""
    ap = argparse.ArgumentParser(
        prog="simulate-swap",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cold", required=True, help="the cold file the simulation starts from")
    ap.add_argument("--picks", type=pathlib.Path, help="recorded decode picks (.npy/.npz)")
    ap.add_argument("--model", type=pathlib.Path, help="a make-test-model checkpoint")
    ap.add_argument(
        "--domain",
        action="append",
        default=[],
        help="with --model: simulate conversations of this domain (repeat)",
    )
    ap.add_argument(
        "--streams",
        type=int,
        help="with --model: N streams of mixed domains decoded together (see below)",
    )
    ap.add_argument(
        "--batches", type=int, default=3, help="with --streams: batches after the warm-up"
    )
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--words", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--half-life", type=float, default=512.0)
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument(
        "--max-swaps",
        type=int,
        default=1,
        help="what-if: experts traded per layer per decision (the runtime trades 1)",
    )
    ap.add_argument(
        "--count-prompts",
        action="store_true",
        help="what-if, with --streams: the swap also counts each batch's prompt picks "
        "(the runtime counts decode picks only)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also try intervals 4,8,16 x half-lives 128,512,2048 x margins 1,2,4",
    )
    ap.add_argument("--json", type=pathlib.Path, help="write every result here")
    return ap


def load_host_experts(
    args: argparse.Namespace,
) -> tuple[dict[int, list[int]], int, int]:
    """The cold file's host experts per layer, the model's layer count and its expert count;
    the layer count comes from --model where the cold file does not say it."""
    try:
        cold_doc = load_cold_file(pathlib.Path(args.cold))
    except ColdFileError as e:
        raise BadInput(f"{args.cold}: {e}; {e.fix}") from e
    host = cold_doc["layers"]
    layers, experts = cold_doc["model"].get("num_layers"), cold_doc["model"]["num_experts"]
    if layers is None and args.model:
        from .coldset import model_identity

        layers = model_identity(args.model)["num_layers"]
    if layers is None:
        raise BadInput(
            f"{args.cold}: its 'model' does not say 'num_layers'; add the model's "
            "layer count there or give --model"
        )
    beyond = sorted(x for x in host if x >= layers)
    if beyond:
        raise BadInput(
            f"{args.cold}: it lists layer(s) {beyond[:8]}, but its model has {layers} "
            f"layers (0-{layers - 1}); {REMAKE}"
        )
    return host, layers, experts


def recorded_workload(
    path: pathlib.Path, host: dict[int, list[int]], layers: int, experts: int
) -> tuple[dict[str, np.ndarray], dict[int, list[int]], int]:
    """The picks recorded in `path` as one workload, with the host experts and layer count
    they replay against: a serving trace that names its rank's layers narrows both to those."""
    try:
        arr = np.load(path)
    except (OSError, ValueError, EOFError) as e:
        raise BadInput(f"{path}: not a .npy or .npz file ({e})") from e
    recorded = None
    if isinstance(arr, np.lib.npyio.NpzFile):
        # the serving hook's trace names its rank's layers (VLLM_EXPERT_COUNT_TRACE_TOKENS)
        recorded = arr["layers"].tolist() if "layers" in arr.files else None
        arr = arr["picks"]
    if recorded is not None:
        if any(not 0 <= x < layers for x in recorded):
            raise BadInput(f"{path}: layers {recorded} not in the model")
        host = {i: host.get(x, []) for i, x in enumerate(recorded)}
        layers = len(recorded)
    if arr.ndim != 3 or arr.shape[1] != layers or arr.shape[0] == 0:
        raise BadInput(
            f"{path}: picks must be (tokens, {layers} layers, top_k) with at "
            f"least one token, not {arr.shape}"
        )
    if arr.size and not (arr.min() >= 0 and arr.max() < experts):
        raise BadInput(
            f"{path}: expert ids {int(arr.min())}-{int(arr.max())} are not "
            f"all in 0-{experts - 1} (the cold file's model has {experts} experts); "
            "record the picks on the model the cold file was made for"
        )
    return {path.name: arr.astype(np.int64)}, host, layers


def synthetic_workloads(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """One workload per --domain: the planted routers' picks over its conversations."""
    try:
        return {
            d: np.stack(
                list(
                    synthetic_picks(
                        args.model,
                        d,
                        args.conversations,
                        args.words,
                        args.decode_tokens,
                        args.seed,
                    )
                )
            )
            for d in args.domain
        }
    except DevToolsMissing as e:
        raise BadInput(str(e)) from e


def stream_steps(args: argparse.Namespace) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Decode steps (steps, streams, layers, top_k) of bench-offload's many-streams
    workload on a make-test-model checkpoint: batches of --streams new prompts of mixed
    domains, each decoded greedily for --decode-tokens tokens; and the picks of each
    batch's prompts (tokens, layers, top_k) by the step its batch starts at."""
    try:
        data = dev_module("testmodel.data", "--model with --streams")
        plan = dev_module("testmodel.plant", "--model with --streams").load_plan(args.model)
        streams = dev_module("bench_streams", "--model with --streams")
    except DevToolsMissing as e:
        raise BadInput(str(e)) from e
    n, out, prefilled, at = args.streams, [], {}, 0
    prompts = streams.prompts(plan, n * (1 + args.batches))
    for b in range(1 + args.batches):
        batch, prompt_picks = [], []
        for prompt in prompts[b * n : (b + 1) * n]:
            decoded = data.greedy_continuation(plan, tuple(prompt), args.decode_tokens)
            seq = np.array(prompt + decoded)
            layers = range(plan.geometry.num_layers)
            picks = np.stack([plan.router_topk(layer, seq[:-1]) for layer in layers], axis=1)
            prompt_picks.append(picks[: len(prompt)])
            batch.append(picks[len(prompt) :])  # (decode steps, layers, top_k)
        out.append(np.stack(batch, axis=1))
        prefilled[at] = np.concatenate(prompt_picks)
        at += out[-1].shape[0]
    return np.concatenate(out), prefilled


def run_streams(
    steps: np.ndarray,
    layers: int,
    experts: int,
    host: dict[int, list[int]],
    swap_policies: list[SwapPolicy],
    prefilled: dict[int, np.ndarray],
    count_prompts: bool = False,
) -> list[dict]:
    """The many-streams workload through the fixed cold set, each policy, the two
    hindsight placements (fixed; rebuilt for each batch) and the placement rebuilt for
    each batch from what its prompts picked (`prefilled`: each batch's prompt picks by
    the step it starts at); a table row per run, the rows for --json. `count_prompts`
    (what-if): the swap counts the prompts' picks too."""
    n, starts = steps.shape[1], sorted(prefilled)
    prompts = prefilled if count_prompts else None
    print(f"{n} streams, {steps.shape[0]} decode steps")
    print(f"{'placement':<30} {'reads/token':>11} {'reads/step':>10} {'swaps/token':>11}")

    def fixed(placed: dict[int, list[int]]):
        return simulate_steps(iter(steps), layers, experts, placed, None)

    runs = [("fixed cold set", None, fixed(host))]
    for policy in swap_policies:
        r = simulate_steps(iter(steps), layers, experts, host, policy, prompts)
        runs.append((_label(policy) + (" +prompts" if prompts else ""), policy, r))
    runs.append(("hindsight fixed placement", None, fixed(hindsight_host(steps, experts, host))))
    runs.append(
        ("hindsight placement per batch", None, placed_per_batch(steps, experts, host, starts))
    )
    r = placed_per_batch(steps, experts, host, starts, prefilled)
    runs.append(("placement per batch by prompts", None, r))
    results = []
    for label, policy, r in runs:
        print(
            f"{label:<30} {r.reads_per_token:>11.3f} {r.reads_per_step:>10.2f} "
            f"{r.swaps_per_token:>11.4f}"
        )
        results.append(
            {
                "workload": f"{n} streams",
                "placement": label,
                "policy": None if policy is None else policy.__dict__,
                "tokens": r.tokens,
                "steps": r.steps,
                "reads_per_token": r.reads_per_token,
                "reads_per_step": r.reads_per_step,
                "swaps_per_token": r.swaps_per_token,
            }
        )
    return results


def _label(policy: SwapPolicy) -> str:
    """interval/half-life/margin, and xK where more than one pair swaps per decision."""
    k = f" x{policy.max_swaps}" if policy.max_swaps > 1 else ""
    return f"swap {policy.interval}/{policy.half_life:g}/{policy.margin:g}{k}"


def policies(args: argparse.Namespace) -> list[SwapPolicy]:
    """The policy of the command line, then (--sweep) every other one of the grid."""
    chosen = [SwapPolicy(args.interval, args.half_life, args.margin, args.max_swaps)]
    if args.sweep:
        chosen += [
            SwapPolicy(i, h, m, args.max_swaps)
            for i, h, m in itertools.product((4, 8, 16), (128.0, 512.0, 2048.0), (1.0, 2.0, 4.0))
            if SwapPolicy(i, h, m, args.max_swaps) != chosen[0]
        ]
    return chosen


def run_policies(
    workloads: dict[str, np.ndarray],
    layers: int,
    experts: int,
    host: dict[int, list[int]],
    swap_policies: list[SwapPolicy],
) -> list[dict]:
    """Replay every workload through the fixed cold set and each policy, printing a table
    row per run; returns the rows for --json."""
    results = []
    print(
        f"{'workload':<16} {'policy':<26} {'reads/token':>11} {'swaps/token':>11} "
        f"{'read-equiv/token':>16}"
    )
    for name, picks in workloads.items():
        for policy in [None, *swap_policies]:
            r = simulate(iter(picks), layers, experts, host, policy)
            label = "fixed cold set" if policy is None else _label(policy)
            print(
                f"{name:<16} {label:<26} {r.reads_per_token:>11.3f} "
                f"{r.swaps_per_token:>11.4f} {r.read_equivalents_per_token():>16.3f}"
            )
            results.append(
                {
                    "workload": name,
                    "policy": None if policy is None else policy.__dict__,
                    "tokens": r.tokens,
                    "reads_per_token": r.reads_per_token,
                    "swaps_per_token": r.swaps_per_token,
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.max_swaps < 1:
            raise BadInput(f"--max-swaps must be at least 1, not {args.max_swaps}")
        host, layers, experts = load_host_experts(args)
        steps = workloads = None
        if args.picks:
            workloads, host, layers = recorded_workload(args.picks, host, layers, experts)
        elif args.model and args.streams:
            if args.streams < 1 or args.batches < 1:
                raise BadInput("--streams and --batches must be at least 1")
            steps, prefilled = stream_steps(args)
        elif args.model and args.domain:
            workloads = synthetic_workloads(args)
        else:
            raise BadInput("give --picks, or --model with --domain or --streams")
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if steps is not None:
        swap = policies(args)
        results = run_streams(steps, layers, experts, host, swap, prefilled, args.count_prompts)
    else:
        results = run_policies(workloads, layers, experts, host, policies(args))
    if args.json:
        args.json.write_text(
            json.dumps({"cold": str(args.cold), "results": results}, indent=1) + "\n"
        )
    return 0
