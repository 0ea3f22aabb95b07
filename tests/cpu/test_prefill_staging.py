# SPDX-License-Identifier: Apache-2.0
"""Prefill staging (VLLM_EXPERT_PREFILL_STAGING) on the CPU: the series' own PrefillStaging
with CPU tensors for the host arenas and the VRAM slots, and torch.cuda's streams and events
replaced by recorders. Checks which layer is copied into which slot and when (one layer
ahead, the first layer after the last for the next chunk, a slot reused only after the
kernels queued before it, nothing copied again that a slot still holds), that the kernel's
view holds exactly the host table's weights, the threshold and CUDA-graph capture, and the
refusals. The copies' overlap and speed need a GPU
(tests/gpu/test_prefill_staging_gpu.py).

    scripts/test tests/cpu/test_prefill_staging.py
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

MIN_TOKENS = 64
TOP_K = 2


class Recorder:
    """torch.cuda's stream and event calls that PrefillStaging makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.capturing = False
        recorder = self

        class Stream:
            def __init__(self, device=None) -> None:
                recorder.calls.append(("new_stream",))

            def wait_stream(self, other) -> None:
                recorder.calls.append(("side_waits_main",))

        class Event:
            def record(self, stream=None) -> None:
                recorder.calls.append(("copy_done",))

        class Main:
            def wait_event(self, event) -> None:
                recorder.calls.append(("main_waits_copy",))

        self.Stream, self.Event, self.main = Stream, Event, Main()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: self.main)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)


