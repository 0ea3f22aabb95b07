# SPDX-License-Identifier: Apache-2.0
"""Decode prefetch (VLLM_EXPERT_DECODE_PREFETCH) on the CPU: the series' DecodePrefetch over
CPU tables and slots, with torch.cuda's streams and events replaced by recorders. Checks the
slot bookkeeping (which rows the guess copies, which the real picks still need, the hit and
miss counters), that every host row a layer's picks need holds the table's bytes in its slot
before the kernel runs whatever the guess was, that the table's VRAM part is never written,
when a forward does not prefetch (prefill-sized, piecewise capture, the last layer, a next
layer on the same slot), the refusals at registration, and prefill staging keeping no slot
across forwards. The copy kernels and the overlap need a GPU
(tests/gpu/test_decode_prefetch_gpu.py).

    scripts/test tests/cpu/test_decode_prefetch.py
"""

from __future__ import annotations

import types

import pytest
import torch
from test_prefill_staging import MIN_TOKENS, Recorder, host_table

EXPERTS = 16
GPU_ROWS = 10  # rows 10-15 are host rows
TOP_K = 3
HIDDEN = 8
ROW_WORDS = (5, 3)  # two staged weights per layer, in int64 words per row
GPU_WORDS = (GPU_ROWS * 5 - 2, GPU_ROWS * 3)  # w13's first host row straddles the boundary


