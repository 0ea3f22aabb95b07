# SPDX-License-Identifier: Apache-2.0
"""Command line of scripts/make-test-model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import time

from . import qwen4exp
from .checkpoint import prepare_dir, write
from .plant import Geometry, Plan, Planting
from .stats import calibration_report
from .weights import TensorFactory

PRESETS = {
    # the target model's expert geometry (Qwen3.8-Flash-Next) with fewer layers
    "target": Geometry(),
    # small enough for CPU tests; same experts, top-k and planted routing as "target"
    "tiny": Geometry(
        hidden_size=256,
        moe_intermediate_size=128,
        num_layers=4,
        vocab_size=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
}

# Qwen4Exp presets: MoE geometry here, the rest in qwen4exp.PRESETS under the same name
QWEN4_PRESETS = {
    # the target's per-stage geometry: 24 layers, 512 experts top-10, hidden 2560, width 640
    "target-stage": Geometry(
        num_layers=24,
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        arch="qwen4_exp",
    ),
    # CPU tests and quick GPU runs: the same routing (512 experts, top-10) on 6 small layers
    "tiny": dataclasses.replace(PRESETS["tiny"], num_layers=6, arch="qwen4_exp"),
}
ARCH_PRESETS = {"qwen3_moe": PRESETS, "qwen4_exp": QWEN4_PRESETS}

EPILOG = """exit codes: 0 written; 1 bad arguments or geometry; 2 usage; 3 output directory
not empty (use --force); 4 writing failed, or too little disk space for the weights (checked
before anything is written or removed).

The router picks of this model are planted (see scripts/eodev/testmodel/plant.py and
tests/README.md): skewed expert popularity, domains and topics with preferred experts, and
conversation locality. --report prints the simulated reference statistics."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="make-test-model",
        description="Write a synthetic Qwen3-MoE or Qwen4Exp checkpoint (Hugging Face format) "
        "that vLLM loads: INT4 GPTQ experts (Marlin MoE path) or BF16 (Triton MoE path), a local "
        "tokenizer, and prompt data sets per domain.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("out", type=pathlib.Path, help="output directory")
    ap.add_argument(
        "--arch",
        choices=sorted(ARCH_PRESETS),
        default="qwen3_moe",
        help="qwen3_moe (Qwen3MoeForCausalLM) or qwen4_exp (Qwen4ExpForCausalLM: PLE, "
        "hyper-connections, QSA, Gated DeltaNet, shared expert, MTP)",
    )
    ap.add_argument(
        "--preset",
        help="qwen3_moe: target (default), tiny; qwen4_exp: target-stage (default), tiny",
    )
    ap.add_argument("--quant", choices=("int4", "bf16"), default="int4")
    ap.add_argument(
        "--layers",
        type=int,
        help="number of layers (presets: target 8, tiny 4; qwen4_exp target-stage 24, tiny 6)",
    )
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--experts", type=int, help="routed experts per layer (default 512)")
    ap.add_argument("--top-k", type=int, help="experts per token (default 10)")
    ap.add_argument("--expert-width", type=int, help="moe_intermediate_size (default 640)")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument(
        "--ngram-vocab-base",
        type=int,
        help="qwen4_exp: rows per PLE n-gram head, about (presets: tiny 1021, target-stage "
        "4099; the real model 20,000,000); a table's bytes are about this x 2 x hidden "
        "per PLE layer, e.g. 8,000,000 on tiny gives two 3.8 GiB tables",
    )
    ap.add_argument("--seed", type=int, default=0, help="planting seed (default 0)")
    ap.add_argument(
        "--device",
        default="auto",
        help="where to draw random weights: auto, cpu, "
        "cuda (only speed differs; the planted structure is the same)",
    )
    ap.add_argument("--prompts", type=int, default=32, help="prompts per domain and split")
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument(
        "--report",
        action="store_true",
        help="simulate and print the routing statistics (stored in the model too)",
    )
    ap.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ap.add_argument(
        "--no-weights",
        action="store_true",
        help="write everything but the weights (tokenizer, config, data sets, description)",
    )
    return ap.parse_args(argv)


