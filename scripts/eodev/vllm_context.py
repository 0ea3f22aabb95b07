# SPDX-License-Identifier: Apache-2.0
"""A single-process vLLM context for tests that build layers without an engine: the current
VllmConfig, a one-rank process group and model-parallel groups (FusedMoEFactory queries them)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_vllm(backend: str) -> Iterator[object]:
    """Yield a VllmConfig that is current, with world size 1 on `backend` (gloo or nccl)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend=backend,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
