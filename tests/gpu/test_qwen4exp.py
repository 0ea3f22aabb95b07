# SPDX-License-Identifier: Apache-2.0
"""The whole series on the Qwen4Exp test model (make-test-model --arch qwen4_exp --preset tiny,
INT4: PLE, hyper-connections, QSA, Gated DeltaNet, 512 experts top-10 with the gated shared
expert), PP=1, CUDA graphs on: offload-01, offload-02, one table, one table with the runtime
swap, each with the counting hook on (offload-02 and the swap also write the snapshots /metrics
is served from), against the unpatched engine: greedy tokens identical and
logprob differences within the unpatched engine's own noise (`eodev.logprob_noise`: twice
that where the kernel's sums are reordered by design, 1.5x where the engine runs the very
kernels of its reference, as offload-01 and the PLE pair do), judged per prompt
(`lp.PER_PROMPT_STATS`: a rounding flip in a Gated DeltaNet layer carries to every later
token of its prompt, so the mean over all prompts measures where the first flip fell). The
shared expert's output is in every token (its down projection writes the token subspace the LM
head reads). And the PLE table in
host memory (VLLM_PLE_TABLE=host) against the same patched engine with it in VRAM (gpu): the
same tokens.

All ten engines start side by side on the GPU (one start-up's time, about 2-3 minutes on an
H200, instead of ten), then take turns request by request (gpu_harness.run_engine_group).

    EO_VLLM_SITE=/tmp/site EO_VLLM_PATCHED=... python3 -m pytest tests/gpu/test_qwen4exp.py \\
        -m gpu -s   (env: tests/README.md, "GPU tests"; scripts/test-gpu runs it the same way)
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Callable

import numpy as np
import pytest
from conftest import compared_tasks, heldout_prompts, plan_of
from eodev import gpu_harness as gh
from eodev import logprob_noise as lp
from eodev.testmodel import data

pytestmark = pytest.mark.gpu
DECODE = 48
HOST_EXPERTS = 64  # of 512 per layer: 12.5%
SWAP_STRESS_STEPS = 600
KV_BYTES = 1 << 30  # the tiny model needs little; ten engines share the GPU
CHUNK = 1024  # prefill chunk: the long prompt takes two

SWAP_ENV = {
    "VLLM_EXPERT_ONE_TABLE": "1",
    "VLLM_EXPERT_SWAP_INTERVAL": "1",
    "VLLM_EXPERT_SWAP_HALF_LIFE": "1",
    "VLLM_EXPERT_SWAP_MARGIN": "-1",
    "VLLM_EXPERT_SWAP_SELF_CHECK": "100",
}


@pytest.fixture(scope="module")
def model() -> pathlib.Path:
    return gh.make_model(
        "qwen4exp-tiny-int4", "--arch", "qwen4_exp", "--preset", "tiny", "--quant", "int4"
    )


@pytest.fixture(scope="module")
def cold_file(model) -> pathlib.Path:
    from eodev.synthetic_cold import synthetic_cold_file

    out = gh.WORK / f"cold-{model.name}.json"
    if not out.exists():
        synthetic_cold_file(model, out, HOST_EXPERTS)
    return out


def _tasks(model: pathlib.Path, rebatched: bool = False, stress: int = 0) -> list[dict]:
    """Three held-out prompts and a ~1,750-token one (two prefill chunks of CHUNK; within
    QSA's 2048-token budget, where its selection keeps every token, so layer 0's attention is
    the planted prefix mean), decoded alone (c1) and two at a time (c2); `rebatched` swaps
    the two batchings (the unpatched noise of batching)."""
    plan = plan_of(model)
    long = [
        t for c in data.conversations(plan, "legal", "heldout", 7, 250, seed=3) for t in c.token_ids
    ]
    return compared_tasks(heldout_prompts(plan), long, DECODE, rebatched, stress)


def _count_file(name: str) -> pathlib.Path:
    return gh.WORK / "runs" / "qwen4exp-counts" / name / "counts.json"


def _metrics_dir(name: str) -> pathlib.Path:
    return gh.WORK / "runs" / "qwen4exp-metrics" / name


METERED = ("q4-offload02", "q4-onetable-swap")  # the snapshots /metrics is served from


# name -> (patched, env, rebatched, swap stress steps)
def _members(cold: pathlib.Path) -> dict[str, tuple[bool, dict, bool, int]]:
    c = str(cold)
    return {
        "q4-unpatched": (False, {}, False, 0),
        "q4-offload01": (True, {"VLLM_EXPERT_HOST_LAYERS": "0"}, False, 0),
        "q4-unpatched-again": (False, {}, False, 0),
        "q4-unpatched-third": (False, {}, False, 0),
        "q4-unpatched-rebatched": (False, {}, True, 0),
        "q4-offload02": (True, {"VLLM_EXPERT_COLD_FILE": c}, False, 0),
        "q4-onetable": (
            True,
            {"VLLM_EXPERT_COLD_FILE": c, "VLLM_EXPERT_ONE_TABLE": "1", "VLLM_EXPERT_SWAP": "0"},
            False,
            0,
        ),
        "q4-onetable-swap": (
            True,
            {"VLLM_EXPERT_COLD_FILE": c, **SWAP_ENV},
            False,
            SWAP_STRESS_STEPS,
        ),
        "q4-ple-gpu": (True, {"VLLM_PLE_TABLE": "gpu"}, False, 0),
        "q4-ple-host": (True, {"VLLM_PLE_TABLE": "host"}, False, 0),
    }


COUNTED = ("q4-offload01", "q4-offload02", "q4-onetable", "q4-onetable-swap")


def _empty_folder(folder: pathlib.Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()


def run_side_by_side(
    model: pathlib.Path,
    members: dict[str, tuple[bool, dict, bool, int]],
    count_files: dict[str, pathlib.Path],
    share: float,
    engine_of: Callable[[str], dict] = lambda name: {},
    metrics_dirs: dict[str, pathlib.Path] | None = None,
) -> dict[str, dict]:
    """Engines (name -> patched, env, rebatched, swap stress steps) side by side, each with
    this file's tasks and engine settings (plus `engine_of(name)`); those in `count_files`
    count their picks into that file, those in `metrics_dirs` publish their /metrics
    snapshots into that folder (each folder emptied first). The first two (one unpatched,
    one patched) start alone, so that each compile cache is filled once."""
    group, prompts = [], {}
    for name, (patched, env, rebatched, stress) in members.items():
        env = dict(env)
        if name in count_files:
            path = count_files[name]
            _empty_folder(path.parent)
            env["VLLM_EXPERT_COUNT_FILE"] = str(path)
            env["VLLM_EXPERT_COUNT_INTERVAL_S"] = "0"
        if name in (metrics_dirs or {}):
            _empty_folder(metrics_dirs[name])
            env["VLLM_EXPERT_METRICS_DIR"] = str(metrics_dirs[name])
        config = {
            "model": str(model),
            "env": env,
            "engine": gh.engine(
                max_num_batched_tokens=CHUNK,
                kv_cache_memory_bytes=KV_BYTES,
                gpu_memory_utilization=share,
                **engine_of(name),
            ),
            "tasks": _tasks(model, rebatched, stress),
        }
        prompts[name] = {t["name"]: t["prompts"] for t in config["tasks"]}
        group.append((name, config, patched, None))
    out = gh.run_engine_group(group, stagger=2)
    failed = [f"{m[0]}: {r}" for m, r in zip(group, out, strict=True) if isinstance(r, Exception)]
    assert not failed, "\n\n".join(failed)
    return {name: {**res, "prompts": prompts[name]} for name, res in zip(members, out, strict=True)}


@pytest.fixture(scope="module")
def runs(model, cold_file) -> dict[str, dict]:
    """Every engine of this file, side by side."""
    share = float(os.environ.get("EO_GPU_MEMORY_UTILIZATION") or 0.08)
    counted = {name: _count_file(name) for name in COUNTED}
    metered = {name: _metrics_dir(name) for name in METERED}
    return run_side_by_side(model, _members(cold_file), counted, share, metrics_dirs=metered)


@pytest.fixture(scope="module")
def noise(runs) -> dict:
    a = runs["q4-unpatched"]
    return lp.noise(
        {
            "same_config": (a, runs["q4-unpatched-again"]),
            "same_config_2": (a, runs["q4-unpatched-third"]),
            "same_config_3": (runs["q4-unpatched-again"], runs["q4-unpatched-third"]),
            "batching": (a, runs["q4-unpatched-rebatched"]),
        }
    )


def _check(tag: str, run: dict, unpatched: dict, noise_: dict, tolerance: float) -> None:
    d = lp.diff_runs(run, unpatched)
    report = {"check": tag, "vs_unpatched": d, "unpatched_noise": noise_, "tolerance": tolerance}
    gh.log(json.dumps(report))
    (gh.WORK / f"correctness-{tag}.json").write_text(json.dumps(report, indent=1))
    problems = lp.failures(d, noise_, tolerance, lp.PER_PROMPT_STATS)
    assert not problems, f"{tag}: " + "; ".join(problems)


@pytest.mark.parametrize(
    "name,tolerance",
    [
        # the unpatched kernel call, on host memory
        ("q4-offload01", lp.SAME_KERNELS_TOLERANCE),
        ("q4-offload02", lp.REORDERED_SUM_TOLERANCE),  # two calls over disjoint experts
        # one call over all experts, rows fixed; on this geometry the INT4 one-table layer
        # is not bit-exact to the unsplit one (bench/results/2026-12-03-qwen4exp-gpu-h200.md)
        ("q4-onetable", lp.REORDERED_SUM_TOLERANCE),
        ("q4-onetable-swap", lp.REORDERED_SUM_TOLERANCE),  # rows move while it runs
    ],
)
def test_offload_matches_unpatched(runs, noise, name, tolerance):
    run = runs[name]
    mem = run["memory"]
    assert mem["moe_layers"] == 6  # the model's layers; MTP is not built without drafting
    assert mem["expert_host_bytes"] > 0
    if name.startswith("q4-onetable"):
        assert mem["one_table_layers"] == mem["moe_layers"]
        assert mem["one_table_gpu_rows_in_host_memory"] == 0
    if name == "q4-onetable-swap":
        before = run["tasks"]["stress"]["swap_delta"]["swaps"]
        gh.log(f"qwen4exp one table with swap: {before} swaps before the compared tasks")
        assert before > 0
        log = pathlib.Path(run["log_file"]).read_text()
        assert "self-check passed" in log and "self-check FAILED" not in log
    _check(name, run, runs["q4-unpatched"], noise, tolerance)


def _planted_counts(plan, run: dict) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(layers, experts) picks of the planted routers over what the engine ran: every prompt
    (prefill) and every generated token but the last (decode)."""
    g = plan.geometry
    prefill = np.zeros((g.num_layers, g.num_experts), np.int64)
    decode = np.zeros_like(prefill)
    n_pre = n_dec = 0
    for task, result in run["tasks"].items():
        for prompt, out in zip(run["prompts"][task], result["outputs"], strict=True):
            new = list(out["token_ids"])
            seq = np.asarray(prompt + new[:-1])
            for layer in range(g.num_layers):
                picks = plan.router_topk(layer, seq)
                np.add.at(prefill[layer], picks[: len(prompt)].ravel(), 1)
                np.add.at(decode[layer], picks[len(prompt) :].ravel(), 1)
            n_pre += len(prompt)
            n_dec += len(new) - 1
    return prefill, decode, n_pre, n_dec


