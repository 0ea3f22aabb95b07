# SPDX-License-Identifier: Apache-2.0
"""The engine probe's VRAM figure is the engine process's own (driver accounting), not the
device's used memory, which counts both engines of a paired benchmark; where the driver does
not list the process, it says so (None) and the report falls back to the device figure.
The probe's placement record counts one-table GPU rows whose bytes sit in host memory.

    scripts/test tests/cpu/test_engine_probe_vram.py
"""

from __future__ import annotations

import os
import stat

import pytest
from eodev import engine_probe
from eodev.bench_offload.memory import vram_bytes


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    def install(stdout: str, rc: int = 0) -> None:
        tool = tmp_path / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\ncat <<'END'\n{stdout}\nEND\nexit {rc}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install


def test_the_process_row_is_read_in_mib(fake_smi):
    fake_smi(f"4242, 30000\n{os.getpid()}, 20480")
    assert engine_probe.process_vram_bytes() == 20480 * 1024 * 1024
    assert engine_probe.process_vram_bytes(4242) == 30000 * 1024 * 1024


def test_a_process_the_driver_does_not_list_or_a_failing_tool_gives_none(fake_smi):
    fake_smi("4242, 30000")
    assert engine_probe.process_vram_bytes() is None
    fake_smi(f"{os.getpid()}, [N/A]")
    assert engine_probe.process_vram_bytes() is None
    fake_smi("", rc=9)
    assert engine_probe.process_vram_bytes() is None


def test_the_report_prefers_the_process_figure():
    gib = 1 << 30
    assert vram_bytes({"process_vram_bytes": 20 * gib, "device_used_bytes": 50 * gib}) == 20 * gib
    assert vram_bytes({"process_vram_bytes": None, "device_used_bytes": 50 * gib}) == 50 * gib
    assert vram_bytes({"device_used_bytes": 50 * gib}) == 50 * gib


def test_gpu_name_lists_each_model_once_and_is_unknown_without_the_tool(fake_smi, monkeypatch):
    from eodev import nvsmi

    fake_smi("NVIDIA H200\nNVIDIA H200")
    assert nvsmi.gpu_name() == "NVIDIA H200"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert nvsmi.gpu_name() == "unknown" and nvsmi.query("--query-gpu=name") is None


def test_placement_counts_one_table_gpu_rows_that_sit_in_host_memory(monkeypatch):
    """A one-table layer whose VMM range for a tensor holds fewer VRAM rows than the layer's
    GPU experts (the scales, before the VRAM part was rounded up) is counted, so a GPU test
    can require 0."""
    import types

    import torch
    from vllm.model_executor.layers.fused_moe import routed_experts

    class Experts(torch.nn.Module):
        quant_method = object()

    monkeypatch.setattr(routed_experts, "RoutedExperts", Experts)

    def layer(vram_rows):
        m = Experts()
        owners = [types.SimpleNamespace(gpu_bytes=4, host_bytes=1, gpu_rows=r) for r in vram_rows]
        m.__dict__["one_table"] = types.SimpleNamespace(gpu_rows=461, owners=owners)
        return m

    model = torch.nn.ModuleList([layer([460, 461, 450, 409]), layer([461, 462, 461, 461])])
    out = engine_probe._expert_placement(model)
    assert out["one_table_layers"] == out["moe_layers"] == 2
    assert out["one_table_gpu_rows_in_host_memory"] == 1 + 11 + 52
    assert (out["expert_gpu_bytes"], out["expert_host_bytes"]) == (32, 8)


def test_placement_counts_uva_offload_by_parameter_and_by_layer(monkeypatch):
    """vLLM's --cpu-offload-gb offloads parameter by parameter and can stop inside a layer
    (an H200 run: layer 0 whole and layer 1's w13 only). Only the offloaded tensors
    count as host bytes, per layer, and the benchmark weights that layer's reads by its
    host share."""
    import torch
    from eodev.bench_offload.placement import uva_placement
    from vllm.model_executor.layers.fused_moe import routed_experts

    class Experts(torch.nn.Module):
        quant_method = object()

        def __init__(self, offloaded):
            super().__init__()
            self.w13 = torch.nn.Parameter(torch.zeros(6, dtype=torch.uint8), requires_grad=False)
            self.w2 = torch.nn.Parameter(torch.zeros(3, dtype=torch.uint8), requires_grad=False)
            self.scales = torch.nn.Parameter(torch.zeros(1, dtype=torch.uint8), requires_grad=False)
            for name in offloaded:
                getattr(self, name)._vllm_is_uva_offloaded = True

    monkeypatch.setattr(routed_experts, "RoutedExperts", Experts)
    model = torch.nn.ModuleList([Experts(["w13", "w2", "scales"]), Experts(["w13"]), Experts([])])
    out = engine_probe._expert_placement(model)
    assert (out["expert_host_bytes"], out["expert_gpu_bytes"]) == (16, 14)
    assert out["expert_host_bytes_by_layer"] == [10, 6, 0]
    assert out["expert_bytes_by_layer"] == [10, 10, 10]

    every = set(range(4))
    placed, share = uva_placement(out, 3, every)
    assert placed == {0: every, 1: every} and share == {0: 1.0, 1: 0.6}
    # a run recorded before the per-layer bytes: whole layers, rounded
    old = {"expert_host_bytes": 16, "expert_gpu_bytes": 14}
    assert uva_placement(old, 3, every) == ({0: every, 1: every}, None)


