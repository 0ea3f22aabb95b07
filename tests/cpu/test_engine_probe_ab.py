# SPDX-License-Identifier: Apache-2.0
"""engine_probe's decode_ab task on the CPU, with a fake engine and the patched vLLM's
SwapSettings: each request runs under its variant's runtime-swap settings, the order of the
two variants alternates, the per-pair ratios come from the requests' own token times, and
the start-up settings are back afterwards.

    scripts/test tests/cpu/test_engine_probe_ab.py
"""

from __future__ import annotations

import types

import pytest


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _FakeLLM:
    """Decodes one token per step; a step takes 2.0 ms with decisions every 8 steps and
    1.9 ms when the interval is so long that none happens."""

    def __init__(self, runtime, clock: _Clock) -> None:
        self.runtime, self.clock = runtime, clock
        self.requests: list[tuple[str, int]] = []  # (request id, interval it ran with)
        self._live: dict[str, list[int]] = {}
        self.max_tokens = 0
        self.llm_engine = self

    def apply_model(self, fn):
        return [fn(object())]

    def add_request(self, rid, prompt, params) -> None:
        self.max_tokens = params.max_tokens
        self._live[rid] = []
        self.requests.append((rid, self.runtime.settings.interval))

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def step(self):
        self.clock.now += 2.0e-3 if self.runtime.settings.interval == 8 else 1.9e-3
        outs = []
        for rid, toks in list(self._live.items()):
            toks.append(len(toks))
            outs.append(
                types.SimpleNamespace(
                    request_id=rid, outputs=[types.SimpleNamespace(token_ids=toks)]
                )
            )
            if len(toks) == self.max_tokens:
                del self._live[rid]
        return outs


def test_decode_ab_alternates_the_variants_and_restores_the_settings(monkeypatch):
    from eodev import engine_probe
    from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime

    start = swap_runtime.SwapSettings(8, 512.0, 2.0)
    runtime = types.SimpleNamespace(settings=start)
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: runtime)
    clock = _Clock()
    monkeypatch.setattr(engine_probe.time, "perf_counter", clock)
    llm = _FakeLLM(runtime, clock)
    task = {
        "prompts": [[1, 2, 3], [4, 5]],
        "max_tokens": 17,
        "warmup": 1,
        "repeats": 2,
        "variants": {"decide": {"margin": 1e30}, "no-decide": {"interval": 10**9}},
    }
    out = engine_probe._decode_ab(llm, task)

    # one request per variant, prompt and repeat (warm-up included), the order alternating
    assert len(llm.requests) == 2 * 2 * 3
    firsts = [llm.requests[i][1] for i in range(0, len(llm.requests), 2)]
    assert firsts == [8, 10**9, 10**9, 8, 8, 10**9]
    assert out["ratio"] == "no-decide / decide"
    assert len(out["pair_ratios"]) == 4  # the warm-up repeat is not kept
    assert out["pair_ratio_p50"] == pytest.approx(0.95)
    assert out["tpot_ms_p50"]["decide"] == pytest.approx(2.0)
    assert runtime.settings == start  # back to the start-up settings


def test_decode_ab_refuses_an_engine_without_runtime_swap(monkeypatch):
    from eodev import engine_probe
    from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime

    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: None)
    llm = _FakeLLM(types.SimpleNamespace(settings=None), _Clock())
    task = {"prompts": [[1]], "max_tokens": 4, "variants": {"a": {}, "b": {}}}
    with pytest.raises(RuntimeError, match="no runtime swap"):
        engine_probe._decode_ab(llm, task)
    with pytest.raises(ValueError, match="two variants"):
        engine_probe._decode_ab(llm, {**task, "variants": {"a": {}}})


def _rank_placement(layers: int, host: int, kernels: list[str], first: int) -> dict:
    return {
        "moe_layers": layers,
        "one_table_layers": 0,
        "one_table_gpu_rows_in_host_memory": 0,
        "one_table_host_experts": {str(first + i): [i] for i in range(layers)},
        "expert_gpu_bytes": 10 * layers,
        "expert_host_bytes": host,
        "expert_host_bytes_by_layer": [host // layers] * layers,
        "expert_bytes_by_layer": [10 + host // layers] * layers,
        "moe_methods": ["GPTQMarlinMoEMethod"],
        "moe_kernels": kernels,
    }


def test_pipeline_ranks_placements_merge_in_rank_order():
    from eodev.engine_probe import merge_placements

    one = _rank_placement(3, 30, ["MarlinExperts"], 0)
    assert merge_placements([one]) is one  # PP=1: unchanged
    two = _rank_placement(3, 60, ["MarlinExperts", "Other"], 3)
    m = merge_placements([one, two])
    assert m["moe_layers"] == 6 and m["expert_host_bytes"] == 90
    assert m["expert_gpu_bytes"] == 60
    assert m["expert_host_bytes_by_layer"] == [10, 10, 10, 20, 20, 20]
    assert sorted(m["one_table_host_experts"], key=int) == ["0", "1", "2", "3", "4", "5"]
    assert m["moe_kernels"] == ["MarlinExperts", "Other"]
    assert m["moe_methods"] == ["GPTQMarlinMoEMethod"]
    assert m["per_rank"] == [one, two]


def test_pipeline_ranks_swap_counters_merge():
    from eodev.engine_probe import merge_swap_counters

    a = {"layers": ["l0", "l1"], "host_reads": [1, 2], "swaps": [0, 1], "decode_steps": 7}
    b = {"layers": ["l2"], "host_reads": [5], "swaps": [3], "decode_steps": 7}
    assert merge_swap_counters([a]) is a
    assert merge_swap_counters([None, None]) is None
    m = merge_swap_counters([a, b])
    assert m["layers"] == ["l0", "l1", "l2"]
    assert sum(m["host_reads"]) == 8 and sum(m["swaps"]) == 4
    assert m["decode_steps"] == 7
