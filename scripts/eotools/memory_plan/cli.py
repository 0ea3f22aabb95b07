# SPDX-License-Identifier: Apache-2.0
"""The memory-plan command line: settings from a topology's compose file (its ${VAR:-default}
taken from the environment, as docker compose takes them), each flag overriding them; the
plan printed as Markdown or JSON; the exit code says whether every card fits."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from ..selection import GiB
from ..topologies import TOPOLOGIES
from .errors import PlanError
from .estimate import make_plan
from .model_shape import load_shape
from .render import render_markdown, to_json
from .serving import Serving, read_compose, usable_vram_bytes
from .weights import estimate_weights, header_weights, safetensors_files

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2

# the compose files a topology name reads: compose/<topology>.yml of this repository
REPO = pathlib.Path(__file__).resolve().parents[3]


def build_serving(args: argparse.Namespace) -> Serving:
    """The settings to plan for: each flag given, else the compose file's (that of
    --compose, else of --topology), else vLLM's default."""
    compose: dict[str, Any] = {"flags": {}, "env": {}, "topology": None}
    compose_path = args.compose
    if compose_path is None and args.topology:
        candidate = REPO / "compose" / f"{args.topology}.yml"
        compose_path = candidate if candidate.exists() else None
    if compose_path is not None:
        try:
            # the shell's variables, as `docker compose up` would see them
            compose = read_compose(compose_path, os.environ)
        except (OSError, KeyError, ValueError) as e:
            raise PlanError(f"cannot read the compose file {compose_path}: {e}") from None
    fl, env = compose["flags"], compose["env"]
    name = args.topology or compose["topology"]
    topo = TOPOLOGIES.get(name) if name else None
    if name and topo is None:
        raise PlanError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")

    def pick(cli: Any, flag: str, default: Any, cast: Any = int) -> Any:
        if cli is not None:
            return cli
        if fl.get(flag) is not None:
            return cast(fl[flag])
        return default

    pp = pick(args.pp_size, "--pipeline-parallel-size", topo.pipeline_parallel_size if topo else 1)
    if args.vram_gib is not None:
        usable = int(args.vram_gib * GiB)
    elif topo is not None and topo.vram_gib is not None:
        usable = usable_vram_bytes(topo.vram_gib)
    else:
        usable = None
    partition = (
        args.layer_partition
        or env.get("VLLM_PP_LAYER_PARTITION")
        or os.environ.get("VLLM_PP_LAYER_PARTITION")
    )
    try:
        parts = [int(x) for x in partition.split(",")] if partition else None
    except ValueError:
        raise PlanError(f"layer partition {partition!r}: give comma-separated counts") from None
    host = args.host_gib_per_card
    if host is None:
        host = float(env.get("EO_HOST_BUDGET_GIB") or 0)
    kv = pick(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes", None)
    return Serving(
        name=name or f"{pp} card(s)",
        pp_size=int(pp),
        usable_vram_bytes=usable,
        max_model_len=pick(args.max_model_len, "--max-model-len", None),
        max_num_seqs=pick(args.max_num_seqs, "--max-num-seqs", 256),
        max_num_batched_tokens=pick(args.max_num_batched_tokens, "--max-num-batched-tokens", 2048),
        kv_cache_memory_bytes=kv,
        mamba_cache_mode=pick(args.mamba_cache_mode, "--mamba-cache-mode", "none", str),
        ple_table=args.ple_table or env.get("VLLM_PLE_TABLE") or "gpu",
        host_gib_per_card=host,
        layer_partition=parts,
        prefill_staging=_on(args.prefill_staging, env.get("VLLM_EXPERT_PREFILL_STAGING")),
        one_table=_on(args.one_table, env.get("VLLM_EXPERT_ONE_TABLE")),
    )


def _on(flag: bool | None, env_value: str | None) -> bool:
    """A switch from its flag (--x / --no-x), else the compose file's variable."""
    if flag is not None:
        return flag
    return (env_value or "0") not in ("", "0")


def build_parser() -> argparse.ArgumentParser:
    """The flags; each setting's flag overrides the compose file's value (build_serving)."""
    ap = argparse.ArgumentParser(
        prog="memory-plan",
        description="Per-card VRAM and host RAM of a MoE model under a topology, from its "
        "config.json and safetensors headers (no tensor data is read; without safetensors "
        "files every size is estimated from the config). It sizes the layers of Qwen3-MoE "
        "(Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, ...), Qwen3-Next and Qwen4Exp "
        "models, and refuses other architectures. Settings come from compose/"
        "<topology>.yml (or --compose FILE), its ${VAR:-default} taken from the environment "
        "as docker compose takes them (e.g. PREFILL_STAGING=1 MAX_NUM_BATCHED_TOKENS=8192 "
        "HOST_BUDGET_GIB=10.5); each flag overrides them.",
        epilog="Exit codes: 0 every card fits and the KV cache holds one request at "
        "--max-model-len; 1 some card or KV cache does not (the table says which, and what "
        "to change); 2 bad input.",
    )
    ap.add_argument("model", type=pathlib.Path, help="checkpoint folder, or its config.json")
    ap.add_argument("--topology", help=f"one of {', '.join(TOPOLOGIES)}")
    ap.add_argument("--compose", type=pathlib.Path, help="read the settings of this compose file")
    ap.add_argument("--pp-size", type=int)
    ap.add_argument("--vram-gib", type=float, help="usable VRAM per card (GiB)")
    ap.add_argument(
        "--host-gib-per-card",
        type=float,
        help="cold set size: GiB of routed "
        "experts per card on host (default: the compose file's EO_HOST_BUDGET_GIB)",
    )
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--kv-cache-memory-bytes", type=int)
    ap.add_argument("--mamba-cache-mode", choices=["none", "align", "all"])
    ap.add_argument(
        "--ple-table",
        choices=["gpu", "host", "file", "auto"],
        help="where the PLE n-gram table "
        "lives (VLLM_PLE_TABLE; default: the compose file's, else gpu as upstream): host "
        "counts it page-locked, file counts the page cache it wants apart (not locked), auto "
        "counts file and says what pinning would need",
    )
    ap.add_argument("--layer-partition", help="VLLM_PP_LAYER_PARTITION, e.g. 25,23")
    ap.add_argument(
        "--prefill-staging",
        action=argparse.BooleanOptionalAction,
        help="count prefill staging's VRAM (VLLM_EXPERT_PREFILL_STAGING=1; default: the "
        "compose file's)",
    )
    ap.add_argument(
        "--one-table",
        action=argparse.BooleanOptionalAction,
        help="count one table with the runtime swap (VLLM_EXPERT_ONE_TABLE=1; default: the "
        "compose file's)",
    )
    ap.add_argument("--config-only", action="store_true", help="ignore safetensors files")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; EXIT_FITS, EXIT_DOES_NOT_FIT, or EXIT_USAGE for an input it cannot use."""
    args = build_parser().parse_args(argv)
    try:
        path = args.model
        config = path if path.is_file() else path / "config.json"
        shape = load_shape(config)
        files = [] if args.config_only or path.is_file() else safetensors_files(path)
        weights = header_weights(shape, files) if files else estimate_weights(shape)
        serving = build_serving(args)
        if serving.max_model_len is None:
            raise PlanError("no --max-model-len (and none in the compose file): give one")
        plan = make_plan(shape, weights, serving, model=config.parent.name)
    except PlanError as e:
        print(f"memory-plan: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(to_json(plan), indent=1))
    else:
        print(render_markdown(plan), end="")
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
