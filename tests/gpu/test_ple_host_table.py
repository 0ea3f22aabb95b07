# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp's PLE n-gram tables in page-locked host memory (VLLM_PLE_TABLE=host) against the
tables in VRAM (VLLM_PLE_TABLE=gpu), both with the patched vLLM and CUDA graphs on: greedy
tokens identical, and the per-token cost of reading the table over PCIe, in decode (one
stream) and in prefill (a 2,600-token prompt), the two engines side by side taking turns.
The cost is a measurement (marker `measurement`), run with --measurements:

    scripts/test-gpu tests/gpu/test_ple_host_table.py --measurements -s   (docs/developing.md)

The model: EO_QWEN4EXP_MODEL (a Qwen4Exp checkpoint folder with PLE layers), else one made
by ``scripts/make-test-model $EO_QWEN4EXP_MAKE_ARGS`` (default "--arch qwen4_exp --preset
tiny") under EO_GPU_WORK. EO_QWEN4EXP_ENGINE: JSON of LLM keyword arguments to add (e.g.
'{"mamba_cache_mode": "align"}'). The numbers go to EO_GPU_WORK/ple-host-vs-gpu.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import random

import pytest
from eodev import gpu_harness as gh

pytestmark = pytest.mark.gpu
DECODE = 32


@pytest.fixture(scope="module")
def qwen4exp_model() -> pathlib.Path:
    if path := os.environ.get("EO_QWEN4EXP_MODEL"):
        return pathlib.Path(path)
    args = os.environ.get("EO_QWEN4EXP_MAKE_ARGS", "--arch qwen4_exp --preset tiny").split()
    return gh.make_model("qwen4exp-" + "-".join(a.lstrip("-") for a in args), *args)


def _text_config(model: pathlib.Path) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _prompts(model: pathlib.Path) -> tuple[list[list[int]], list[int]]:
    """Three short prompts and one of 2,600 tokens (two prefill chunks at 2048), random
    token ids of the model's vocabulary (a fixed seed: the same for both engines)."""
    vocab = int(_text_config(model)["vocab_size"])
    rng = random.Random(7)
    short = [[rng.randrange(1, vocab) for _ in range(n)] for n in (17, 64, 200)]
    long = [rng.randrange(1, vocab) for _ in range(2600)]
    return short, long


def _config(model: pathlib.Path, placement: str) -> dict:
    short, long = _prompts(model)
    extra = json.loads(os.environ.get("EO_QWEN4EXP_ENGINE") or "{}")
    return {
        "model": str(model),
        "env": {"VLLM_PLE_TABLE": placement},
        "engine": gh.engine(**extra),
        "tasks": [
            {
                "kind": "greedy",
                "name": "greedy",
                "prompts": [*short, long],
                "max_tokens": DECODE,
                "concurrency": 1,
            },
            {
                "kind": "decode_timing",
                "name": "decode",
                "prompts": [short[1]],
                "max_tokens": 256,
                "warmup": 1,
                "repeats": 3,
            },
            {"kind": "ttft", "name": "prefill", "prompt": long, "repeats": 5},
        ],
    }


@pytest.fixture(scope="module")
def runs(qwen4exp_model) -> tuple[dict, dict]:
    assert _text_config(qwen4exp_model).get("ple_layer_ids"), (
        f"{qwen4exp_model} has no PLE layers (ple_layer_ids); this test needs a Qwen4Exp "
        "model with PLE"
    )
    return gh.run_engine_pair(
        ("ple-table-gpu", _config(qwen4exp_model, "gpu"), True),
        ("ple-table-host", _config(qwen4exp_model, "host"), True),
    )


def test_host_table_gives_the_tokens_of_the_table_in_vram(runs):
    gpu, host = runs
    a = gpu["tasks"]["greedy"]["outputs"]
    b = host["tasks"]["greedy"]["outputs"]
    assert len(a) == len(b) == 4
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["token_ids"] == y["token_ids"], f"prompt {i}: greedy tokens differ"
    # the same bytes gathered from another memory: logprobs should match to run-to-run noise
    diff = max(
        abs(p - q)
        for x, y in zip(a, b, strict=True)
        for p, q in zip(x["logprobs"], y["logprobs"], strict=True)
    )
    gh.log(f"PLE host vs gpu: max decode logprob difference {diff:.3g}")


def test_start_up_says_where_the_table_is(runs):
    gpu, host = runs
    gpu_log = pathlib.Path(gpu["log_file"]).read_text()
    host_log = pathlib.Path(host["log_file"]).read_text()
    assert "in VRAM (VLLM_PLE_TABLE=gpu)" in gpu_log
    assert "in page-locked host memory, read by the GPU through UVA" in host_log
    assert "in VRAM (VLLM_PLE_TABLE=gpu)" not in host_log


@pytest.mark.measurement
def test_measure_the_per_token_cost_of_the_host_table(runs):
    """The numbers for bench/results, no threshold on them: each engine's decode speed is
    the median over repeats of one stream's tokens/s; prefill is the median time to the
    first token of the 2,600-token prompt. Asserted: both engines decoded and prefilled."""
    gpu, host = runs

    def numbers(run: dict) -> dict:
        dec = run["tasks"]["decode"]
        pre = sorted(run["tasks"]["prefill"]["ttft_ms"])
        return {
            "decode_tok_s": sorted(dec["decode_tok_s"])[len(dec["decode_tok_s"]) // 2],
            "tpot_ms_p50": dec["tpot_ms_p50"],
            "tpot_ms_p90": dec["tpot_ms_p90"],
            "prefill_ms_median": pre[len(pre) // 2],
            "prefill_tokens": run["tasks"]["prefill"]["prompt_tokens"],
        }

    g, h = numbers(gpu), numbers(host)
    report = {
        "gpu": g,
        "host": h,
        "decode_tpot_added_ms": h["tpot_ms_p50"] - g["tpot_ms_p50"],
        "prefill_added_us_per_token": (h["prefill_ms_median"] - g["prefill_ms_median"])
        * 1e3
        / h["prefill_tokens"],
    }
    (gh.WORK / "ple-host-vs-gpu.json").write_text(json.dumps(report, indent=1))
    gh.log("PLE host vs gpu: " + json.dumps(report))
    assert g["decode_tok_s"] > 0 and h["decode_tok_s"] > 0
    assert g["prefill_tokens"] == h["prefill_tokens"] == 2600
