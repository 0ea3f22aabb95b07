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

from .swap_policy import SwapPolicy, simulate

EPILOG = """Picks come from a recorded file (--picks: .npy or .npz array 'picks' of shape
(decode tokens, layers, top_k), in order; a serving trace, VLLM_EXPERT_COUNT_TRACE_TOKENS, also
names its layers in 'layers') or, for a make-test-model checkpoint, from its
planted routers over conversations that stay in one domain (--model with --domain).

exit codes: 0 done; 1 bad input; 2 usage."""


def synthetic_picks(
    model_dir: pathlib.Path, domain: str, conversations: int, words: int, decode: int, seed: int
) -> Iterator[np.ndarray]:
    """Decode-step picks of `conversations` held-out conversations of one domain, back to
    back (the swap state carries over between them, as in a server)."""
    from .testmodel import data
    from .testmodel.plant import load_plan

    plan = load_plan(model_dir)
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


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--words", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--half-life", type=float, default=512.0)
    ap.add_argument("--margin", type=float, default=2.0)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also try intervals 4,8,16 x half-lives 128,512,2048 x margins 1,2,4",
    )
    ap.add_argument("--json", type=pathlib.Path, help="write every result here")
    args = ap.parse_args(argv)

    cold_doc = json.loads(pathlib.Path(args.cold).read_text())
    host = {int(k): v for k, v in cold_doc["layers"].items()}
    layers, experts = cold_doc["model"]["num_layers"], cold_doc["model"]["num_experts"]
    if args.picks:
        arr = np.load(args.picks)
        recorded = None
        if isinstance(arr, np.lib.npyio.NpzFile):
            # the serving hook's trace names its rank's layers (VLLM_EXPERT_COUNT_TRACE_TOKENS)
            recorded = arr["layers"].tolist() if "layers" in arr.files else None
            arr = arr["picks"]
        if recorded is not None:
            if any(not 0 <= x < layers for x in recorded):
                print(f"error: {args.picks}: layers {recorded} not in the model", file=sys.stderr)
                return 1
            host = {i: host.get(x, []) for i, x in enumerate(recorded)}
            layers = len(recorded)
        if arr.ndim != 3 or arr.shape[1] != layers:
            print(
                f"error: {args.picks}: picks must be (tokens, {layers} layers, top_k)",
                file=sys.stderr,
            )
            return 1
        workloads = {args.picks.name: arr.astype(np.int64)}
    elif args.model and args.domain:
        workloads = {
            d: np.stack(
                list(
                    synthetic_picks(
                        args.model, d, args.conversations, args.words, args.decode_tokens, args.seed
                    )
                )
            )
            for d in args.domain
        }
    else:
        print("error: give --picks, or --model with --domain", file=sys.stderr)
        return 1

    policies = [SwapPolicy(args.interval, args.half_life, args.margin)]
    if args.sweep:
        policies += [
            SwapPolicy(i, h, m)
            for i, h, m in itertools.product((4, 8, 16), (128.0, 512.0, 2048.0), (1.0, 2.0, 4.0))
            if SwapPolicy(i, h, m) != policies[0]
        ]
    results = []
    print(
        f"{'workload':<16} {'policy':<26} {'reads/token':>11} {'swaps/token':>11} "
        f"{'read-equiv/token':>16}"
    )
    for name, picks in workloads.items():
        for policy in [None, *policies]:
            r = simulate(iter(picks), layers, experts, host, policy)
            label = (
                "fixed cold set"
                if policy is None
                else f"swap {policy.interval}/{policy.half_life:g}/{policy.margin:g}"
            )
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
    if args.json:
        args.json.write_text(
            json.dumps({"cold": str(args.cold), "results": results}, indent=1) + "\n"
        )
    return 0
