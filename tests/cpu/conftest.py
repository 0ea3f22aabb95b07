# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the CPU tests that run layers of the patched vLLM."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vllm_cpu():
    """A single-process vLLM context (config, gloo process group) for building MoE layers."""
    from eodev.vllm_context import single_process_vllm

    with single_process_vllm("gloo") as config:
        yield config
