# SPDX-License-Identifier: Apache-2.0
"""The 2x32GB layout's parallelism on two GPUs: the Qwen4Exp test model (PLE on, a PLE layer
on each stage of the 3 + 3 split) at pipeline parallel 2 with the series, against the
unpatched engine at PP=1 (upstream refuses PP=2 with PLE): greedy tokens identical and
logprob differences within the unpatched engine's own noise (1.5x for the series alone, which
runs the same kernels on two ranks; 2x where sums are reordered), for the series alone,
offload-02 and one table with the runtime swap (each rank builds, checks and logs its own
layers of the cold file), CUDA graphs on, the n-gram table in host memory as
compose/2x32GB.yml sets it.
The counting hook writes one file per rank (`.pp0`, `.pp1`), each with its stage's layers,
and each rank publishes its own /metrics snapshot.

Needs two GPUs (marker `multi_gpu`; skipped with the reason on one). The engines start side
by side (each PP=2 engine on both GPUs) and take turns request by request.

    scripts/test-gpu tests/gpu/test_qwen4exp_pp2.py -s
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from eodev import gpu_harness as gh
from eodev import logprob_noise as lp
from test_qwen4exp import SWAP_ENV, SWAP_STRESS_STEPS, cold_file, model, run_side_by_side

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
__all__ = ["cold_file", "model"]  # the fixtures, shared with test_qwen4exp.py


@pytest.fixture(scope="module", autouse=True)
def two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, this host has {torch.cuda.device_count()}")


def _count_dir(name: str) -> pathlib.Path:
    return gh.WORK / "runs" / "qwen4exp-pp2-counts" / name


def _metrics_dir(name: str) -> pathlib.Path:
    return gh.WORK / "runs" / "qwen4exp-pp2-metrics" / name


# name -> (patched, env, rebatched, swap stress steps); PP=2 unless named in PP1
def _members(cold: pathlib.Path) -> dict[str, tuple[bool, dict, bool, int]]:
    c = str(cold)
    host = {"VLLM_PLE_TABLE": "host"}
    return {
        "pp-unpatched": (False, {}, False, 0),
        "pp-unpatched-again": (False, {}, False, 0),
        "pp-unpatched-rebatched": (False, {}, True, 0),
        "pp2-series": (True, host, False, 0),
        "pp2-offload02": (True, {**host, "VLLM_EXPERT_COLD_FILE": c}, False, 0),
        "pp2-onetable-swap": (
            True,
            {**host, "VLLM_EXPERT_COLD_FILE": c, **SWAP_ENV},
            False,
            SWAP_STRESS_STEPS,
        ),
    }


PP1 = ("pp-unpatched", "pp-unpatched-again", "pp-unpatched-rebatched")  # upstream: no PP+PLE
COUNTED = ("pp2-offload02", "pp2-onetable-swap")


@pytest.fixture(scope="module")
def runs(model, cold_file) -> dict[str, dict]:
    share = float(os.environ.get("EO_GPU_MEMORY_UTILIZATION") or 0.1)
    counted = {name: _count_dir(name) / "counts.json" for name in COUNTED}
    return run_side_by_side(
        model,
        _members(cold_file),
        counted,
        share,
        lambda name: {"pipeline_parallel_size": 1 if name in PP1 else 2},
        metrics_dirs={"pp2-onetable-swap": _metrics_dir("pp2-onetable-swap")},
    )


@pytest.fixture(scope="module")
def noise(runs) -> dict:
    a = runs["pp-unpatched"]
    return lp.noise(
        {
            "same_config": (a, runs["pp-unpatched-again"]),
            "batching": (a, runs["pp-unpatched-rebatched"]),
        }
    )


@pytest.mark.parametrize(
    "name,tolerance",
    [
        ("pp2-series", lp.SAME_KERNELS_TOLERANCE),  # the same kernels, split over two ranks
        ("pp2-offload02", lp.REORDERED_SUM_TOLERANCE),
        ("pp2-onetable-swap", lp.REORDERED_SUM_TOLERANCE),
    ],
)
def test_pp2_matches_unpatched_pp1(runs, noise, name, tolerance):
    run = runs[name]
    mem = run["memory"]
    assert len(mem["per_rank"]) == 2, "expected one placement per pipeline rank"
    assert [r["moe_layers"] for r in mem["per_rank"]] == [3, 3]
    if name != "pp2-series":
        # each rank holds its own stage's host experts
        assert all(r["expert_host_bytes"] > 0 for r in mem["per_rank"])
    if name == "pp2-onetable-swap":
        assert mem["one_table_layers"] == 6
        assert run["tasks"]["stress"]["swap_delta"]["swaps"] > 0
        log = pathlib.Path(run["log_file"]).read_text()
        assert "self-check FAILED" not in log
    d = lp.diff_runs(run, runs["pp-unpatched"])
    report = {"check": name, "vs_unpatched_pp1": d, "unpatched_noise": noise}
    gh.log(json.dumps(report))
    (gh.WORK / f"correctness-{name}.json").write_text(json.dumps(report, indent=1))
    assert d["tokens_identical"], f"{name}: greedy tokens differ from unpatched PP=1"
    problems = lp.failures(d, noise, tolerance, lp.PER_PROMPT_STATS)  # as test_qwen4exp
    assert not problems, f"{name}: " + "; ".join(problems)


def test_each_rank_logs_its_own_layers(runs):
    """Start-up lines per rank (vLLM prefixes each worker's lines with Worker_PP<rank>): the
    rank's host experts, and the PLE table of the PLE layer on its stage in host memory."""
    lines = pathlib.Path(runs["pp2-offload02"]["log_file"]).read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if f"Worker_PP{rank}" in line]
        assert any("routed experts on this rank" in line for line in mine), rank
        assert any("3 of 3 MoE layers on this rank" in line for line in mine), rank
        assert any("PLE n-gram table" in line and "host" in line for line in mine), rank


