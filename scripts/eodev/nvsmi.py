# SPDX-License-Identifier: Apache-2.0
"""nvidia-smi queries for reports: a missing tool, a failing driver or a timeout give None
(the report says "unknown"), never an error in the middle of a benchmark."""

from __future__ import annotations

import subprocess


def query(*args: str, timeout: float = 30) -> list[list[str]] | None:
    """`nvidia-smi ARGS --format=csv,noheader,nounits`: one list of stripped fields per
    output line; None where nvidia-smi cannot answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_name() -> str:
    """The GPUs' model names ('unknown' without nvidia-smi)."""
    rows = query("--query-gpu=name", timeout=20)
    return ", ".join(sorted({r[0] for r in rows})) if rows else "unknown"