@pytest.mark.parametrize("name", COUNTED)
def test_counts_hold_every_pick_and_follow_the_planted_routers(model, runs, name):
    """The counting hook under each offload configuration: six layers (not MTP's), top_k
    picks per token, and the planted routers' picks (through hyper-connections, PLE, QSA and
    Gated DeltaNet, which the test model keeps off the router's dimensions)."""
    from eotools.count_experts import HookFiles
    from eotools.counts import load_counts

    plan = plan_of(model)
    [path] = HookFiles(_count_file(name)).rank_files()
    c = load_counts(path)
    assert c.prefill.shape == (plan.geometry.num_layers, plan.geometry.num_experts)
    k = plan.geometry.top_k
    assert (c.prefill.sum(1) == c.tokens("prefill") * k).all()
    assert (c.decode.sum(1) == c.tokens("decode") * k).all()
    pre, dec, n_pre, n_dec = _planted_counts(plan, runs[name])
    assert (c.tokens("prefill"), c.tokens("decode")) == (n_pre, n_dec)
    agree_pre = float(np.minimum(c.prefill, pre).sum() / pre.sum())
    agree_dec = float(np.minimum(c.decode, dec).sum() / dec.sum())
    gh.log(f"{name}: planted-router agreement prefill {agree_pre:.4f}, decode {agree_dec:.4f}")
    # BF16 near-ties of the router logits (tests/README.md, "What is planted")
    assert agree_pre > 0.97 and agree_dec > 0.97, (agree_pre, agree_dec)


