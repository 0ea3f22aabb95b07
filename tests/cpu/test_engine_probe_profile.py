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
from eodev import engine_probe
from eodev.bench_offload.profiles import profile_lines, profiles
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
        self.aborted: list[str] = []

    def abort_request(self, ids) -> None:
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)

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
            outs.append(
                types.SimpleNamespace(
                    request_id=rid, outputs=[types.SimpleNamespace(token_ids=toks)]
                )
            )
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


def test_a_failing_profiler_is_reported_not_raised_and_its_request_aborted(fake_torch):
    trace: list[str] = []
    fake_torch(trace, fail=True)
    llm = _Engine(trace)
    out = engine_probe._decode_profile(llm, {"prompts": [[1]], "max_tokens": 3})
    assert out == {"error": "RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"}
    assert llm.aborted == ["prof-0"] and not llm.live


def test_a_request_without_gpu_activity_is_an_error_not_a_smaller_busy_time(fake_torch):
    """CUPTI that stops recording after the first profile must not halve the busy time."""
    trace: list[str] = []
    fake_torch(trace)
    llm = _Engine(trace)
    real_events = _Profile.events
    calls = []

    def events(self):
        calls.append(1)
        return real_events(self) if len(calls) < 2 else []

    _Profile.events = events
    try:
        out = engine_probe._decode_profile(llm, {"prompts": [[1], [2]], "max_tokens": 4})
    finally:
        _Profile.events = real_events
    assert out["error"].startswith("RuntimeError: the profiler recorded no GPU activity")


def test_kernel_names_are_cut_before_they_are_summed():
    long_a, long_b = "k" * 160 + "A", "k" * 160 + "B"
    out = engine_probe.kernel_summary([(long_a, 0.0, 1.0), (long_b, 2.0, 4.0)], tokens=1)
    assert out["kernels"] == [{"name": "k" * 160, "launches_per_token": 2.0, "us_per_token": 3.0}]


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
    doc = {"profiles": profiles({("offload-03-swap", 1): swap, ("offload-02", 1): broken})}
    assert list(doc["profiles"]) == [
        "offload-03-swap",
        "unpatched beside offload-03-swap",
        "offload-02",
    ]
    text = "\n".join(profile_lines(doc))
    assert "| offload-03-swap | 100 | 2000.0 | 1650.0 | 17.5% |" in text
    assert "| offload-02 | - | - | - | - | profile failed: no CUPTI |" in text
    assert (
        "offload-03-swap minus unpatched: wall +200.0 us/token, GPU busy "
        "+150.0 us/token; kernels: `marlin` +100.0, `route_picks` +26.0, `attn` +0.0." in text
    )
    assert profile_lines({"profiles": {}}) == []


def _engine(config: str, profile: dict, **extra) -> dict:
    """One engine's result as bench-offload holds it, with a profile task."""
    return {"spec": {"config": config}, "tasks": {"profile": profile}, **extra}


def test_without_a_partner_the_unpatched_engine_of_the_run_is_the_reference():
    ref = _engine("unpatched", _prof(1800.0, 1500.0, [("marlin", 900.0)]))
    one = _engine("offload-03", _prof(1900.0, 1550.0, [("marlin", 950.0)]))
    doc = {"profiles": profiles({("unpatched", 1): ref, ("offload-03", 1): one})}
    assert list(doc["profiles"]) == ["unpatched", "offload-03"]
    text = "\n".join(profile_lines(doc))
    assert (
        "offload-03 minus unpatched: wall +100.0 us/token, GPU busy +50.0 us/token; "
        "kernels: `marlin` +50.0." in text
    )


def test_a_paired_partner_is_listed_once_and_an_error_stays_on_one_table_row():
    base = _engine("unpatched", _prof(1800.0, 1500.0, [("m", 9.0)]))
    prof = {**_prof(1900.0, 1550.0, [("m", 9.5)]), "swap_delta": {"host_reads": 7}}
    swap = _engine("offload-03", prof, paired_base=base)
    # bench-offload keeps the first partner as the round's unpatched run as well
    results = {("unpatched", 1): base, ("offload-03-swap", 1): swap}
    doc = {"profiles": profiles(results)}
    assert list(doc["profiles"]) == ["offload-03-swap", "unpatched beside offload-03-swap"]
    assert "host reads in the task: 7" in "\n".join(profile_lines(doc))
    doc["profiles"]["offload-03-swap"] = {"error": "CUDA error: x | y\nmore lines"}
    rows = [x for x in profile_lines(doc) if "profile failed" in x]
    assert rows == ["| offload-03-swap | - | - | - | - | profile failed: CUDA error: x \\| y |"]
