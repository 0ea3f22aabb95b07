# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the CPU tests that run layers of the patched vLLM, the fake CUDA driver that
the VMM tests give the series' vmm module, and the runner of kernel checks in Triton's
interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def vllm_cpu():
    """A single-process vLLM context (config, gloo process group) for building MoE layers."""
    from eodev.vllm_context import single_process_vllm

    with single_process_vllm("gloo") as config:
        yield config


@pytest.fixture
def fake(monkeypatch):
    """vmm.py's driver replaced by the fake of test_vmm_driver_calls.py (no GPU), with no
    injected failures."""
    from test_vmm_driver_calls import FakeDriver
    from vllm.model_executor.layers.fused_moe.expert_offload import vmm

    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_driver_module", drv)
    monkeypatch.setattr(vmm, "FAIL_AT", set())
    monkeypatch.delenv(vmm.FAIL_AT_ENV, raising=False)
    return drv


@pytest.fixture
def run_interpreted(repo_root):
    """Run a checks file of tests/cpu through Triton's interpreter, in a process of its own
    (Triton fixes the interpreter mode when it is first imported, and this process has
    imported it compiled); fail unless exactly ``expected`` checks ran and passed (none
    skipped or deselected)."""

    def run(checks: str, expected: int) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", checks],
            cwd=repo_root,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert re.fullmatch(r"=* ?\d+ passed(, \d+ warnings?)? in .*", summary), summary
        assert int(re.search(r"(\d+) passed", summary).group(1)) == expected, summary

    return run