def test_census_names_tensors_beside_the_weights():
    """The census lists live tensors that are not the model's weights (here: a copy that a
    quantisation config kept of a split layer's host scales), grouped by shape and dtype
    with their holder, and leaves out parameters, the host table and a view of a weight."""
    import torch

    class QuantDesc:
        def __init__(self, scale):
            self.scale = scale

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13 = torch.nn.Parameter(torch.ones(37, 4), requires_grad=False)
            self.register_buffer("expert_map", torch.arange(37))
            host = torch.nn.Module()
            host.w13 = torch.nn.Parameter(torch.ones(3, 41), requires_grad=False)
            self.__dict__["host_experts"] = host
            self.quant = QuantDesc(torch.ones(3, 53, dtype=torch.float16))  # the stray copy
            self.view_of_weight = self.w13[:2]  # shares the weight's storage

    model = torch.nn.ModuleList([Layer(), Layer()])
    kept = {"workspace": torch.zeros(1009, dtype=torch.int32)}
    out = engine_probe.tensor_census(model, device_type="cpu", top=1000, holders=1000)
    by_shape = {(tuple(r["shape"]), r["dtype"]): r for r in out["top"]}
    stray = by_shape[((3, 53), "float16")]
    assert (stray["count"], stray["bytes"]) == (2, 2 * 3 * 53 * 2)
    assert stray["held_by"] == ["QuantDesc.scale"]
    assert by_shape[((1009,), "int32")]["held_by"] == ["dict['workspace']"]
    for weight in [(37, 4), (3, 41), (37,), (2, 4)]:
        assert not any(tuple(r["shape"]) == weight for r in out["top"])
    assert out["other_bytes"] >= 2 * 318 + 4036
    assert kept  # alive until here


def test_census_sees_tensors_after_vllm_freezes_the_collector():
    """vLLM's engine core calls gc.freeze() after start-up, and gc.get_objects() leaves out
    frozen objects: a census on an H200 found no tensor at all, the 4 GiB KV cache
    included. The census unfreezes for its walk (holders included) and freezes again."""
    import gc

    import torch

    class Holder:
        pass

    holder = Holder()
    holder.kv_cache = torch.zeros(4099, dtype=torch.int16)
    gc.freeze()
    try:
        out = engine_probe.tensor_census(
            torch.nn.Linear(2, 2), device_type="cpu", top=1000, holders=1000
        )
        assert gc.get_freeze_count() > 0  # frozen again afterwards
    finally:
        gc.unfreeze()
    row = next(r for r in out["top"] if r["shape"] == [4099])
    assert (row["dtype"], row["bytes"]) == ("int16", 8198)
    assert row["held_by"] == ["Holder.kv_cache"]


def test_census_skips_tensors_without_a_data_pointer():
    """In an engine, the unfrozen walk also meets torch.compile's fake tensors, whose
    storage has no data pointer (asking for it raises): a census on an H200 stopped every
    engine there. Such tensors hold no memory of their own, and the census leaves them
    out. A wrapper subclass without storage (how fake tensors are built) stands in."""
    import torch

    class Storageless(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.int16)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    fake = Storageless((4111,))
    with pytest.raises(RuntimeError):
        fake.untyped_storage().data_ptr()
    real = torch.zeros(4127, dtype=torch.int16)
    out = engine_probe.tensor_census(torch.nn.Linear(2, 2), device_type="cpu", top=1000, holders=0)
    shapes = [r["shape"] for r in out["top"]]
    assert [4127] in shapes and [4111] not in shapes
    del fake, real


