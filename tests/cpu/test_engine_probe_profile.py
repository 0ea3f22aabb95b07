# SPDX-License-Identifier: Apache-2.0
"""engine_probe's decode_profile task and bench-offload's --profile report, on the CPU: the
GPU's busy time is the union of kernel intervals, kernels are summed per name and per
decoded token, only the decode after each request's first token is profiled (and the first
request is a warm-up), a failing profiler is reported rather than raised, and the report
sets each configuration's kernels beside its unpatched partner's.

    scripts/test tests/cpu/test_engine_probe_profile.py
"""

from __future__ import annotations

import types

import pytest
import torch
from eotools import bench_offload, engine_probe
from torch.autograd import DeviceType


def test_kernel_summary_counts_overlap_once_and_sums_per_name():
    out = engine_probe.kernel_summary(
        [("gemm", 0.0, 10.0), ("route", 5.0, 12.0), ("gemm", 20.0, 30.0), ("copy", 21.0, 22.0)],
        tokens=2,
    )
    assert out["gpu_busy_us_per_token"] == pytest.approx((12.0 + 10.0) / 2)
    assert out["kernels"] == [
        {"name": "gemm", "launches_per_token": 1.0, "us_per_token": 10.0},
        {"name": "route", "launches_per_token": 0.5, "us_per_token": 3.5},
        {"name": "copy", "launches_per_token": 0.5, "us_per_token": 0.5},
    ]
    with pytest.raises(ValueError, match="no decoded tokens"):
        engine_probe.kernel_summary([], 0)


class _Engine:
    """Prefill makes the first token; each later step one token and a 'decode' kernel."""

    def __init__(self, trace: list) -> None:
        self.trace, self.live, self.max_tokens, self.llm_engine = trace, {}, 0, self

    def add_request(self, rid, prompt, params) -> None:
        self.max_tokens = params.max_tokens
        self.live[rid] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        outs = []
        for rid, toks in list(self.live.items()):
            self.trace.append("prefill" if not toks else "decode")
            toks.append(len(toks))
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=toks)]))
            if len(toks) == self.max_tokens:
                del self.live[rid]
        return outs


class _Profile:
    """torch.profiler.profile's stand-in: the kernels launched while it was open."""

    def __init__(self, trace: list, fail: bool) -> None:
        self.trace, self.fail = trace, fail

    def __enter__(self):
        if self.fail:
            raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")
        self.start = len(self.trace)
        return self

    def __exit__(self, *exc):
        self.seen = self.trace[self.start :]

    def events(self):
        ev = [
            types.SimpleNamespace(
                name=f"{k}_kernel",
                device_type=DeviceType.CUDA,
                time_range=types.SimpleNamespace(start=10.0 * i, end=10.0 * i + 4.0),
            )
            for i, k in enumerate(self.seen)
        ]
        cpu = types.SimpleNamespace(
            name="aten::add",
            device_type=DeviceType.CPU,
            time_range=types.SimpleNamespace(start=0, end=99),
        )
        return [*ev, cpu]


@pytest.fixture
def fake_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def install(trace, fail=False):
        monkeypatch.setattr(torch.profiler, "profile", lambda **kw: _Profile(trace, fail))

    return install


def test_only_decode_after_the_first_token_of_the_measured_requests_is_profiled(fake_torch):
    trace: list[str] = []
    fake_torch(trace)
    llm = _Engine(trace)
    out = engine_probe._decode_profile(llm, {"prompts": [[1, 2], [3]], "max_tokens": 9})
    # three requests (the first a warm-up), one prefill and eight decode steps each
    assert trace.count("prefill") == 3 and trace.count("decode") == 24
    assert out["tokens"] == 16  # the two measured requests' decode tokens
    assert out["kernels"] == [
        {"name": "decode_kernel", "launches_per_token": 1.0, "us_per_token": 4.0}
    ]
    assert out["gpu_busy_us_per_token"] == pytest.approx(4.0)
    assert out["wall_us_per_token"] > 0 and 0.0 <= out["gpu_idle_fraction"] <= 1.0


def test_a_failing_profiler_is_reported_not_raised(fake_torch):
    trace: list[str] = []
    fake_torch(trace, fail=True)
    out = engine_probe._decode_profile(_Engine(trace), {"prompts": [[1]], "max_tokens": 3})
    assert out == {"error": "RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"}


def _prof(wall, busy, kernels):
    return {
        "tokens": 100,
        "wall_us_per_token": wall,
        "gpu_busy_us_per_token": busy,
        "gpu_idle_fraction": 1 - busy / wall,
        "kernels": [{"name": n, "launches_per_token": 1.0, "us_per_token": t} for n, t in kernels],
    }


def test_the_report_sets_each_configuration_beside_its_partner():
    base = {"tasks": {"profile": _prof(1800.0, 1500.0, [("marlin", 900.0), ("attn", 300.0)])}}
    swap = {
        "spec": {"config": "offload-03"},
        "paired_base": base,
        "tasks": {
            "profile": _prof(
                2000.0, 1650.0, [("marlin", 1000.0), ("route_picks", 26.0), ("attn", 300.0)]
            )
        },
    }
    broken = {"spec": {"config": "offload-02"}, "tasks": {"profile": {"error": "no CUPTI"}}}
    doc = {
        "profiles": bench_offload.profiles(
            {("offload-03-swap", 1): swap, ("offload-02", 1): broken}
        )
    }
    assert list(doc["profiles"]) == [
        "offload-03-swap",
        "unpatched beside offload-03-swap",
        "offload-02",
    ]
    text = "\n".join(bench_offload.profile_lines(doc))
    assert "| offload-03-swap | 100 | 2000.0 | 1650.0 | 17.5% |" in text
    assert "| offload-02 | - | - | - | - | profile failed: no CUPTI |" in text
    assert (
        "offload-03-swap minus unpatched: wall +200.0 us/token, GPU busy "
        "+150.0 us/token; kernels: `marlin` +100.0, `route_picks` +26.0, `attn` +0.0." in text
    )
    assert bench_offload.profile_lines({"profiles": {}}) == []


def test_without_a_partner_the_unpatched_engine_of_the_run_is_the_reference():
    ref = {
        "spec": {"config": "unpatched"},
        "tasks": {"profile": _prof(1800.0, 1500.0, [("marlin", 900.0)])},
    }
    one = {
        "spec": {"config": "offload-03"},
        "tasks": {"profile": _prof(1900.0, 1550.0, [("marlin", 950.0)])},
    }
    doc = {"profiles": bench_offload.profiles({("unpatched", 1): ref, ("offload-03", 1): one})}
    assert list(doc["profiles"]) == ["unpatched", "offload-03"]
    text = "\n".join(bench_offload.profile_lines(doc))
    assert (
        "offload-03 minus unpatched: wall +100.0 us/token, GPU busy +50.0 us/token; "
        "kernels: `marlin` +50.0." in text
    )