class FakeStaging:
    """What DecodePrefetch uses of OneTableStaging, over CPU tensors: per layer, its
    tables' words and a staging view's words (the VRAM part shared with the table, as
    the alias range maps it; the rest the layer's slot)."""

    def __init__(self, names: list[str], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.names = names
        self.keep_slots_across_forwards = True
        self.tables: dict[str, list[torch.Tensor]] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for name in names:
            tables, views = [], []
            for row_words, gpu_words in zip(ROW_WORDS, GPU_WORDS, strict=True):
                t = torch.randint(-(2**62), 2**62, (EXPERTS * row_words,), generator=g)
                v = torch.full_like(t, -1)  # what the slot held before: garbage
                v[:gpu_words] = t[:gpu_words]  # the VRAM part both map
                tables.append(t)
                views.append(v)
            self.tables[name], self.views[name] = tables, views
        self.refuse: dict[str, str] = {}

    def slot_of(self, name: str) -> int:
        return self.names.index(name) % 2

    def pays(self, name: str, num_tokens: int) -> bool:
        return num_tokens >= MIN_TOKENS

    def view(self, name: str):
        return ("view", name)

    def copy_parts(self, name: str):
        from vllm.model_executor.layers.fused_moe.expert_offload.config import (
            ExpertOffloadError,
        )
        from vllm.model_executor.layers.fused_moe.expert_offload.decode_prefetch import (
            CopyPart,
        )

        if name in self.refuse:
            raise ExpertOffloadError(self.refuse[name])
        return [
            CopyPart(src=t, dst=v, row_words=rw, gpu_words=gw)
            for t, v, rw, gw in zip(
                self.tables[name], self.views[name], ROW_WORDS, GPU_WORDS, strict=True
            )
        ]

    def row_in_slot(self, name: str, row: int) -> bool:
        """Whether every word of ``row`` reads the table's bytes through the view."""
        return all(
            torch.equal(v[row * rw : (row + 1) * rw], t[row * rw : (row + 1) * rw])
            for t, v, rw in zip(self.tables[name], self.views[name], ROW_WORDS, strict=True)
        )


def layer(name: str, seed: int, gate: object = "linear") -> types.SimpleNamespace:
    """A one-table layer as DecodePrefetch sees it: experts 0-9 in VRAM rows, 10-15 in host
    rows, in a shuffled order (expert -> row), and its router."""
    g = torch.Generator().manual_seed(100 + seed)
    expert_to_row = torch.randperm(EXPERTS, generator=g).to(torch.int32)
    row_to_expert = [0] * EXPERTS
    for e, r in enumerate(expert_to_row.tolist()):
        row_to_expert[r] = e
    table = types.SimpleNamespace(
        gpu_rows=GPU_ROWS, row_to_expert=row_to_expert, expert_to_row=expert_to_row
    )
    if gate == "linear":
        gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
    m = types.SimpleNamespace(layer_name=name, top_k=TOP_K)
    m.__dict__.update(one_table=table, router_gate=gate)
    return m


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    r = Recorder()
    r.install(monkeypatch)
    return r


def make(names: list[str], rec: Recorder, programs: int = 4, modules=None):
    from vllm.model_executor.layers.fused_moe.expert_offload.decode_prefetch import (
        DecodePrefetch,
    )

    staging = FakeStaging(names)
    p = DecodePrefetch(staging, programs)
    modules = modules or [layer(n, i) for i, n in enumerate(names)]
    registered = [p.register(m) for m in modules]
    return p, staging, modules, registered


def names_of(n: int) -> list[str]:
    return [f"layers.{i}.mlp.experts" for i in range(n)]


def host_rows_of(rows: torch.Tensor) -> set[int]:
    return {r for r in rows.reshape(-1).tolist() if r >= GPU_ROWS}


def guessed_rows(module, x: torch.Tensor) -> set[int]:
    ids = torch.topk(x @ module.router_gate.weight.T, TOP_K, dim=-1).indices
    return host_rows_of(module.one_table.expert_to_row[ids])


def test_every_host_row_the_picks_need_is_in_the_slot_and_vram_is_not_written(rec):
    p, staging, modules, _ = make(names_of(3), rec)
    x = torch.randn(4, HIDDEN)
    before = {n: [v.clone() for v in staging.views[n]] for n in staging.names}
    # layer 0 has no guess: its picks' host rows are copied before its kernel
    rows0 = torch.tensor([[0, 11, 15], [3, 11, 12]], dtype=torch.int32)
    assert p.run(modules[0], x, rows0) == ("view", staging.names[0])
    for r in host_rows_of(rows0):
        assert staging.row_in_slot(staging.names[0], r)
    for n in staging.names:
        for v, old, gw in zip(staging.views[n], before[n], GPU_WORDS, strict=True):
            assert torch.equal(v[:gw], old[:gw])  # the table's VRAM part: untouched
    # w13's row 9 (a VRAM row) shares its last words with row 10's first: the copy of
    # row 10 writes only what lies past the VRAM part
    assert 10 not in host_rows_of(rows0)
    c = p.counters()
    assert c["missed_rows"] == 3 and c["host_picks"] == 4 and c["hit_picks"] == 0
    # layer 0's three rows, and the rows it guessed for layer 1
    assert c["guessed_rows"] == len(guessed_rows(modules[1], x))
    assert c["bytes_copied"] == (3 + c["guessed_rows"]) * sum(ROW_WORDS) * 8


def test_the_next_layer_guess_is_copied_on_the_side_stream_and_counted(rec):
    p, staging, modules, _ = make(names_of(3), rec)
    x = torch.randn(5, HIDDEN)
    p.run(modules[0], x, torch.zeros(5, TOP_K, dtype=torch.int32))  # all VRAM rows
    guess = guessed_rows(modules[1], x)
    assert guess, "the fixture's router should pick some host rows"
    for r in guess:
        assert staging.row_in_slot(staging.names[1], r)
    c = p.counters()
    assert c["guessed_rows"] == len(guess) and c["missed_rows"] == 0
    # the guess runs after everything queued on the main stream, on the side stream
    assert rec.calls == [("new_stream",), ("side_waits_main",), ("copy_done",)]
    # layer 1 waits for it before its own bookkeeping and copies
    picks = modules[1].one_table.expert_to_row[
        torch.topk(x @ modules[1].router_gate.weight.T, TOP_K, dim=-1).indices
    ]
    p.run(modules[1], x, picks)
    assert rec.calls[3] == ("main_waits_copy",)
    c = p.counters()
    host_picks = sum(1 for r in picks.reshape(-1).tolist() if r >= GPU_ROWS)
    # the real router is the guessing one here: every host pick finds its row guessed
    assert c["host_picks"] == host_picks and c["hit_picks"] == host_picks
    assert c["missed_rows"] == 0


def test_a_wrong_guess_costs_a_copy_not_a_wrong_row(rec):
    p, staging, modules, _ = make(names_of(2), rec)
    x = torch.randn(2, HIDDEN)
    p.run(modules[0], x, torch.zeros(2, TOP_K, dtype=torch.int32))
    guess = guessed_rows(modules[1], x)
    # the real picks: every host row but the guessed ones, and one guessed row
    others = sorted(set(range(GPU_ROWS, EXPERTS)) - guess)
    real = [*others, min(guess)] if guess else others
    rows = torch.tensor([real], dtype=torch.int32)
    p.run(modules[1], x, rows)
    for r in real:
        assert staging.row_in_slot(staging.names[1], r)
    c = p.counters()
    assert c["missed_rows"] == len(others) and c["hit_picks"] == (1 if guess else 0)
    assert c["host_picks"] == len(real)


def test_rows_repeated_across_tokens_are_copied_once(rec):
    p, staging, modules, _ = make(names_of(1), rec)
    rows = torch.tensor([[12, 12, 3], [12, 14, 14]], dtype=torch.int32)
    p.run(modules[0], torch.randn(2, HIDDEN), rows)
    c = p.counters()
    assert c["missed_rows"] == 2 and c["host_picks"] == 5  # one layer: no guess
    assert c["guessed_rows"] == 0 and c["bytes_copied"] == 2 * sum(ROW_WORDS) * 8


def test_ids_outside_the_table_are_left_alone(rec):
    p, staging, modules, _ = make(names_of(1), rec)
    rows = torch.tensor([[-1, EXPERTS, 13]], dtype=torch.int32)
    p.run(modules[0], torch.randn(1, HIDDEN), rows)
    assert p.counters()["host_picks"] == 1 and p.counters()["missed_rows"] == 1


def test_a_new_forward_starts_without_guesses(rec):
    p, staging, modules, _ = make(names_of(2), rec)
    x = torch.randn(3, HIDDEN)
    p.run(modules[0], x, torch.zeros(3, TOP_K, dtype=torch.int32))
    assert set(p._pending) == {staging.names[1]}
    # the forward ended early (an error, a profile run): the next one starts at layer 0
    p.run(modules[0], x, torch.zeros(3, TOP_K, dtype=torch.int32))
    assert set(p._pending) == {staging.names[1]}
    waits = rec.calls.count(("main_waits_copy",))
    assert waits == 0  # layer 0 never waits on a guess


def test_prefill_sized_forwards_and_piecewise_capture_read_host_memory(rec, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    p, staging, modules, _ = make(names_of(2), rec)
    rows = torch.tensor([[11, 12, 13]], dtype=torch.int32)
    big = torch.randn(MIN_TOKENS, HIDDEN)
    assert p.run(modules[0], big, rows.expand(MIN_TOKENS, -1)) is None  # staging's
    monkeypatch.setattr(decode_prefetch, "_graph_capture", lambda: "piecewise")
    assert p.run(modules[0], torch.randn(1, HIDDEN), rows) is None
    assert rec.calls == [] and p.counters()["host_picks"] == 0


def test_each_graph_kind_says_once_whether_it_prefetches(rec, monkeypatch, caplog):
    import logging

    import vllm.logger
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    vllm.logger._print_info_once.cache_clear()  # "once" per process: other tests said it
    p, staging, modules, _ = make(names_of(2), rec)
    rows = torch.tensor([[11, 12, 3]], dtype=torch.int32)
    logger = logging.getLogger(decode_prefetch.__name__)
    monkeypatch.setattr(logger, "propagate", True)
    # before any eager forward has made its bookkeeping, a full capture leaves it out
    monkeypatch.setattr(decode_prefetch, "_graph_capture", lambda: "full")
    assert p.run(modules[0], torch.randn(1, HIDDEN), rows) is None and not p._marks
    monkeypatch.setattr(decode_prefetch, "_graph_capture", lambda: None)
    assert p.run(modules[0], torch.randn(1, HIDDEN), rows) is not None  # eager: made
    with caplog.at_level(logging.INFO, logger=decode_prefetch.__name__):
        for mode in ("piecewise", "piecewise", "full", "full"):
            monkeypatch.setattr(decode_prefetch, "_graph_capture", lambda m=mode: m)
            view = p.run(modules[0], torch.randn(1, HIDDEN), rows)
            assert (view is None) == (mode == "piecewise")
    assert caplog.text.count("decode prefetch is off in piecewise CUDA graphs") == 1
    assert caplog.text.count("decode prefetch is captured in full CUDA graphs") == 1
    # outside a capture (eager), nothing is said
    monkeypatch.setattr(decode_prefetch, "_graph_capture", lambda: None)
    assert p.run(modules[0], torch.randn(1, HIDDEN), rows) is not None


@pytest.mark.parametrize(
    ("capturing", "mode", "kind"),
    [
        (False, "FULL", None),  # eager: no capture
        (True, "PIECEWISE", "piecewise"),  # the pieces between attention layers
        (True, "FULL", "full"),  # the V1 runner's full capture
        # the gpu/ runner (vLLM 0.29's default) captures a plain forward in one graph
        (True, "NONE", "full"),
        (True, None, "piecewise"),  # no forward context says: the safe side
    ],
)
def test_the_graph_kind_follows_how_the_runner_captures(monkeypatch, capturing, mode, kind):
    import vllm.forward_context
    from vllm.config import CUDAGraphMode
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)

    def context():
        assert mode is not None, "Forward context is not set."
        return types.SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode[mode])

    monkeypatch.setattr(vllm.forward_context, "get_forward_context", context)
    assert decode_prefetch._graph_capture() == kind