def test_weight_blocks_count_the_allocator_blocks_that_hold_the_weights():
    """torch's allocated bytes count whole allocator blocks: the probe sums the blocks of
    the expert weights and of the other weights against the bytes their tensors asked
    for (a block handed out whole is larger), and leaves freed blocks and non-weights
    out."""
    mib = 1 << 20
    blocks = [  # one segment, tiled in order from its start
        {"size": 12 * mib, "requested_size": 11_801_600, "state": "active_allocated"},
        {"size": 4 * mib, "requested_size": 4 * mib, "state": "active_allocated"},
        {"size": 2 * mib, "requested_size": 2 * mib, "state": "inactive"},
        {"size": 6 * mib, "requested_size": 5_900_800, "state": "active_allocated"},
        {"size": 1 * mib, "requested_size": 1000, "state": "active_allocated"},
    ]
    base = 0x7F00_0000_0000
    starts = [base, base + 12 * mib, base + 16 * mib, base + 18 * mib, base + 24 * mib]
    snapshot = {"segments": [{"address": base, "blocks": blocks}]}
    weights = {starts[0], starts[1], starts[2], starts[3]}  # the last block is no weight
    out = engine_probe.weight_blocks(snapshot, weights, experts={starts[0], starts[3]})
    assert out == {
        "expert_blocks": 2,
        "expert_block_bytes": 18 * mib,
        "expert_requested_bytes": 11_801_600 + 5_900_800,
        "other_blocks": 1,
        "other_block_bytes": 4 * mib,
        "other_requested_bytes": 4 * mib,
    }


def test_stranded_free_counts_free_bytes_in_segments_that_hold_live_blocks():
    """The process's VRAM counts every cached segment whole; empty_cache gives back only
    wholly free ones. The probe separates the free bytes stranded beside live blocks
    from those of free segments, and lists the segments that strand the most with the
    weights that keep them (a block's address: its own, else its segment's start plus the
    sizes before it)."""
    mib = 1 << 20
    live, free = "active_allocated", "inactive"
    segments = [
        {  # a 20 MiB segment: 2 MiB live, 18 MiB stranded
            "total_size": 20 * mib,
            "address": 100 * mib,
            "segment_pool_id": (0, 0),
            "blocks": [{"size": 2 * mib, "state": live}, {"size": 18 * mib, "state": free}],
        },
        {  # wholly free: empty_cache would give it back
            "total_size": 40 * mib,
            "blocks": [{"size": 40 * mib, "state": free}],
        },
        {  # full: nothing stranded, not listed
            "total_size": 8 * mib,
            "blocks": [{"size": 8 * mib, "state": live}],
        },
        {  # 1 MiB stranded between two live blocks of a private pool
            "segment_pool_id": (1, 3),
            "address": 200 * mib,
            "blocks": [
                {"size": 6 * mib, "state": live},
                {"size": 1 * mib, "state": free},
                {"size": 3 * mib, "state": live, "address": 207 * mib},
            ],
        },
    ]
    names = {100 * mib: "model.layers.0.mlp.gate.weight", 207 * mib: "scales"}
    out = engine_probe.stranded_free({"segments": segments}, top=5, names=names)
    assert out["stranded_bytes"] == 19 * mib
    assert out["stranded_segments"] == 2
    assert out["free_segment_bytes"] == 40 * mib
    assert out["top"] == [
        {
            "segment_bytes": 20 * mib,
            "free_bytes": 18 * mib,
            "largest_live_bytes": 2 * mib,
            "pool": "(0, 0)",
            "live": [{"bytes": 2 * mib, "name": "model.layers.0.mlp.gate.weight"}],
        },
        {
            "segment_bytes": 10 * mib,
            "free_bytes": 1 * mib,
            "largest_live_bytes": 6 * mib,
            "pool": "(1, 3)",
            "live": [{"bytes": 6 * mib, "name": ""}, {"bytes": 3 * mib, "name": "scales"}],
        },
    ]
    assert engine_probe.stranded_free({"segments": segments}, top=1)["top"][0]["free_bytes"] == (
        18 * mib
    )