@pytest.mark.parametrize("name", METERED)
def test_metrics_snapshots_hold_the_placement_and_the_swaps_counters(runs, name):
    """The rank snapshot the API server's /metrics reads (VLLM_EXPERT_METRICS_DIR), as the
    worker left it at shutdown: the path and bytes it placed, and with the runtime swap its
    counters, which include the stress task's swaps."""
    run, mem = runs[name], runs[name]["memory"]
    doc = json.loads((_metrics_dir(name) / "rank-dp0_pp0_tp0.json").read_text())
    assert doc["layers"] == mem["moe_layers"] == 6
    assert doc["host_experts"] == 6 * HOST_EXPERTS
    # the series' records against the probe's parameter census of the same tables
    assert doc["host_bytes"] == pytest.approx(mem["expert_host_bytes"], rel=0.01)
    assert doc["device_bytes"] > 0
    if name == "q4-onetable-swap":
        assert doc["path"] == "offload-03-swap"
        assert doc["swaps"] >= run["tasks"]["stress"]["swap_delta"]["swaps"] > 0
        assert doc["host_reads"] > 0 and doc["swap_decisions"] > 0
    else:
        assert doc["path"] == "offload-02" and "swaps" not in doc


def test_greedy_tokens_follow_the_planted_chain(model, runs):
    """The planted successor chain decides greedy decoding after a word (the margin that
    keeps tokens stable across configurations)."""
    plan = plan_of(model)
    hit = total = 0
    run = runs["q4-unpatched"]
    for task in ("c1", "c2"):
        for prompt, out in zip(run["prompts"][task], run["tasks"][task]["outputs"], strict=True):
            want = data.greedy_continuation(plan, tuple(prompt), len(out["token_ids"]))
            hit += sum(a == b for a, b in zip(out["token_ids"], want, strict=True))
            total += len(want)
    gh.log(f"qwen4exp greedy tokens on the planted chain: {hit}/{total}")
    assert hit / total > 0.95


def test_ple_table_in_host_memory_gives_the_same_tokens(runs, noise):
    gpu, host = runs["q4-ple-gpu"], runs["q4-ple-host"]
    log = pathlib.Path(host["log_file"]).read_text()
    assert re.search(r"PLE.*host|host.*PLE", log), "no log line says the PLE table is on host"
    d = lp.diff_runs(host, gpu)
    gh.log(f"PLE host vs gpu: {json.dumps(d)}")
    assert d["tokens_identical"]
    assert lp.diff_runs(gpu, runs["q4-unpatched"])["tokens_identical"]
    # the same rows read from elsewhere by the same kernels: one more sample of the noise
    assert not lp.failures(d, noise, lp.SAME_KERNELS_TOLERANCE, lp.PER_PROMPT_STATS)
