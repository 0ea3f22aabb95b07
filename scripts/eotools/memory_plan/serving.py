# SPDX-License-Identifier: Apache-2.0
"""What the plan is for: the topology's cards and the vLLM arguments that decide memory, as
flags give them or as a compose file's service starts vLLM."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..compose import read_service
from ..selection import GiB, MiB

# What a card reports (nvidia-smi) and what is left after the driver: the publisher's
# RTX 5090 reports 32,607 MiB and counts ~31.4 GiB usable (its 2x32GB write-up, section 1);
# the same margin is taken from the RTX 3090/4090's 24,576 MiB.
REPORTED_MIB = {32: 32607, 24: 24576}
DRIVER_MARGIN_GIB = 32607 / 1024 - 31.4


@dataclass
class Serving:
    """What the plan is for: the topology and the vLLM arguments that decide memory."""

    name: str
    pp_size: int
    usable_vram_bytes: int | None  # per card; None: any size
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int | None
    mamba_cache_mode: str
    ple_table: str  # VLLM_PLE_TABLE: "gpu", "host", "file" or "auto"
    host_gib_per_card: float
    layer_partition: list[int] | None
    prefill_staging: bool = False  # VLLM_EXPERT_PREFILL_STAGING=1
    one_table: bool = False  # VLLM_EXPERT_ONE_TABLE=1: one table with the runtime swap


def usable_vram_bytes(vram_gib: float) -> int:
    """What a card of `vram_gib` nominal GB leaves to vLLM (seed: a 5090's 31.4 GiB)."""
    reported = REPORTED_MIB.get(round(vram_gib), vram_gib * 1000**3 / MiB)
    return int((reported / 1024 - DRIVER_MARGIN_GIB) * GiB)


def read_compose(path: pathlib.Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The serving settings of a compose file, its ${VAR:-default} taken from `environ` as
    Compose does (None: the defaults)."""
    svc = read_service(path, environ)
    args = svc.command
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, inline = arg.partition("=")
            nxt = args[i + 1] if i + 1 < len(args) else None
            flags[key] = inline if eq else (None if nxt is None or nxt.startswith("--") else nxt)
    return {
        "flags": flags,
        "env": svc.environment,
        "topology": svc.build_args.get("TOPOLOGY"),
        "model": args[0] if args else None,
    }
