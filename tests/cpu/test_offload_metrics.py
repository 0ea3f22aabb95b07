# SPDX-License-Identifier: Apache-2.0
"""Expert offload metrics (patch 0011) on the CPU: worker ranks publish snapshots into
VLLM_EXPERT_METRICS_DIR, the API server's /metrics exposes them under the documented names
(the ones scripts/bench reads), `vllm serve` makes the folder only when offload is on, and
the runtime swap's counters reach the snapshot without a wait on the device.

    scripts/test tests/cpu/test_offload_metrics.py
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from eodev.bench import prom
from test_offload_layers import loaded_split_model
from test_one_table import loaded  # noqa: F401 (a fixture, used by runtime)
from test_swap_runtime import runtime  # noqa: F401 (a fixture)

RANK0, RANK1 = "dp0_pp0_tp0", "dp0_pp1_tp0"


def _exposition(directory, monkeypatch) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm.v1.metrics import expert_offload

    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(directory))
    registry = CollectorRegistry()
    expert_offload.register_metrics(registry)
    expert_offload.register_metrics(registry)  # twice: still one collector
    return generate_latest(registry).decode()


def test_metrics_names_labels_and_values(vllm_cpu, tmp_path, monkeypatch):
    from vllm.v1.metrics.expert_offload import write_snapshot

    placed = {"layers": 40, "host_experts": 2560, "host_bytes": 6 << 30, "device_bytes": 9 << 30}
    write_snapshot(
        tmp_path,
        RANK0,
        {"path": "offload-03-swap", **placed, "host_reads": 1234, "swaps": 56, "swap_decisions": 7},
    )
    write_snapshot(tmp_path, RANK1, {"path": "offload-02", **placed})  # no swap counters
    (tmp_path / "rank-dp0_pp2_tp0.json").write_text("{not json")  # a rank mid-start
    snap = prom.parse(_exposition(tmp_path, monkeypatch))
    key = prom.sample_key
    assert snap.counters[key(prom.HOST_READS, {"rank": RANK0})] == 1234
    assert snap.counters[key(prom.SWAPS, {"rank": RANK0})] == 56
    assert snap.counters[key("vllm:expert_offload_swap_decisions_total", {"rank": RANK0})] == 7
    assert key(prom.HOST_READS, {"rank": RANK1}) not in snap.counters
    for rank in (RANK0, RANK1):
        assert snap.gauges[key(prom.HOST_BYTES, {"rank": rank})] == 6 << 30
        assert snap.gauges[key(prom.DEVICE_BYTES, {"rank": rank})] == 9 << 30
        assert snap.gauges[key("vllm:expert_offload_host_experts", {"rank": rank})] == 2560
    info = {k for k in snap.gauges if k.startswith("vllm:expert_offload_info")}
    assert info == {
        key("vllm:expert_offload_info", {"path": "offload-03-swap", "rank": RANK0}),
        key("vllm:expert_offload_info", {"path": "offload-02", "rank": RANK1}),
    }


def test_nothing_is_exposed_without_snapshots(vllm_cpu, tmp_path, monkeypatch):
    assert "expert_offload" not in _exposition(tmp_path, monkeypatch)


def test_serve_makes_the_folder_only_when_offload_is_on(vllm_cpu, tmp_path, monkeypatch):
    from vllm.v1.metrics.expert_offload import prepare_metrics_dir

    for name in ("VLLM_EXPERT_METRICS_DIR", "VLLM_EXPERT_COLD_FILE", "VLLM_EXPERT_HOST_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    assert prepare_metrics_dir() is None
    monkeypatch.setenv("VLLM_EXPERT_HOST_LAYERS", "0")
    made = prepare_metrics_dir()
    assert made and os.path.isdir(made)
    assert os.environ["VLLM_EXPERT_METRICS_DIR"] == made
    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(tmp_path))  # the user's folder wins
    assert prepare_metrics_dir() == str(tmp_path)


def test_the_metrics_route_serves_them(vllm_cpu, tmp_path, monkeypatch):
    """The API server's own /metrics (attach_router) carries the offload metrics."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    from vllm.v1.metrics.expert_offload import write_snapshot

    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(tmp_path))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    write_snapshot(tmp_path, RANK0, {"path": "offload-02", "host_bytes": 42})
    app = FastAPI()
    attach_router(app)
    text = TestClient(app).get("/metrics").text
    assert f'vllm:expert_offload_host_bytes{{rank="{RANK0}"}} 42.0' in text