def test_the_last_layer_and_a_next_layer_on_the_same_slot_are_not_guessed(rec):
    # layers 0 and 2 registered (layer 1 has no router): both read slot 0, so layer 0's
    # guess for layer 2 would overwrite rows layer 0's kernel is about to read
    names = names_of(3)
    modules = [layer(n, i) for i, n in enumerate(names)]
    modules[1].router_gate = None
    p, staging, modules, registered = make(names, rec, modules=modules)
    assert registered == [True, False, True]
    x = torch.randn(2, HIDDEN)
    p.run(modules[0], x, torch.zeros(2, TOP_K, dtype=torch.int32))
    p.run(modules[2], x, torch.zeros(2, TOP_K, dtype=torch.int32))
    assert rec.calls == [] and p._pending == {}


def test_with_the_runtime_swap_the_guess_uses_its_current_rows(rec):
    p, staging, modules, _ = make(names_of(2), rec)
    moved = torch.arange(EXPERTS, dtype=torch.int32).flip(0)  # rows after some swaps
    swap = types.SimpleNamespace(
        state=types.SimpleNamespace(expert_to_row=[None, moved]), index={"layers.1.mlp.experts": 1}
    )
    modules[1].swap = swap
    x = torch.randn(3, HIDDEN)
    p.run(modules[0], x, torch.zeros(3, TOP_K, dtype=torch.int32))
    ids = torch.topk(x @ modules[1].router_gate.weight.T, TOP_K, dim=-1).indices
    expected = host_rows_of(moved[ids])
    assert p.counters()["guessed_rows"] == len(expected)
    for r in expected:
        assert staging.row_in_slot(staging.names[1], r)


