# SPDX-License-Identifier: Apache-2.0
"""The usage-counting hook in a live engine, through one table with the runtime swap moving
rows all the time: `scripts/count-experts --source engine` counts a data set, and its counts
must be the planted routers' picks of the same text (`--source synthetic`), per expert id;
the per-token pick trace holds only picks the counts hold.

    scripts/test-gpu tests/gpu/test_counting_engine.py -s   (env: README.md)
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from eodev import gpu_harness as gh
from eotools.count_experts import HookFiles
from eotools.counts import load_counts

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[2]
DECODE = 48
TRACE = 64


def _count(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, source: str, env=None):
    cmd = [
        sys.executable,
        str(ROOT / "scripts/count-experts"),
        "--source",
        source,
        "--model",
        str(model),
        "--data",
        f"legal={data}",
        "--decode-tokens",
        str(DECODE),
        "--out-dir",
        str(out),
    ]
    if source == "engine":
        # the harness's engine settings (compile cache shared with the other GPU tests)
        for key, value in gh.engine().items():
            cmd += ["--engine-arg", f"{key}={json.dumps(value)}"]
    start = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = out.parent / f"count-experts-{source}.log"
    log.write_text(r.stdout + r.stderr)
    # into the suite's log at once: a step cut off later still says how this ended
    gh.log(
        f"count-experts --source {source}: exit {r.returncode} after "
        f"{time.monotonic() - start:.0f} s ({log})"
    )
    if r.returncode != 0:
        gh.log("\n".join((r.stdout + r.stderr).splitlines()[-40:]))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return load_counts(out / "legal.json")


def _agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Share of the planted picks that the engine counted for the same (layer, expert)."""
    return float(np.minimum(got, want).sum() / want.sum())


def test_engine_counts_through_a_swapping_table_match_the_planted_picks(int4_model, int4_cold_file):
    # under EO_GPU_WORK, not pytest's tmp folder: gpu-suite packs it with the engine runs
    work = gh.WORK / "runs" / "counting-engine"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = int4_model / "data" / "legal.heldout.jsonl"
    env = gh.engine_env(patched=True)
    env.update(
        VLLM_EXPERT_COLD_FILE=str(int4_cold_file),
        VLLM_EXPERT_ONE_TABLE="1",
        # a swap in every layer at every decode step: rows and expert ids part at once
        VLLM_EXPERT_SWAP_INTERVAL="1",
        VLLM_EXPERT_SWAP_HALF_LIFE="1",
        VLLM_EXPERT_SWAP_MARGIN="-1",
        VLLM_EXPERT_COUNT_TRACE_TOKENS=str(TRACE),
    )
    engine = _count(int4_model, data, work / "engine", "engine", env)
    planted = _count(int4_model, data, work / "planted", "synthetic")
    log = (work / "count-experts-engine.log").read_text()
    layers_n = planted.prefill.shape[0]
    offload_lines = [line for line in log.splitlines() if "Expert offload" in line]
    gh.log("\n".join(offload_lines[-12:]))
    assert f"runtime swap on {layers_n} one-table layers" in log, "no one table (see the log)"

    pre = _agreement(engine.prefill, planted.prefill)
    dec = _agreement(engine.decode, planted.decode)
    gh.log(
        f"counting through one table: {engine.tokens('prefill')} prefill and "
        f"{engine.tokens('decode')} decode tokens (planted: {planted.tokens('prefill')}, "
        f"{planted.tokens('decode')}); agreement with the planted routers: "
        f"prefill {pre:.4f}, decode {dec:.4f}"
    )
    assert engine.tokens("prefill") == planted.tokens("prefill")
    assert engine.tokens("decode") == planted.tokens("decode")
    # up to BF16 near-ties of the router logits (tests/README.md), and greedy decode
    # following the planted chain (test_smoke: > 95%)
    assert pre > 0.97 and dec > 0.90, (pre, dec)

    [trace_file] = (work / "engine" / ".engine-counts").glob("*.picks.npz")
    trace = np.load(trace_file)
    picks, layers = trace["picks"], trace["layers"]
    assert picks.shape == (TRACE, len(layers), engine.top_k)
    # the trace is the first decode tokens' picks: every one of them is in the counts
    [hook_file] = HookFiles(work / "engine" / ".engine-counts" / "counts.json").rank_files()
    hook_total = load_counts(hook_file)
    for i, layer in enumerate(layers):
        seen = np.bincount(picks[:, i].ravel(), minlength=engine.decode.shape[1])
        assert (seen <= hook_total.decode[layer]).all(), f"layer {layer}"
