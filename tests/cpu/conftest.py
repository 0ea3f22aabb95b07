# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the CPU tests that run layers of the patched vLLM, and the fake CUDA driver
that the VMM tests give the series' vmm module."""

from __future__ import annotations

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