def geometry_from(args: argparse.Namespace) -> Geometry:
    overrides = {
        "num_layers": args.layers,
        "hidden_size": args.hidden_size,
        "num_experts": args.experts,
        "top_k": args.top_k,
        "moe_intermediate_size": args.expert_width,
        "vocab_size": args.vocab_size,
    }
    presets = ARCH_PRESETS[args.arch]
    preset = args.preset or next(iter(presets))
    if preset not in presets:
        raise ValueError(
            f"no preset {preset!r} for --arch {args.arch}: choose one of {sorted(presets)}"
        )
    return dataclasses.replace(
        presets[preset], **{k: v for k, v in overrides.items() if v is not None}
    )


def _disk_shortfall(
    plan: Plan,
    quant: str,
    out: pathlib.Path,
    force: bool,
    shape: qwen4exp.Qwen4ExpShape | None = None,
) -> str | None:
    """Why the routed experts (and a Qwen4Exp model's PLE tables) would not fit on the
    output's file system (None: they fit), counting what --force would remove first."""
    g = plan.geometry
    need = TensorFactory(plan, quant).expert_bytes() * g.num_experts * g.num_layers
    what = f"the routed experts of {g.num_layers} layers"
    if shape is not None:
        need += qwen4exp.ple_table_bytes(shape, g.num_layers, g.hidden_size)
        what += " and the PLE tables"
    existing = out
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if force and out.is_dir():
        free += sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if need <= free:
        return None
    gib = 1 << 30
    return (
        f"{what} need {need / gib:.1f} GiB and "
        f"{existing} has {free / gib:.1f} GiB free: remove other test models (e.g. under "
        "EO_GPU_WORK/models) or write OUT elsewhere"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = None
    try:
        plan = Plan(geometry_from(args), Planting(seed=args.seed))
        if args.arch == "qwen4_exp":
            shape = qwen4exp.PRESETS[args.preset or "target-stage"]
            if args.ngram_vocab_base is not None:
                if args.ngram_vocab_base < 2:
                    raise ValueError("--ngram-vocab-base must be at least 2")
                shape = dataclasses.replace(shape, ngram_vocab_size_base=args.ngram_vocab_base)
            shape.ple_layers(plan.geometry.num_layers)  # refuses too few layers
        elif args.ngram_vocab_base is not None:
            raise ValueError("--ngram-vocab-base is for --arch qwen4_exp (PLE tables)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    short = None
    if not args.no_weights:
        short = _disk_shortfall(plan, args.quant, args.out, args.force, shape)
    if short:
        print(f"error: {short}", file=sys.stderr)
        return 4
    try:
        prepare_dir(args.out, args.force)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3

    report = None
    if args.report:
        report = calibration_report(plan)
        print(json.dumps(report, indent=2))

    try:
        from tqdm import tqdm
    except ImportError:  # progress lines instead of a bar
        tqdm = None
    n = plan.geometry.num_layers + 1 + (shape is not None)
    bar = tqdm(total=n, unit="shard", desc="writing") if tqdm and not args.no_weights else None

    def progress(done: int, what: str) -> None:
        if bar:
            bar.set_postfix_str(what)
            bar.update(1)
        else:
            print(f"[{done}/{n}] {what}", file=sys.stderr)

    t0 = time.time()
    try:
        write(
            plan,
            args.out,
            args.quant,
            device,
            args.prompts,
            args.prompt_words,
            report,
            progress,
            weights=not args.no_weights,
            shape=shape,
        )
    except (OSError, RuntimeError, ValueError) as e:
        print(f"error: writing {args.out} failed: {e}", file=sys.stderr)
        return 4
    if bar:
        bar.close()
    print(
        f"wrote {args.out} ({args.quant}, {plan.geometry.num_layers} layers) "
        f"in {time.time() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0