def test_allocation_sites_group_live_blocks_by_the_vllm_code_that_made_them():
    """From an allocator snapshot with history (innermost frame first): active blocks
    that are not weights, grouped by the innermost frame under vllm/; freed blocks and
    the weights' own blocks are left out."""

    def frames(*where):
        return [{"filename": f, "line": n, "name": fn} for f, n, fn in where]

    alloc = ("/usr/lib/python3/site-packages/torch/utils/_device.py", 104, "__torch_function__")
    gptq = ("/tmp/site/vllm/model_executor/layers/quantization/auto_gptq.py", 657, "create")
    kv = ("/tmp/site/vllm/v1/worker/gpu_model_runner.py", 6100, "_allocate_kv_cache")
    blocks = [
        {
            "address": 0x1000,
            "size": 2 << 20,
            "requested_size": 1_310_720,
            "state": "active_allocated",
            "frames": frames(alloc, gptq),
        },
        {
            "address": 0x9000,
            "size": 2 << 20,
            "requested_size": 1_310_720,
            "state": "active_allocated",
            "frames": frames(alloc, gptq),
        },
        {
            "address": 0x5000,
            "size": 4 << 20,
            "requested_size": 4 << 20,
            "state": "active_allocated",
            "frames": frames(kv),
        },
        {
            "address": 0x7000,
            "size": 8 << 20,
            "requested_size": 8 << 20,
            "state": "inactive",
            "frames": frames(kv),
        },
        {
            "address": 0x8000,
            "size": 1 << 20,
            "requested_size": 1 << 20,
            "state": "active_allocated",
            "frames": frames(gptq),
        },
        {
            "address": 0xA000,
            "size": 512,
            "requested_size": 100,
            "state": "active_allocated",
            "frames": [],
        },
    ]
    snapshot = {"segments": [{"blocks": blocks[:3]}, {"blocks": blocks[3:]}]}
    out = engine_probe.allocation_sites(snapshot, exclude={0x8000})
    assert out["other_bytes"] == 2 * 1_310_720 + (4 << 20) + 100
    assert out["other_block_bytes"] == 2 * (2 << 20) + (4 << 20) + 512  # whole blocks
    assert out["top"] == [
        {
            "site": "vllm/v1/worker/gpu_model_runner.py:6100 _allocate_kv_cache",
            "count": 1,
            "bytes": 4 << 20,
            "sizes": [4 << 20],
        },
        {
            "site": "vllm/model_executor/layers/quantization/auto_gptq.py:657 create",
            "count": 2,
            "bytes": 2_621_440,
            "sizes": [1_310_720],
        },
        {"site": "(no stack recorded)", "count": 1, "bytes": 100, "sizes": [100]},
    ]
    # a stack with no vLLM frame is named by its innermost frame
    only_torch = {"segments": [{"blocks": [{**blocks[0], "frames": frames(alloc)}]}]}
    site = engine_probe.allocation_sites(only_torch, set())["top"][0]["site"]
    assert site == "/usr/lib/python3/site-packages/torch/utils/_device.py:104 __torch_function__"
    # blocks without an address of their own tile their segment from its start, in order
    tiled = [{k: v for k, v in b.items() if k != "address"} for b in blocks[:3]]
    segment = {"address": 0x100000, "blocks": tiled}
    second = 0x100000 + (2 << 20)  # the second block starts after the first block's size
    out = engine_probe.allocation_sites({"segments": [segment]}, exclude={second})
    assert out["other_bytes"] == 1_310_720 + (4 << 20)


def test_one_table_host_experts_are_read_from_the_table(monkeypatch):
    """One table can keep more experts in host rows than the cold file lists (GPU experts
    it moved there to stay within offload-02's VRAM): the probe reports the rows' experts
    by layer number, and the benchmark counts host reads against those."""
    import types

    import torch
    from eodev.bench_offload.placement import one_table_placement
    from vllm.model_executor.layers.fused_moe import routed_experts

    class Experts(torch.nn.Module):
        quant_method = object()

    monkeypatch.setattr(routed_experts, "RoutedExperts", Experts)
    m = Experts()
    m.layer_name = "model.layers.3.mlp.experts"
    m.__dict__["one_table"] = types.SimpleNamespace(
        gpu_rows=4, owners=[], row_to_expert=[0, 2, 3, 5, 7, 1, 4, 6]
    )
    out = engine_probe._expert_placement(torch.nn.ModuleList([m]))
    assert out["one_table_host_experts"] == {"3": [1, 4, 6, 7]}

    placed = {3: {1, 4, 6}, 5: {0}}
    assert one_table_placement(out, placed) == {3: {1, 4, 6, 7}, 5: {0}}
    assert one_table_placement({}, placed) == placed