def test_layers_that_cannot_be_prefetched_say_why(rec):
    names = names_of(5)
    modules = [layer(n, i) for i, n in enumerate(names)]
    modules[0].router_gate = None
    biased = torch.nn.Linear(HIDDEN, EXPERTS, bias=True)
    modules[1].router_gate = biased
    quantized = types.SimpleNamespace(weight=torch.zeros(EXPERTS, HIDDEN, dtype=torch.int8))
    modules[2].router_gate = quantized
    from vllm.model_executor.layers.fused_moe.expert_offload.decode_prefetch import (
        DecodePrefetch,
    )

    staging = FakeStaging(names)
    staging.refuse[names[3]] = "a row of w2_weight (12 B) is not a whole number of 8-byte words"
    p = DecodePrefetch(staging, 4)
    assert [p.register(m) for m in modules] == [False, False, False, False, True]
    assert "router" in p.skipped[names[0]]
    assert "bias" in p.skipped[names[1]]
    assert "plain linear layer" in p.skipped[names[2]]
    assert "8-byte words" in p.skipped[names[3]]


def test_programs_must_be_positive():
    from vllm.model_executor.layers.fused_moe.expert_offload.config import ExpertOffloadError
    from vllm.model_executor.layers.fused_moe.expert_offload.decode_prefetch import (
        DecodePrefetch,
    )

    with pytest.raises(ExpertOffloadError, match="VLLM_EXPERT_DECODE_PREFETCH_PROGRAMS"):
        DecodePrefetch(FakeStaging(names_of(1)), 0)


