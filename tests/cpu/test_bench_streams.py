# SPDX-License-Identifier: Apache-2.0
"""bench-offload's many-streams workload (--streams) on the CPU: the engine task decodes N
requests together with a fake engine whose step time grows with the batch, and reports total
tokens/s, TPOT and the runtime swap's reads per token; the prompts are distinct and mixed;
every engine gets room for the largest batch; the report's rows and table.

    scripts/test tests/cpu/test_bench_streams.py
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

STEP_S, PER_REQUEST_S = 1.0e-3, 0.25e-3


class _FakeEngine:
    """One token per live request per step; a step takes 1 ms + 0.25 ms per live request. The
    runtime swap reads one host expert per token and swaps one expert per step."""

    def __init__(self, clock: list[float], counters: dict) -> None:
        self.clock, self.counters = clock, counters
        self.live: dict[str, list[int]] = {}
        self.batches: list[list[list[int]]] = []
        self.max_tokens = 0
        self.llm_engine = self

    def apply_model(self, fn):
        return [fn(object())]

    def add_request(self, rid, prompt, params) -> None:
        if not self.live:
            self.batches.append([])
        self.batches[-1].append(prompt["prompt_token_ids"])
        self.max_tokens = params.max_tokens
        self.live[rid] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        self.clock[0] += STEP_S + PER_REQUEST_S * len(self.live)
        self.counters["host_reads"][0] += len(self.live)
        self.counters["swaps"][0] += 1
        outs = []
        for rid, toks in list(self.live.items()):
            toks.append(len(toks))
            out = types.SimpleNamespace(token_ids=list(toks))
            outs.append(types.SimpleNamespace(request_id=rid, outputs=[out]))
            if len(toks) == self.max_tokens:
                del self.live[rid]
        return outs


def test_the_streams_task_decodes_n_requests_together(monkeypatch):
    from eodev import engine_probe
    from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime

    clock = [100.0]
    counters = {"layers": [0], "host_reads": [0], "swaps": [0]}
    runtime = types.SimpleNamespace(  # counters() returns copies, as the runtime's does
        state=object(),
        counters=lambda: {k: list(v) for k, v in counters.items()},
        decisions=0,
        decode_steps=0,
    )
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: runtime)
    monkeypatch.setattr(engine_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_probe, "BATON", engine_probe.Baton(None))
    llm = _FakeEngine(clock, counters)
    prompts = [[i, i + 1] for i in range(0, 100, 2)]
    tokens = 9
    task = {"prompts": prompts, "streams": [1, 4], "max_tokens": tokens, "repeats": 2}
    out = engine_probe._streams(llm, task)["by_streams"]

    # warm-up and two repeats per N, each batch of N distinct prompts, none reused
    assert [len(b) for b in llm.batches] == [1, 1, 1, 4, 4, 4]
    used = [tuple(p) for b in llm.batches for p in b]
    assert len(set(used)) == len(used) == 15
    one, four = out
    assert one["streams"] == 1 and four["streams"] == 4
    # N requests x (tokens - 1) over (tokens - 1) steps of 1 ms + N x 0.25 ms
    assert one["total_decode_tok_s"] == pytest.approx([1 / 1.25e-3] * 2)
    assert four["total_decode_tok_s"] == pytest.approx([4 / 2.0e-3] * 2)
    assert one["tpot_ms_p50"] == pytest.approx(1.25) and four["tpot_ms_p90"] == pytest.approx(2.0)
    assert four["decoded"] == 2 * 4 * (tokens - 1)
    # the swap's counters over the measured repeats only: one read per token (the first
    # token's step included), one swap per step
    assert four["host_reads_per_token"] == pytest.approx(tokens / (tokens - 1))
    assert four["swaps_per_token"] == pytest.approx(tokens / (4 * (tokens - 1)))


def test_without_a_runtime_swap_no_reads_are_claimed(monkeypatch):
    from eodev import engine_probe

    clock = [0.0]
    monkeypatch.setattr(engine_probe, "_swap_counters", lambda model: None)
    monkeypatch.setattr(engine_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_probe, "BATON", engine_probe.Baton(None))
    llm = _FakeEngine(clock, {"host_reads": [0], "swaps": [0]})
    task = {"prompts": [[1], [2], [3]], "streams": [2], "max_tokens": 3, "repeats": 1}
    [row] = engine_probe._streams(llm, task)["by_streams"]
    assert "host_reads_per_token" not in row and "swaps_per_token" not in row


def test_decode_prefetch_counters_are_taken_over_the_measured_repeats(monkeypatch):
    from eodev import engine_probe
    from vllm.model_executor.layers.fused_moe.expert_offload import (
        decode_prefetch,
        swap_runtime,
    )

    clock = [0.0]
    counters = {"layers": [0], "host_reads": [0], "swaps": [0]}
    steps = [0]
    # per step: 4 host picks, 3 of them in rows the guess copied (2 rows guessed, 1
    # missed), 1 MB per copied row
    totals = dict.fromkeys(decode_prefetch.COUNTERS, 0)

    class _Counting(_FakeEngine):
        def step(self):
            steps[0] += 1
            for k, v in (
                ("guessed_rows", 2),
                ("missed_rows", 1),
                ("host_picks", 4),
                ("hit_picks", 3),
                ("bytes_copied", 3 << 20),
            ):
                totals[k] += v
            return super().step()

    class _Runtime:  # the swap runtime: its decode steps read when asked
        state = object()
        decisions = 0
        decode_steps = property(lambda self: steps[0])

        def counters(self):
            return {k: list(v) for k, v in counters.items()}

    runtime = _Runtime()
    prefetch = types.SimpleNamespace(counters=lambda: dict(totals))
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: runtime)
    monkeypatch.setattr(decode_prefetch, "get_prefetch", lambda: prefetch)
    monkeypatch.setattr(engine_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_probe, "BATON", engine_probe.Baton(None))
    llm = _Counting(clock, counters)
    tokens = 5
    task = {"prompts": [[i] for i in range(20)], "streams": [2], "max_tokens": tokens, "repeats": 2}
    [row] = engine_probe._streams(llm, task)["by_streams"]

    # two measured repeats of `tokens` steps each; the warm-up's steps are not counted
    pf = row["prefetch"]
    assert pf["host_picks"] == 2 * tokens * 4 and pf["hit_picks"] == 2 * tokens * 3
    assert pf["hit_share"] == pytest.approx(0.75)
    assert pf["bytes_copied_per_step"] == pytest.approx(3 << 20)
    assert pf["bytes_copied_per_token"] == pytest.approx(2 * tokens * (3 << 20) / row["decoded"])


def test_without_decode_prefetch_no_prefetch_numbers_are_claimed(monkeypatch):
    from eodev import engine_probe

    clock = [0.0]
    monkeypatch.setattr(engine_probe, "_swap_counters", lambda model: None)
    monkeypatch.setattr(engine_probe, "_prefetch_counters", lambda model: None)
    monkeypatch.setattr(engine_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_probe, "BATON", engine_probe.Baton(None))
    llm = _FakeEngine(clock, {"host_reads": [0], "swaps": [0]})
    task = {"prompts": [[1], [2], [3]], "streams": [2], "max_tokens": 3, "repeats": 1}
    [row] = engine_probe._streams(llm, task)["by_streams"]
    assert "prefetch" not in row


@pytest.fixture(scope="module")
def plan(repo_root, tmp_path_factory):
    from eodev.testmodel.plant import load_plan

    model = tmp_path_factory.mktemp("streams") / "target-int4-2l"
    tool = [sys.executable, str(repo_root / "scripts/make-test-model"), str(model)]
    subprocess.run([*tool, "--layers", "2", "--no-weights"], check=True, capture_output=True)
    return load_plan(model)


def test_prompts_are_distinct_and_take_the_domains_in_turn(plan):
    from eodev import bench_streams
    from eodev.testmodel import data

    domains = plan.planting.domains
    got = bench_streams.prompts(plan, 2 * len(domains) + 1)
    assert len(got) == 2 * len(domains) + 1
    assert len({tuple(p) for p in got}) == len(got)
    assert all(len(p) >= bench_streams.PROMPT_TOKENS for p in got)
    firsts = [
        list(next(data.conversations(plan, d, "heldout", 1, 256, seed=31)).token_ids)
        for d in domains
    ]
    assert got[: len(domains)] == firsts
    task = bench_streams.task(plan, [1, 4, 16], decode_tokens=32, repeats=3)
    assert task["kind"] == "streams" and len(task["prompts"]) == 21 * 4


def test_every_engine_gets_room_for_the_largest_batch():
    from eodev import bench_streams
    from eodev.bench_offload.cli import parser
    from eodev.bench_offload.suite import suite_engine

    big = bench_streams.engine_overrides([1, 4, 16])
    assert big["max_num_seqs"] == 16
    assert big["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16]
    odd = bench_streams.engine_overrides([3, 6])
    assert odd["max_num_seqs"] == 6
    assert odd["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 6]
    args = parser().parse_args(["--model", "m", "--out", "o.json", "--pp-size", "2"])
    assert suite_engine(args)["max_num_seqs"] == 4
    args.streams = [1, 4, 16]
    engine = suite_engine(args, cpu_offload_gb=1.0)
    assert engine["max_num_seqs"] == 16 and engine["pipeline_parallel_size"] == 2
    assert engine["cpu_offload_gb"] == 1.0


@pytest.mark.parametrize("bad", ["0", "1,x", "", "-4"])
def test_bad_stream_counts_are_refused(bad):
    from eodev.bench_offload.cli import parser

    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--model", "m", "--out", "o.json", "--streams", bad])
    assert e.value.code == 2


def _result(config: str, rows: list[dict]) -> dict:
    return {"spec": {"config": config}, "tasks": {"streams": {"by_streams": rows}}}


def test_rows_take_their_ratio_from_the_unpatched_engine_at_the_same_n():
    from eodev import bench_streams

    base = [
        {"streams": 1, "total_decode_tok_s": [500.0, 520.0, 510.0], "tpot_ms_p50": 1.9},
        {"streams": 16, "total_decode_tok_s": [4000.0, 4100.0, 3900.0], "tpot_ms_p50": 3.9},
    ]
    swap = [
        {"streams": 1, "total_decode_tok_s": [490.0, 500.0, 495.0], "tpot_ms_p50": 2.0},
        {"streams": 16, "total_decode_tok_s": [3600.0, 3700.0, 3650.0], "tpot_ms_p50": 4.4},
    ]
    for r in base + swap:
        r["tpot_ms_p90"] = r["tpot_ms_p50"] * 1.2
    swap[1].update(host_reads_per_token=0.31, swaps_per_token=0.012)
    results = {
        ("unpatched", 1): _result("unpatched", base),
        ("offload-03-swap", 1): _result("offload-03-swap", swap),
        ("offload-02", 1): {"spec": {"config": "offload-02"}, "tasks": {}},  # no streams task
    }
    base = results[("unpatched", 1)]
    rows = bench_streams.rows([(spec, results[(spec, 1)], base) for spec, _ in results])
    assert [(r["variant"], r["streams"]) for r in rows] == [
        ("unpatched", 1),
        ("unpatched", 16),
        ("offload-03-swap", 1),
        ("offload-03-swap", 16),
    ]
    assert rows[0]["total_vs_unpatched"] == 1.0
    assert rows[3]["total_vs_unpatched"] == pytest.approx(3650 / 4000)
    table = "\n".join(bench_streams.lines({"streams": rows}))
    assert "| offload-03-swap | 16 | 3650.0 (3600.0, 3700.0, 3650.0) | 0.912x |" in table
    assert "| 0.31 | 0.012 |" in table and "| unpatched | 1 | 510.0" in table
    assert bench_streams.lines({"streams": []}) == []
    assert "prefetch hits" not in table

    rows[3]["prefetch"] = {"hit_share": 0.8125, "bytes_copied_per_step": 12.5e6}
    table = "\n".join(bench_streams.lines({"streams": rows}))
    assert "| 0.31 | 0.012 | 0.812 | 12.5 |" in table
    unpatched = "| unpatched | 1 | 510.0 (500.0, 520.0, 510.0) | 1.000x | 1.900 / 2.280 |"
    assert unpatched + " - | - | - | - |" in table


def test_the_plot_draws_the_patched_rows_against_their_unpatched_engine(tmp_path):
    from eodev import bench_streams

    rows = [
        {"config": "unpatched", "variant": "unpatched", "streams": 16},
        {
            "config": "offload-03-swap",
            "variant": "offload-03-swap+fast",
            "streams": 16,
            "total_decode_tok_s": [3600.0, 3700.0, 3650.0],
            "total_vs_unpatched": 0.9125,
            "host_reads_per_token": 0.31,
        },
    ]
    assert bench_streams.plot({"streams": rows}, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert not bench_streams.plot({"streams": rows[:1]}, tmp_path / "none.png")
    assert not bench_streams.plot({}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
