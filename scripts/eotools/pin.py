# SPDX-License-Identifier: Apache-2.0
"""The vLLM pin, read from vllm.pin at the repository root (the only place it is written)."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
PIN_FILE = ROOT / "vllm.pin"


@dataclass(frozen=True)
class Pin:
    vllm_version: str
    vllm_commit: str
    vllm_wheel: str
    vllm_wheel_sha256: str
    vllm_image: str
    torch_version: str


def read_pin(path: pathlib.Path = PIN_FILE) -> Pin:
    """Parse the PIN_* assignments of vllm.pin; an unknown or missing key is an error."""
    values: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"PIN_([A-Z0-9_]+)=(\S*)", line)
        if not m:
            raise ValueError(f"{path}:{n}: cannot read {line!r} (expected PIN_NAME=value)")
        values[m.group(1).lower()] = m.group(2)
    return Pin(**values)


PIN = read_pin()