def test_the_setting_makes_one_prefetch_and_stops_staging_keeping_slots(monkeypatch, caplog):
    import vllm.envs as envs
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    decode_prefetch.reset()
    staging = FakeStaging(names_of(1))
    monkeypatch.setattr(envs, "VLLM_EXPERT_DECODE_PREFETCH", False, raising=False)
    assert decode_prefetch.for_registration(staging) is None
    assert staging.keep_slots_across_forwards
    monkeypatch.setattr(envs, "VLLM_EXPERT_DECODE_PREFETCH", True, raising=False)
    monkeypatch.setattr(envs, "VLLM_EXPERT_DECODE_PREFETCH_PROGRAMS", 8, raising=False)
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    config.scheduler_config.max_num_seqs = 24
    with set_current_vllm_config(config):
        p = decode_prefetch.for_registration(staging)
    assert p is decode_prefetch.for_registration(staging) and p.programs == 8
    # decode-sized forwards: one token per sequence the scheduler may run
    assert p.max_tokens == 24
    assert not staging.keep_slots_across_forwards
    decode_prefetch.reset()


def test_a_forward_larger_than_a_decode_batch_reads_host_memory(rec):
    from vllm.model_executor.layers.fused_moe.expert_offload.decode_prefetch import (
        DecodePrefetch,
    )

    names = names_of(2)
    p = DecodePrefetch(FakeStaging(names), 4, max_tokens=4)
    modules = [layer(n, i) for i, n in enumerate(names)]
    assert all(p.register(m) for m in modules)
    rows = torch.tensor([[11, 12, 13]], dtype=torch.int32)
    # five tokens: a short prompt that staging does not take; no guess, no copy
    assert p.run(modules[0], torch.randn(5, HIDDEN), rows.expand(5, -1)) is None
    assert rec.calls == [] and p.counters()["host_picks"] == 0 and not p._pending
    # four: a decode batch
    assert p.run(modules[0], torch.randn(4, HIDDEN), rows.expand(4, -1)) is not None
    assert p.counters()["host_picks"] > 0 and set(p._pending) == {names[1]}


