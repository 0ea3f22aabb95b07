# SPDX-License-Identifier: Apache-2.0
"""Prefill staging (VLLM_EXPERT_PREFILL_STAGING=1) on a real engine, CUDA graphs on: the same
kernel on a VRAM copy of the same bytes, so offload-02 with staging gives offload-02's tokens,
and its logprobs differ from offload-02's no more than 1.5x as much as two offload-02 engines'
differ from each other (`lp.SAME_KERNELS_TOLERANCE`; prompt and decode, prefill chunks of 512
and 2048 tokens staged, decode not). Separate engine processes are not bit-identical on prompt
logprobs even unpatched (H200, 2026-12-01: prompt max 0.12 between two identical unpatched
engines), so the bound is that noise, measured in the same run, not zero. The start-up line
states the slots' VRAM. TTFT of the engines is logged for the record; the speed result comes
from `bench-offload`.

    scripts/test-gpu tests/gpu/test_prefill_staging_gpu.py -s
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
from eodev import gpu_harness as gh
from eodev import logprob_noise as lp
from test_offload_correctness import _prompts, _tasks

pytestmark = pytest.mark.gpu
STAGED = {"VLLM_EXPERT_PREFILL_STAGING": "1", "VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS": "256"}


@pytest.fixture(scope="module")
def runs(int4_model, int4_cold_file) -> dict[str, dict]:
    share = float(os.environ.get("EO_GPU_MEMORY_UTILIZATION") or 0.2)
    cold = {"VLLM_EXPERT_COLD_FILE": str(int4_cold_file)}
    _, long = _prompts(int4_model)
    ttft = {"kind": "ttft", "name": "ttft", "prompt": long, "repeats": 3}
    members = {
        "staging-unpatched": (False, {}),
        "staging-off": (True, cold),
        "staging-off-again": (True, cold),
        "staging-on": (True, {**cold, **STAGED}),
    }
    out = {}
    for chunk in (512, 2048):
        group = [
            (
                f"{name}-{chunk}",
                {
                    "model": str(int4_model),
                    "env": env,
                    "engine": gh.engine(max_num_batched_tokens=chunk, gpu_memory_utilization=share),
                    "tasks": [*_tasks(int4_model), ttft],
                },
                patched,
                None,
            )
            for name, (patched, env) in members.items()
        ]
        results = gh.run_engine_group(group, stagger=2)
        failed = [
            f"{m[0]}: {r}" for m, r in zip(group, results, strict=True) if isinstance(r, Exception)
        ]
        assert not failed, "\n\n".join(failed)
        out.update({m[0]: r for m, r in zip(group, results, strict=True)})
    return out


@pytest.mark.parametrize("chunk", [512, 2048])
def test_staging_gives_offload02s_numbers_up_to_its_noise(runs, chunk):
    on, off = runs[f"staging-on-{chunk}"], runs[f"staging-off-{chunk}"]
    d = lp.diff_runs(on, off)
    noise = lp.noise({"same_config": (off, runs[f"staging-off-again-{chunk}"])})
    report = {
        "chunk": chunk,
        "staged_vs_unstaged": d,
        "unstaged_noise": noise,
        "vs_unpatched": lp.diff_runs(on, runs[f"staging-unpatched-{chunk}"]),
        "ttft_ms": {
            name: runs[f"{name}-{chunk}"]["tasks"]["ttft"]["ttft_ms"]
            for name in ("staging-unpatched", "staging-off", "staging-off-again", "staging-on")
        },
    }
    gh.log(json.dumps(report))
    (gh.WORK / f"prefill-staging-{chunk}.json").write_text(json.dumps(report, indent=1))
    assert d["tokens_identical"]
    assert report["vs_unpatched"]["tokens_identical"]
    # the same kernel on the same bytes, against a noise of one pair
    problems = lp.failures(d, noise, lp.SAME_KERNELS_TOLERANCE)
    assert not problems, "; ".join(problems)


def test_the_startup_line_states_the_staging_vram(runs):
    log = pathlib.Path(runs["staging-on-2048"]["log_file"]).read_text()
    m = re.search(r"prefill staging on: forwards of (\d+) tokens.*\(2 x ([\d.]+) MiB", log)
    assert m, "no start-up line for prefill staging"
    assert int(m[1]) == 256 and float(m[2]) > 0
    assert "prefill staging" not in pathlib.Path(runs["staging-off-2048"]["log_file"]).read_text()
