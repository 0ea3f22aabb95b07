# SPDX-License-Identifier: Apache-2.0
"""The one way a shipped tool reaches the development tools (scripts/eodev): the synthetic
test model's planted routers, which `count-experts --source synthetic` and `simulate-swap
--model` read. The image ships eotools alone, so there these paths stop with a message."""

from __future__ import annotations

import importlib
from types import ModuleType


class DevToolsMissing(ValueError):
    """scripts/eodev is not beside this package (in the image, or a copy of eotools alone)."""


def dev_module(name: str, what: str) -> ModuleType:
    """Import eodev.`name`, or raise DevToolsMissing naming `what` needed it and the fix."""
    try:
        return importlib.import_module(f"eodev.{name}")
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("eodev"):
            raise
        raise DevToolsMissing(
            f"{what} works on make-test-model checkpoints and needs the development tools "
            "(scripts/eodev), which the image does not ship: run it from a checkout of the "
            "project, or count a real model with --source server"
        ) from e
