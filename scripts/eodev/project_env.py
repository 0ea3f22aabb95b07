# SPDX-License-Identifier: Apache-2.0
"""Run a tool of scripts/ in the project's test environment when started with another Python.

The tools are started as `scripts/NAME` (`#!/usr/bin/env python3`), so the Python that runs them
is whichever is first on PATH, often one without the packages a tool needs (aiohttp, torch).
Such a tool re-runs itself with the project's environment (EO_VENV, default .venv, made by
scripts/dev-env) where that has them, and otherwise stops with a message instead of a
traceback.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

from eotools.pin import ROOT


def project_python() -> pathlib.Path:
    return pathlib.Path(os.environ.get("EO_VENV") or ROOT / ".venv") / "bin" / "python"


def use_project_env(*modules: str) -> None:
    """Return if this Python has `modules`; else exec the project's environment's Python with
    the same arguments, or exit 1 saying what is missing and how to get it."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    python = project_python()
    here = pathlib.Path(sys.prefix).resolve()
    if python.exists() and here != python.parent.parent.resolve():
        os.execv(python, [str(python), sys.argv[0], *sys.argv[1:]])
    tool = pathlib.Path(sys.argv[0]).name
    where = f"{python} has not" if python.exists() else f"there is no {python}"
    sys.exit(
        f"error: {tool} needs {', '.join(missing)}, which {sys.executable} does not have, and "
        f"{where} either: run scripts/dev-env (it makes the project's environment; EO_VENV "
        f"picks another place), or run {tool} with a Python that has them"
    )
