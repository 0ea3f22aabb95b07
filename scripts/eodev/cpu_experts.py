# SPDX-License-Identifier: Apache-2.0
"""Could the CPU compute a decode step's host experts sooner than PCIe brings them to the GPU?

Every host expert a decode step picks crosses PCIe once, by a copy or by the kernel's own
reads: at the 2x32GB default's 26% host, 16 streams pick about 11 host experts per layer and
step, 28 MB that take 0.56 ms against 0.2 ms of the layer's compute on an H200 (see
bench/results/2026-12-05-prefetch24-h200.md). The other way is to leave the weights where
they are and compute those experts on the CPU, sending only activations across: what
KTransformers does beside SGLang. This times that on the machine it runs on.

For each count of tokens per expert (a decode step gives each host expert one or two), it
runs --experts experts' SwiGLU MLP (w13, SiLU-and-mul, w2) on the CPU with INT4 weights in
groups of --group-size (torch's CPU int4 matmul, BF16 activations), drawing each repeat's
experts afresh from a pool of --pool so that no repeat finds them in the CPU's caches, and
reports the layer's time (median, p90) beside what PCIe needs for the same experts
(--row-bytes each at --copy-gbps). One expert's output is checked against a dequantized
float reference first.

    scripts/bench-cpu-experts --out cpu_experts.json   (any machine; the GPU host's CPU is
                                                        the one that matters)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# the test models' expert geometry (scripts/eodev/testmodel/plant.py): hidden 2560, expert
# width 640, INT4 in groups of 128 with FP16 scales: 2,534,400 B per expert as one table
# holds it, the bytes a copy or a UVA read moves
HIDDEN, WIDTH, GROUP = 2560, 640, 128
ROW_BYTES = 2_534_400


@dataclass
class Int4Linear:
    """One INT4 weight [out, in] as torch's CPU int4 matmul takes it."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [in / group, out, 2], BF16
    group: int

    @classmethod
    def random(cls, out_f: int, in_f: int, group: int, g: torch.Generator) -> Int4Linear:
        return cls.with_codes(out_f, in_f, group, g)[0]

    @classmethod
    def with_codes(
        cls, out_f: int, in_f: int, group: int, g: torch.Generator
    ) -> tuple[Int4Linear, torch.Tensor]:
        """Random 4-bit codes [out, in] with small scales and zeros, and the codes."""
        q = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32, generator=g)
        scale = torch.rand(in_f // group, out_f, generator=g) * 0.02 + 0.005
        zero = torch.randn(in_f // group, out_f, generator=g) * 0.002
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)
        return cls(packed, sz, group), q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_and_zeros
        )


@dataclass
class Expert:
    w13: Int4Linear  # [2 * width, hidden]: gate and up
    w2: Int4Linear  # [hidden, width]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def dequantized(q: torch.Tensor, lin: Int4Linear) -> torch.Tensor:
    """The float weight [out, in] that ``lin`` holds for the codes ``q`` (torch's CPU int4
    layout: (q - 8) * scale + zero, per group of inputs)."""
    sz = lin.scales_and_zeros.float()
    scale = sz[..., 0].repeat_interleave(lin.group, dim=0).T
    zero = sz[..., 1].repeat_interleave(lin.group, dim=0).T
    return (q.float() - 8) * scale + zero


def check_one_expert(hidden: int, width: int, group: int, seed: int) -> float:
    """Largest difference of one expert's CPU int4 output from the same weights dequantized
    to float, over the reference's largest value: the benchmark times a real MLP, not a
    wrong layout."""
    g = torch.Generator().manual_seed(seed)
    w13, q13 = Int4Linear.with_codes(2 * width, hidden, group, g)
    w2, q2 = Int4Linear.with_codes(hidden, width, group, g)
    expert = Expert(w13, w2)
    x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
    gate, up = (x.float() @ dequantized(q13, w13).T).chunk(2, dim=-1)
    ref = (F.silu(gate) * up) @ dequantized(q2, w2).T
    got = expert(x).float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def time_layer(
    pool: list[Expert], experts: int, tokens: int, hidden: int, repeats: int, seed: int
) -> list[float]:
    """Seconds for ``experts`` experts of the pool, each on ``tokens`` tokens, per repeat
    (each repeat draws other experts; one untimed warm-up)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    times = []
    for rep in range(repeats + 1):
        picks = torch.randperm(len(pool), generator=g)[:experts].tolist()
        t0 = time.perf_counter()
        for e in picks:
            pool[e](x)
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        msg = f"'{text}' is not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': each value must be at least 1")
    return values


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-cpu-experts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="cpu_experts.json", help="JSON result file")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    p.add_argument(
        "--expert-width", type=int, default=WIDTH, help=f"expert width (default {WIDTH})"
    )
    p.add_argument("--group-size", type=int, default=GROUP, help=f"INT4 group (default {GROUP})")
    p.add_argument(
        "--experts", type=_ints, default=[2, 11], help="host experts per layer and step (2,11)"
    )
    p.add_argument(
        "--tokens-per-expert", type=_ints, default=[1, 2, 4], help="tokens each expert gets"
    )
    p.add_argument("--pool", type=int, default=128, help="experts to draw from (default 128)")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's, all cores)")
    p.add_argument("--repeats", type=int, default=20, help="timed layers per case")
    p.add_argument(
        "--row-bytes", type=int, default=ROW_BYTES, help="bytes one expert moves over PCIe"
    )
    p.add_argument(
        "--copy-gbps", type=float, default=49.9, help="PCIe copy rate (default: the H200's)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hidden % args.group_size or args.expert_width % args.group_size:
        p.error("--hidden and --expert-width must be multiples of --group-size")
    if args.pool < max(args.experts):
        p.error(f"--pool {args.pool} holds fewer experts than --experts {max(args.experts)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        print(f"error: torch {torch.__version__} has no CPU int4 matmul", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    check = check_one_expert(args.hidden, args.expert_width, args.group_size, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    pool = []
    for i in range(args.pool):
        pool.append(
            Expert(
                Int4Linear.random(2 * args.expert_width, args.hidden, args.group_size, g),
                Int4Linear.random(args.hidden, args.expert_width, args.group_size, g),
            )
        )
        print(f"\rmaking experts: {i + 1}/{args.pool}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    cases = []
    for experts in args.experts:
        for tokens in args.tokens_per_expert:
            times = time_layer(pool, experts, tokens, args.hidden, args.repeats, args.seed)
            cpu_us = statistics.median(times) * 1e6
            pcie_us = experts * args.row_bytes / (args.copy_gbps * 1e9) * 1e6
            cases.append(
                {
                    "experts": experts,
                    "tokens_per_expert": tokens,
                    "cpu_us": [t * 1e6 for t in times],
                    "cpu_us_median": cpu_us,
                    "cpu_us_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e6,
                    "pcie_us": pcie_us,
                    "cpu_vs_pcie": cpu_us / pcie_us,
                }
            )
            print(
                f"{experts:>3} experts x {tokens} tokens: CPU {cpu_us:9.1f} us, "
                f"PCIe {pcie_us:8.1f} us ({cpu_us / pcie_us:.2f}x)",
                file=sys.stderr,
            )
    report = {
        "suite": "cpu-experts",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "scripts/bench-cpu-experts " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "geometry": {
            "hidden": args.hidden,
            "expert_width": args.expert_width,
            "group_size": args.group_size,
        },
        "row_bytes": args.row_bytes,
        "copy_gbps": args.copy_gbps,
        "check_max_rel_diff": check,
        "cases": cases,
        "elapsed_s": time.perf_counter() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0 if check < 0.02 else 1