def test_the_setting_without_one_table_staging_says_it_does_nothing(monkeypatch, caplog):
    import logging

    import vllm.envs as envs
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    decode_prefetch.reset()
    monkeypatch.setattr(envs, "VLLM_EXPERT_DECODE_PREFETCH", True, raising=False)
    logger = logging.getLogger(decode_prefetch.__name__)
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger=decode_prefetch.__name__):
        decode_prefetch.log_summary()
    assert "VLLM_EXPERT_DECODE_PREFETCH=1 does nothing" in caplog.text
    assert "VLLM_EXPERT_PREFILL_STAGING=1" in caplog.text


def test_prefill_staging_keeps_no_slot_across_forwards_beside_prefetch(monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload.prefill_staging import (
        PrefillStaging,
    )

    r = Recorder()
    r.install(monkeypatch)
    s = PrefillStaging(MIN_TOKENS)
    names = names_of(4)
    for i, name in enumerate(names):
        s.register(host_table(i, 4), name)
    s.keep_slots_across_forwards = False
    for name in names:
        s.staged(name, 1024)
    # no copy of the first layer queued after the last: decode steps write the slots
    assert s.copies == 3
    # the next chunk's first layer does not trust what its slot held
    assert s.staged(names[0], 1024) is None and s.unstaged == 2


def test_the_kernels_in_the_triton_interpreter(run_interpreted):
    run_interpreted("tests/cpu/prefetch_interpreted_checks.py", 15)


def test_the_counters_are_logged_at_shutdown_and_not_before(rec, monkeypatch, caplog):
    import logging

    import vllm.envs as envs
    from vllm.model_executor.layers.fused_moe import expert_offload
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch

    p, staging, modules, _ = make(names_of(2), rec)
    p.run(modules[0], torch.randn(2, HIDDEN), torch.tensor([[11, 12, 3]], dtype=torch.int32))
    monkeypatch.setattr(decode_prefetch, "_prefetch", p)
    monkeypatch.setattr(envs, "VLLM_EXPERT_DECODE_PREFETCH", True, raising=False)
    logger = logging.getLogger(expert_offload.__name__)
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger=expert_offload.__name__):
        expert_offload.prepare_step(None, None)
        assert "decode prefetch since start" not in caplog.text  # never per step
        expert_offload.shutdown()
    c = p.counters()
    assert (
        f"decode prefetch since start: {c['host_picks']} host picks, {c['hit_picks']} found "
        f"their row guessed; {c['guessed_rows']} rows guessed, {c['missed_rows']} missed; "
        f"{c['bytes_copied']} bytes copied." in caplog.text
    )
    assert c["host_picks"] == 2


def test_the_counters_reach_metrics_every_few_steps_without_a_wait(rec, monkeypatch, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch, metrics
    from vllm.v1.metrics import expert_offload as served

    p, staging, modules, _ = make(names_of(2), rec)
    assert p.published_counters() is None  # nothing copied before the first forward
    p.run(modules[0], torch.randn(2, HIDDEN), torch.tensor([[11, 12, 3]], dtype=torch.int32))
    for _ in range(decode_prefetch.PUBLISH_EVERY - 1):
        p.prepare_step()
    assert p.published_counters() is None  # copied every PUBLISH_EVERY steps
    p.prepare_step()
    want = {f"prefetch_{k}": v for k, v in p.counters().items()}
    assert p.published_counters() == want and want["prefetch_host_picks"] == 2
    monkeypatch.setattr(decode_prefetch, "_prefetch", p)
    pub = metrics.RankPublisher(str(tmp_path), "dp0_pp0_tp0", {"path": "offload-03-swap"}, 60)
    pub.close()
    monkeypatch.setenv("VLLM_EXPERT_METRICS_DIR", str(tmp_path))
    registry = CollectorRegistry()
    served.register_metrics(registry)
    text = generate_latest(registry).decode()
    for name, value in want.items():
        line = f'vllm:expert_offload_{name}_total{{rank="dp0_pp0_tp0"}} {float(value)}'
        assert line in text, name