def host_table(seed: int, experts: int) -> torch.nn.Module:
    """A split layer's host table in its arena: w13 (INT32, packed), scales, w2."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-(2**31), 2**31 - 1, (experts, 16, 64), dtype=torch.int32, generator=g)
    scales = torch.randn(experts, 2, 64, generator=g).to(torch.bfloat16)
    w2 = torch.randint(-(2**31), 2**31 - 1, (experts, 8, 32), dtype=torch.int32, generator=g)
    parts = [w13, scales, w2]
    sizes = [(t.numel() * t.element_size() + 255) // 256 * 256 for t in parts]
    arena = types.SimpleNamespace(nbytes=sum(sizes))
    arena.host = torch.zeros(arena.nbytes, dtype=torch.uint8)
    arena.device = arena.host  # on the CPU the GPU's view is the memory itself
    views, at = [], 0
    for t, size in zip(parts, sizes, strict=True):
        n = t.numel() * t.element_size()
        arena.host[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
        views.append(arena.device[at : at + n].view(t.dtype).view(t.shape))
        at += size
    host = torch.nn.Module()
    for name, view in zip(("w13_weight", "w13_scales", "w2_weight"), views, strict=True):
        host.register_parameter(name, torch.nn.Parameter(view, requires_grad=False))
    host.activation = "silu"
    host._expert_offload_arena = arena
    host.local_num_experts, host.top_k = experts, TOP_K
    return host


@pytest.fixture
def staging(monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload.prefill_staging import (
        PrefillStaging,
    )

    rec = Recorder()
    rec.install(monkeypatch)
    s = PrefillStaging(MIN_TOKENS)
    hosts = {f"layers.{i}.mlp.experts": host_table(i, 4 + i) for i in range(4)}
    for name, h in hosts.items():
        s.register(h, name)
    return s, rec, hosts


def staged_layers(monkeypatch, experts: list[int]):
    """A staging over one host table per entry of `experts` (its host experts), with
    torch.cuda recorded; the staging, the recorder and the layer names."""
    from vllm.model_executor.layers.fused_moe.expert_offload.prefill_staging import (
        PrefillStaging,
    )

    rec = Recorder()
    rec.install(monkeypatch)
    s = PrefillStaging(MIN_TOKENS)
    names = [f"layers.{i}.mlp.experts" for i in range(len(experts))]
    for i, (name, n) in enumerate(zip(names, experts, strict=True)):
        s.register(host_table(i, n), name)
    return s, rec, names


def _copies(rec: Recorder) -> int:
    return rec.calls.count(("copy_done",))


def test_slots_fit_the_largest_layer_and_small_batches_read_host_memory(staging):
    s, rec, hosts = staging
    largest = max(
        sum((getattr(h, n).numel() * 4 + 255) // 256 * 256 for n in ("w13_weight", "w2_weight"))
        for h in hosts.values()
    )
    # layer 3: w13 7*16*64*4 = 28672, w2 7*8*32*4 = 7168 bytes (scales stay on host)
    assert largest == 28672 + 7168
    assert s.slot_bytes == largest and len(s._slots) == 2
    assert s.staged("layers.0.mlp.experts", MIN_TOKENS - 1) is None  # decode-sized
    assert rec.calls == [] and s.copies == 0


def test_each_layer_is_copied_once_one_layer_ahead(staging):
    s, rec, hosts = staging
    names = list(hosts)
    # layer 0's copy was not queued ahead: one issued now would overlap nothing, so
    # this forward reads host memory, and only layer 1's copy is queued
    assert s.staged(names[0], 2048) is None
    assert s.copies == 1 and s.unstaged == 1
    assert rec.calls == [("new_stream",), ("side_waits_main",), ("copy_done",)]
    for name in names[1:]:
        before = len(rec.calls)
        view = s.staged(name, 2048)
        new = rec.calls[before:]
        # the next layer's copy, after every kernel queued so far (the slot's last
        # reader); after the last layer, the first layer's, for the next chunk
        assert new[:2] == [("side_waits_main",), ("copy_done",)]
        # then this layer's copy, queued by the layer before: only a wait for it
        assert new[2:] == [("main_waits_copy",)]
        host = hosts[name]
        for param in ("w13_weight", "w2_weight"):
            assert torch.equal(getattr(view, param), getattr(host, param))
            # a copy in the slot, not the host memory
            assert getattr(view, param).data_ptr() != getattr(host, param).data_ptr()
        # the scales reach the kernel through its quantisation config, from host memory
        assert view.w13_scales is host.w13_scales and view.activation == "silu"
    assert s.copies == len(names) and s.unstaged == 1
    assert s.held == [names[0], names[3]]
    # layer i reads slot i % 2
    slots = [s._slots[i % 2].data_ptr() for i in range(len(names))]
    assert [s._view(n, i % 2).w13_weight.data_ptr() for i, n in enumerate(names)] == slots


def test_the_next_chunk_finds_its_first_layer_in_its_slot(staging):
    s, rec, hosts = staging
    names = list(hosts)
    for name in names:
        s.staged(name, 1024)
    assert s.copies == 4 and s.held == [names[0], names[3]]
    before = len(rec.calls)
    view = s.staged(names[0], 1024)  # queued by the last layer: layer 1 ahead, a wait
    assert rec.calls[before:] == [("side_waits_main",), ("copy_done",), ("main_waits_copy",)]
    assert s.copies == 5 and s.unstaged == 1  # only the very first forward's layer 0
    assert torch.equal(view.w2_weight, hosts[names[0]].w2_weight)
    s.staged(names[1], 1024)
    assert s.copies == 6  # layer 2 into slot 0, ahead


def test_an_odd_number_of_layers_does_not_copy_the_first_after_the_last(monkeypatch):
    s, rec, names = staged_layers(monkeypatch, [4, 4, 4])
    for name in names:
        s.staged(name, 1024)
    # layers 0 and 2 share slot 0: layer 0 may not overwrite it while layer 2 runs
    assert s.copies == 2 and s.held == [names[2], names[1]]
    assert s.staged(names[0], 1024) is None  # not queued ahead: read from host memory
    assert s.copies == 2 and s.unstaged == 2  # layer 1 is still in slot 1


def test_a_layer_still_in_its_slot_is_not_copied_again(staging):
    s, rec, hosts = staging
    names = list(hosts)
    assert s.staged(names[2], 4096) is None  # not queued ahead; layer 3's copy is
    assert s.copies == 1
    s.staged(names[3], 4096)
    assert s.copies == 2  # layer 0 ahead, for the next chunk
    assert s.staged(names[3], 4096) is not None
    assert s.copies == 2  # both still held


def test_a_chunk_that_picks_fewer_experts_than_the_host_holds_is_not_staged(monkeypatch):
    """The copy moves every host expert of the layer; a forward whose tokens make fewer
    picks (tokens x top-k) than that reads fewer through UVA, so it is not staged, even
    above the minimum size."""
    s, rec, names = staged_layers(monkeypatch, [300, 300])  # top-2: 150 tokens
    assert not s.pays(names[0], 149) and s.pays(names[0], 150)
    assert s.staged(names[0], 149) is None and s.staged(names[1], 149) is None
    assert s.copies == 0 and rec.calls == []  # nothing queued for forwards that lose
    assert s.staged(names[0], 150) is None and s.copies == 1  # layer 1 queued ahead
    assert s.staged(names[1], 150) is not None


def test_nothing_is_staged_while_a_cuda_graph_is_captured(staging):
    s, rec, hosts = staging
    rec.capturing = True
    assert s.staged(next(iter(hosts)), 4096) is None
    assert s.copies == 0


def test_refusals_name_the_problem_and_the_setting(monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload.config import ExpertOffloadError
    from vllm.model_executor.layers.fused_moe.expert_offload.prefill_staging import (
        PrefillStaging,
    )

    Recorder().install(monkeypatch)
    with pytest.raises(ExpertOffloadError, match="MIN_TOKENS must be at least 1"):
        PrefillStaging(0)
    s = PrefillStaging(8)
    plain = types.SimpleNamespace(w13_weight=torch.zeros(4), w2_weight=torch.zeros(4))
    with pytest.raises(ExpertOffloadError, match="no host arena.*VLLM_EXPERT_PREFILL_STAGING"):
        s.register(plain, "layers.0.mlp.experts")
    h = host_table(0, 4)
    h.w13_weight.data = h.w13_weight.data.transpose(1, 2)
    with pytest.raises(ExpertOffloadError, match="w13_weight is not contiguous"):
        s.register(h, "layers.0.mlp.experts")
    h = host_table(0, 4)
    h.w2_weight.data = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ExpertOffloadError, match="w2_weight is not in the layer's host arena"):
        s.register(h, "layers.0.mlp.experts")


def test_the_setting_makes_one_staging_per_worker(monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import prefill_staging

    monkeypatch.setattr(prefill_staging, "_staging", None)
    monkeypatch.setattr(prefill_staging, "_one_table_staging", None)
    monkeypatch.delenv("VLLM_EXPERT_PREFILL_STAGING", raising=False)
    assert prefill_staging.staging_for_registration() is None  # off by default
    monkeypatch.setenv("VLLM_EXPERT_PREFILL_STAGING", "1")
    monkeypatch.setenv("VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS", "300")
    first = prefill_staging.staging_for_registration()
    assert first is not None and first.min_tokens == 300
    assert prefill_staging.staging_for_registration() is first
    assert prefill_staging.get_staging() is first
    # one-table layers: a staging of their own, with the same threshold
    one = prefill_staging.one_table_staging_for_registration()
    assert isinstance(one, prefill_staging.OneTableStaging) and one.min_tokens == 300
    assert prefill_staging.one_table_staging_for_registration() is one
    prefill_staging.reset()
    assert prefill_staging.get_staging() is None
    assert prefill_staging.one_table_staging_for_registration() is not one