def test_each_rank_publishes_its_own_metrics_snapshot(runs):
    """The snapshots /metrics is served from: one per pipeline rank, each with its own stage's
    three layers, host experts and the runtime swap's counters."""
    folder = _metrics_dir("pp2-onetable-swap")
    docs = {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))}
    assert sorted(docs) == ["rank-dp0_pp0_tp0.json", "rank-dp0_pp1_tp0.json"], sorted(docs)
    per_rank = runs["pp2-onetable-swap"]["memory"]["per_rank"]
    for doc, mem in zip(docs.values(), per_rank, strict=True):
        assert doc["path"] == "offload-03-swap" and doc["layers"] == 3
        assert doc["host_bytes"] == pytest.approx(mem["expert_host_bytes"], rel=0.01)
        assert doc["host_reads"] > 0 and doc["swap_decisions"] > 0


@pytest.mark.parametrize("name", COUNTED)
def test_count_files_per_rank_merge_into_every_layer(model, runs, name):
    from eotools.count_experts import HookFiles
    from eotools.counts import load_counts, merge_ranks

    files = HookFiles(_count_dir(name) / "counts.json").rank_files()
    assert [f.name for f in files] == ["counts.pp0.json", "counts.pp1.json"], files
    parts = [load_counts(f) for f in files]
    assert [sorted(int(x) for x in c.extra["layers"]) for c in parts] == [[0, 1, 2], [3, 4, 5]]
    merged = merge_ranks(parts)
    # rank 0 counted layers 0-2, rank 1 layers 3-5; together every layer, top_k per token
    assert (parts[0].prefill[:3].sum(1) > 0).all() and (parts[0].prefill[3:] == 0).all()
    assert (parts[1].prefill[3:].sum(1) > 0).all() and (parts[1].prefill[:3] == 0).all()
    cfg = json.loads((model / "config.json").read_text())
    k = cfg.get("text_config", cfg)["num_experts_per_tok"]
    assert (merged.prefill.sum(1) == merged.tokens("prefill") * k).all()