def test_engines_run_on_their_gpus_numa_node(monkeypatch, tmp_path):
    """Each engine binds itself to the CPUs of its GPU's NUMA node (the PCI device's
    local_cpulist) before CUDA starts, so that engines of one group do not differ by where
    the scheduler first put them; EO_PIN_CPUS=0, a node list that sysfs cannot give, or
    one outside the allowed CPUs leave the affinity alone."""
    from eodev import nvsmi

    assert engine_probe.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    dev = tmp_path / "0000:18:00.0"
    dev.mkdir()
    (dev / "local_cpulist").write_text("0-7\n")
    monkeypatch.setattr(
        nvsmi, "query", lambda *a, **k: [["00000000:18:00.0"], ["00000000:2A:00.0"]]
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_probe.gpu_local_cpus(str(tmp_path)) == set(range(8))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # 0000:2a:00.0 has no sysfs entry here
    assert engine_probe.gpu_local_cpus(str(tmp_path)) is None

    affinity = {"now": set(range(16))}
    monkeypatch.setattr(engine_probe.os, "sched_getaffinity", lambda pid: affinity["now"])
    monkeypatch.setattr(
        engine_probe.os, "sched_setaffinity", lambda pid, cpus: affinity.update(now=set(cpus))
    )
    local = {"cpus": set(range(8))}
    monkeypatch.setattr(engine_probe, "gpu_local_cpus", lambda: local["cpus"])
    out = engine_probe.pin_to_gpu_node()
    assert out["cpus"] == list(range(8)) and out["cpus_before"] == list(range(16))

    def refuse(pid, cpus):
        raise PermissionError("Operation not permitted")

    with monkeypatch.context() as m:
        affinity["now"], local["cpus"] = set(range(16)), set(range(8))
        m.setattr(engine_probe.os, "sched_setaffinity", refuse)
        out = engine_probe.pin_to_gpu_node()
        assert out["cpus"] == list(range(16)) and "not permitted" in out["error"]

    for env, cpus in (("0", set(range(8))), ("1", None), ("1", {20, 21})):
        affinity["now"], local["cpus"] = set(range(16)), cpus
        monkeypatch.setenv("EO_PIN_CPUS", env)
        assert engine_probe.pin_to_gpu_node()["cpus"] == list(range(16))


def test_one_allocator_snapshot_gives_the_weight_blocks_and_the_sites(monkeypatch):
    """The probe takes one snapshot for the weights' blocks and the stranded free bytes
    and, with allocation history on, the sites beside the weights, and stops the history
    only then."""
    import torch

    model = torch.nn.Linear(4, 4, bias=False)
    weight = model.weight.untyped_storage().data_ptr()
    blocks = [
        {"address": weight, "size": 1024, "requested_size": 64, "state": "active_allocated"},
        {"address": weight + 1024, "size": 512, "requested_size": 100, "state": "active_allocated"},
    ]
    calls = []
    monkeypatch.setattr(
        torch.cuda.memory,
        "_snapshot",
        lambda: calls.append("snapshot") or {"segments": [{"blocks": blocks}]},
    )
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    out = engine_probe._allocator_view(model, sites=False)
    assert calls == ["snapshot"] and set(out) == {"weight_blocks", "stranded_free"}
    assert out["stranded_free"]["stranded_bytes"] == 0  # one segment, all of it live
    assert out["weight_blocks"]["other_block_bytes"] == 1024  # a weight, not a routed expert
    assert out["weight_blocks"]["other_requested_bytes"] == 64
    calls.clear()
    out = engine_probe._allocator_view(model, sites=True)
    assert calls == ["snapshot", {"enabled": None}]
    assert out["alloc_sites"]["other_bytes"] == 100


def test_census_leaves_out_the_second_address_of_an_alias_range():
    """Prefill staging maps a one-table layer's VRAM a second time (vmm.AliasRange): a
    tensor over that range is no memory of its own. An H200 census counted 30 GB of
    them on a 24-layer model whose process VRAM grew by the 0.25 GB of its slots."""
    import torch

    class AliasRange:  # the probe knows it by name, as in an engine
        def __init__(self, t):
            self.ptr, self.size = t.data_ptr(), t.untyped_storage().nbytes()
            self._base = t

    second = AliasRange(torch.zeros(4133, dtype=torch.int16))
    slot = torch.zeros(4139, dtype=torch.int16)  # real memory: still counted
    out = engine_probe.tensor_census(torch.nn.Linear(2, 2), device_type="cpu", top=1000, holders=0)
    shapes = [r["shape"] for r in out["top"]]
    assert [4139] in shapes and [4133] not in shapes
    assert out["alias_bytes"] == 4133 * 2
    del second, slot
