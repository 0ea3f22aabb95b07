# SPDX-License-Identifier: Apache-2.0
"""Shared pytest setup: GPU tests are skipped, with the reason, where CUDA is not available
(and fail the run where scripts/test-gpu says this is a GPU host); tests marked
`measurement` run only with --measurements."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# vLLM's platform detection needs this on a machine without a GPU; GPU hosts unset it.
if os.environ.get("EO_GPU_HOST") != "1":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--measurements",
        action="store_true",
        help="also run the tests marked `measurement` (timings and cost reports; tests/README.md)",
    )


def _no_cuda_reason() -> str | None:
    """None where torch sees a CUDA GPU, else why not."""
    try:
        import torch
    except ImportError as e:  # the image workflow's test environment has no torch
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    return None


def _deselect_measurements(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--measurements") or "measurement" in (config.option.markexpr or ""):
        return
    keep = [item for item in items if "measurement" not in item.keywords]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if "measurement" in i.keywords])
        items[:] = keep


@pytest.hookimpl(trylast=True)  # after -m and -k: only the GPU tests that would run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_measurements(config, items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _no_cuda_reason()
    if reason is None:
        return
    if os.environ.get("EO_GPU_HOST") == "1":
        # scripts/test-gpu: a GPU host whose GPU tests all skip has tested nothing
        pytest.exit(
            f"EO_GPU_HOST=1 (scripts/test-gpu) but {reason}: check the driver, "
            "CUDA_VISIBLE_DEVICES and the torch in EO_VLLM_SITE",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    skip = pytest.mark.skip(
        reason=f"needs a CUDA GPU ({reason}): run on a GPU host (docs/developing.md, 'GPU tests')"
    )
    for item in gpu_items:
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
