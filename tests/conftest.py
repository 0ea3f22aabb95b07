# SPDX-License-Identifier: Apache-2.0
"""Shared pytest setup: GPU tests are skipped, with the reason, where CUDA is not available."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# vLLM's platform detection needs this on a machine without a GPU; GPU hosts unset it.
if os.environ.get("EO_GPU_HOST") != "1":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on a GPU host (README.md, 'GPU tests')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A make-test-model description without weights (tiny preset, INT4, 4 layers): config,
    tokenizer and synthetic_model.json, which states the expert bytes."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("models") / "tiny-int4-4l"
    cmd = [sys.executable, str(ROOT / "scripts/make-test-model"), str(out), "--preset", "tiny"]
    subprocess.run([*cmd, "--layers", "4", "--no-weights"], check=True, capture_output=True)
    return out
