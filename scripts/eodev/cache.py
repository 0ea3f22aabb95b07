# SPDX-License-Identifier: Apache-2.0
"""The download cache shared with scripts/lib/pin.sh (EO_CACHE, else
$XDG_CACHE_HOME/vllm-expert-offload, else ~/.cache/vllm-expert-offload)."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    if os.environ.get("EO_CACHE"):
        return pathlib.Path(os.environ["EO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "vllm-expert-offload"