def test_a_rank_publishes_its_placement_and_swap_counters(vllm_cpu, tmp_path, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import metrics, swap_runtime

    class FakeRuntime:
        values = None

        def published_counters(self):
            return self.values

    fake = FakeRuntime()
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: fake)
    pub = metrics.RankPublisher(str(tmp_path), RANK0, {"path": "offload-03-swap"}, 0.05)
    try:
        path = tmp_path / f"rank-{RANK0}.json"
        assert json.loads(path.read_text()) == {"path": "offload-03-swap", "rank": RANK0}
        fake.values = {"host_reads": 9, "swaps": 2, "swap_decisions": 1}
        deadline = time.monotonic() + 5
        while json.loads(path.read_text()).get("host_reads") != 9:
            assert time.monotonic() < deadline, "the publisher thread did not write"
            time.sleep(0.02)
        fake.values = {"host_reads": 11, "swaps": 3, "swap_decisions": 2}
    finally:
        pub.close()
    assert json.loads(path.read_text())["host_reads"] == 11  # the last snapshot at close
    assert not list(tmp_path.glob(".*.tmp"))


def test_loading_an_offloaded_model_starts_publishing(vllm_cpu, tmp_path, monkeypatch):
    from vllm.model_executor.layers.fused_moe import expert_offload
    from vllm.model_executor.layers.fused_moe.expert_offload import metrics, swap_runtime

    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(tmp_path))
    swap_runtime.reset_runtime()
    model = loaded_split_model(tmp_path)
    try:
        expert_offload.log_summary(model)
        [snap] = [json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")]
    finally:
        metrics.close()
    assert snap["path"] == "offload-02" and snap["layers"] == 1 and snap["host_experts"] == 3
    assert snap["host_bytes"] > 0 and snap["device_bytes"] > snap["host_bytes"]
    assert snap["rank"] == "dp0_pp0_tp0"


@pytest.mark.parametrize("decisions", [1, 3])
def test_swap_counters_reach_the_snapshot_after_a_decision(runtime, decisions):  # noqa: F811
    rt, runner, _, _ = runtime
    assert rt.published_counters() is None  # nothing before the first decision
    rt.route(runner.routed_experts, torch.zeros((1, 4), dtype=torch.int32))
    for _ in range(decisions):
        rt.state.host_reads += 5
        rt.state.swaps += 1
        rt._decide()
    n = rt.state.host_reads.numel()
    assert rt.published_counters() == {
        "host_reads": 5 * decisions * n,
        "swaps": decisions * n,
        "swap_decisions": decisions,
    }


def test_a_metrics_folder_that_does_not_exist_is_made_or_refused(vllm_cpu, tmp_path, monkeypatch):
    """VLLM_EXPERT_METRICS_DIR naming a folder that does not exist yet: `vllm serve` makes it
    (the workers used to warn every second that they could not write, and /metrics lacked the
    offload series); one that cannot be made stops `vllm serve` with the fix, no traceback."""
    from vllm.v1.metrics.expert_offload import prepare_metrics_dir

    new = tmp_path / "a" / "b"
    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(new))
    assert prepare_metrics_dir() == str(new) and new.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(blocker / "sub"))
    with pytest.raises(SystemExit) as e:
        prepare_metrics_dir()
    assert "VLLM_EXPERT_METRICS_DIR" in str(e.value) and "writable folder" in str(e.value)


def test_a_worker_makes_its_folder_and_warns_once_when_it_cannot(vllm_cpu, tmp_path, caplog):
    from vllm.model_executor.layers.fused_moe.expert_offload import metrics

    made = tmp_path / "made" / "here"
    pub = metrics.RankPublisher(str(made), RANK0, {"path": "offload-02"}, 0.01)
    pub.close()
    assert json.loads((made / f"rank-{RANK0}.json").read_text())["path"] == "offload-02"

    blocker = tmp_path / "file"
    blocker.write_text("")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    log = logging.getLogger(metrics.__name__)
    log.addHandler(handler)
    try:
        pub = metrics.RankPublisher(str(blocker / "sub"), RANK1, {"path": "offload-02"}, 0.01)
        time.sleep(0.2)  # about 20 more attempts
        pub.close()
    finally:
        log.removeHandler(handler)
    assert len([x for x in lines if "cannot write snapshots" in x]) == 1, lines
