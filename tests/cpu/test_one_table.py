# SPDX-License-Identifier: Apache-2.0
"""offload-03's merge on the CPU: a split layer's two tables become one table per tensor
(GPU experts first, then host experts), the router stays untouched and its expert ids are
mapped to table rows in the layer's forward, parameter names stay upstream's, and a refused
allocation changes nothing.
The VMM range itself and the kernel setup on merged tensors run on a GPU
(tests/gpu/test_vmm_gpu.py; the engine tests).

    scripts/test tests/cpu/test_one_table.py
"""

from __future__ import annotations

import pytest
import torch
from test_offload_layers import HIDDEN, WIDTH, E, K, build, checkpoint, cold_file

COLD = [0, 7, 8, 13]


@pytest.fixture
def loaded(vllm_cpu, tmp_path, monkeypatch):
    """A loaded split layer (layer 2, COLD on host) with a BF16 router gate, and a kernel
    setup that records what it was given (the CPU has no MoE kernels to set up)."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: COLD}))
    list(runner.load_weights(iter(checkpoint())))
    g = torch.Generator().manual_seed(0)
    runner.gate = torch.nn.Linear(HIDDEN, E, bias=False)
    runner.gate.weight.data = torch.randn(E, HIDDEN, generator=g).bfloat16()
    setups = []

    def record(module):
        setups.append({n: p.data for n, p in module.named_parameters(recurse=False)})
        module.quant_method.moe_quant_config = "set up on the merged tensors"

    monkeypatch.setitem(one_table.KERNEL_SETUP, "UnquantizedFusedMoEMethod", record)
    return runner, setups


def test_one_table_holds_gpu_experts_then_host_experts(loaded):
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    runner, setups = loaded
    module = runner.routed_experts
    names = [n for n, _ in runner.named_parameters()]
    table = one_table.merge(module, one_table.cpu_allocator)

    order = [e for e in range(E) if e not in COLD] + COLD
    assert table.row_to_expert == order
    assert (table.gpu_rows, table.host_rows) == (E - len(COLD), len(COLD))
    # checkpoint() fills every value of expert e with e: row r holds expert order[r]
    assert module.w13_weight[:, 0, 0].tolist() == order
    assert module.w13_weight[:, WIDTH, 0].tolist() == order  # up_proj half
    assert module.w2_weight[:, 0, 0].tolist() == order
    # one table: every expert local, no expert map, names exactly as before
    assert module.local_num_experts == E and module.expert_map is None
    assert module.moe_config.num_local_experts == E
    assert [n for n, _ in runner.named_parameters()] == names
    # the host table let go of its rows; the kernel was set up once, on the merged tensors
    assert all(p.numel() == 0 for p in module.host_experts.parameters())
    assert len(setups) == 1
    assert setups[0]["w13_weight"].data_ptr() == module.w13_weight.data_ptr()
    assert module.quant_method.moe_quant_config == "set up on the merged tensors"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_router_is_untouched_and_its_picks_go_to_their_experts_rows(loaded, monkeypatch, dtype):
    """The gate keeps expert order (a permuted gate would break BF16 ties differently
    from the unpatched router); the layer's forward hands the kernel the rows that hold
    the picked experts."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    runner, _ = loaded
    module = runner.routed_experts
    gate = runner.gate.weight.data.clone()
    table = one_table.merge(module, one_table.cpu_allocator)
    module.__dict__["one_table"] = table
    assert torch.equal(runner.gate.weight.data, gate)

    seen = []
    monkeypatch.setattr(
        RoutedExperts,
        "forward_modular",
        lambda self, x, w, ids, *a, **k: seen.append(ids) or x,
    )
    picks = torch.tensor([[0, 7, 1, 13], [8, 2, 12, 15]], dtype=dtype)
    module.forward_modular(torch.zeros(2, HIDDEN), torch.full((2, K), 0.25), picks)
    [rows] = seen
    assert rows.dtype == dtype and rows.shape == picks.shape
    assert torch.equal(torch.tensor(table.row_to_expert)[rows.long()], picks.long())
    # the host experts are the last rows, the GPU experts keep their order in front
    assert rows.tolist() == [[12, 13, 0, 15], [14, 1, 9, 11]]
    # checkpoint() fills every value of expert e with e: the rows hold the picked experts
    assert module.w2_weight[rows.flatten().long(), 0, 0].tolist() == picks.flatten().tolist()
    # ids that are no expert (the profiling run routes uninitialised activations) pass
    # through as the unpatched kernel would see them, instead of failing a gather
    odd = torch.tensor([[-1, E, 3, E + 7]], dtype=dtype)
    assert table.rows_of(odd).tolist() == [[-1, E, 2, E + 7]]


def test_a_refused_allocation_changes_nothing(loaded):
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    runner, setups = loaded
    module = runner.routed_experts
    before = {n: p.data.clone() for n, p in module.named_parameters(recurse=False)}
    gate = runner.gate.weight.data.clone()
    closed = []

    class Range:
        def close(self):
            closed.append(self)

    calls = []

    def allocate(rows, gpu_rows, row_shape, dtype, device):
        calls.append(row_shape)
        if len(calls) == 2:
            raise RuntimeError("cuMemCreate[host] refused (injected)")
        return torch.empty((rows, *row_shape), dtype=dtype), Range()

    with pytest.raises(RuntimeError, match="injected"):
        one_table.merge(module, allocate)
    assert len(closed) == 1  # the first table's range was released
    for n, p in module.named_parameters(recurse=False):
        assert torch.equal(p.data, before[n])
    assert torch.equal(runner.gate.weight.data, gate)
    assert module.expert_map is not None and not setups  # still offload-02's two tables


def test_an_unknown_quantisation_method_is_refused_before_any_change(loaded, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table
    from vllm.model_executor.layers.fused_moe.expert_offload.config import (
        ExpertOffloadError,
    )

    runner, _ = loaded
    monkeypatch.delitem(one_table.KERNEL_SETUP, "UnquantizedFusedMoEMethod")
    w13 = runner.routed_experts.w13_weight.data_ptr()
    with pytest.raises(ExpertOffloadError, match="UnquantizedFusedMoEMethod"):
        one_table.merge(runner.routed_experts, one_table.cpu_allocator)
    assert runner.routed_experts.w13_weight.data_ptr() == w13


def test_each_merge_gives_torchs_free_blocks_back_before_it_allocates(loaded, monkeypatch):
    """The VMM ranges come from the driver, not from torch's pool: a merge first empties
    the pool, so that the previous layer's replaced tables, freed into it, can back this
    layer's range. Without that, a GPU that the model nearly fills ran out of VRAM half
    way through the layers (five 16-layer engines on one H200: 5 of 16 layers fell back
    to two tables). The layer's record counts a tensor kept whole in VRAM as VRAM."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table, placement, vmm

    runner, setups = loaded
    module = runner.routed_experts
    events = []
    monkeypatch.setenv("VLLM_EXPERT_SWAP", "0")
    monkeypatch.setattr(placement, "_one_table_refusal", lambda index: None)
    monkeypatch.setattr(placement, "records", {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty the pool"))

    def allocate(rows, gpu_rows, row_shape, dtype, device):  # VRAM played by the CPU
        events.append("allocate")
        owner = one_table.VramRows(torch.empty((rows, *row_shape), dtype=dtype))
        return owner.table, owner

    monkeypatch.setattr(one_table, "vmm_allocator", allocate)
    monkeypatch.setattr(vmm, "granularity", lambda device: 2 << 20)  # no row moves here
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    nbytes += sum(
        p.numel() * p.element_size() for p in module.host_experts.parameters(recurse=False)
    )
    placement._merge_into_one_table(module, torch.device("cuda", 0))

    assert events[0] == "empty the pool" and events.count("empty the pool") == 1
    assert events.count("allocate") >= 2 and setups  # merged: w13 and w2 at least
    assert "one_table" in module.__dict__
    record = placement.records[module.layer_name]
    assert record.path == "one table (VLLM_EXPERT_ONE_TABLE)"
    assert (record.gpu_bytes, record.host_bytes) == (nbytes, 0)
    assert (record.host_experts, record.moved_to_host) == (len(COLD), 0)


def test_gpu_rows_within_keeps_one_tables_vram_within_offload_02s():
    """Each tensor's VRAM part is rounded up to the granularity so that no GPU row has
    bytes in host memory; the layer then gives up its last GPU rows until its VRAM is no
    more than the GPU rows' own bytes (what offload-02's table holds). The reference
    geometry (INT4 Marlin, 512 experts, w13/w2 weights and scales): 2 of 461 GPU
    experts at 10% host, where the rounding took 5.8 MiB per layer (on an H200: 108 MB
    over 16 layers)."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    gran = 2 << 20
    row_bytes = [1_638_400, 819_200, 51_200, 25_600]

    def vram(g: int) -> int:
        return sum(one_table._vram_part(512, g, b, gran) for b in row_bytes)

    assert vram(461) - 461 * sum(row_bytes) == 6_046_720  # 5.77 MiB over, per layer
    for host, kept in {51: 459, 26: 485, 102: 409, 205: 305}.items():
        g = 512 - host
        assert one_table.gpu_rows_within(row_bytes, 512, g, gran) == kept
        assert vram(kept) <= g * sum(row_bytes) < vram(kept + 1)
    # rows that fill whole granules: nothing to give up
    assert one_table.gpu_rows_within([gran, gran // 2], 64, 60, gran) == 60
    # all rows on the GPU or none: nothing to give up either
    assert one_table.gpu_rows_within(row_bytes, 512, 512, gran) == 512
    assert one_table.gpu_rows_within(row_bytes, 512, 0, gran) == 0
    # tensors far below a granule (a tiny test model): at most a tenth of the rows
    # would move, which is not enough, so none does and the rounding is the cost
    assert one_table.gpu_rows_within([8192, 4096], 16, 12, gran) == 12


def test_merge_moves_the_highest_id_gpu_experts_into_host_rows(loaded):
    """With the VMM granularity, merge gives the allocator fewer VRAM rows and reports
    the GPU experts it moved; rows keep their order (GPU experts ascending, then the
    cold file's), so the moved experts are the first host rows and their weights are
    unchanged."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    runner, _ = loaded
    module = runner.routed_experts
    asked = []

    def allocate(rows, gpu_rows, row_shape, dtype, device):
        asked.append(gpu_rows)
        return one_table.cpu_allocator(rows, gpu_rows, row_shape, dtype, device)

    row_bytes = [
        p.element_size() * p[0].numel()
        for p in (module.w13_weight, module.w2_weight, module.host_experts.w13_weight)
    ][:2]
    gran = 5120
    rounded = [-(-11 * b // gran) * gran for b in row_bytes]
    assert sum(rounded) <= 12 * sum(row_bytes) < sum(-(-12 * b // gran) * gran for b in row_bytes)

    table = one_table.merge(module, allocate, granularity=gran)

    gpu = [e for e in range(E) if e not in COLD]
    assert table.row_to_expert == gpu + COLD
    assert (table.gpu_rows, table.host_rows, table.moved_to_host) == (11, len(COLD) + 1, 1)
    assert asked == [11, 11]
    assert table.row_to_expert[table.gpu_rows] == max(gpu)
    assert module.w13_weight[:, 0, 0].tolist() == gpu + COLD  # values = expert id


def test_a_refused_or_failed_merge_is_named_in_the_start_up_line(loaded, monkeypatch):
    """A layer asked to be one table that keeps two tables (the host-mapping probe refused,
    or its merge failed) runs as offload-02; the start-up line that says which path is
    active counts those layers apart and says why, once per reason."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table, placement, vmm

    runner, _ = loaded
    module = runner.routed_experts
    monkeypatch.setattr(placement, "records", {})
    split = "split experts (VLLM_EXPERT_COLD_FILE)"
    placement.records[module.layer_name] = placement.LayerRecord(split, E, 3, 30, 90)
    monkeypatch.setattr(
        placement, "_one_table_refusal", lambda index: "the host-mapping probe failed: refused"
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    placement._merge_into_one_table(module, torch.device("cuda", 0))
    assert "one_table" not in module.__dict__
    assert placement.records[module.layer_name].fallback.startswith("the host-mapping probe")

    def refuse(*args, **kwargs):
        raise vmm.VmmError("cuMemCreate[host] failed with an injected error")

    monkeypatch.setattr(placement, "_one_table_refusal", lambda index: None)
    monkeypatch.setattr(one_table, "merge", refuse)
    monkeypatch.setattr(vmm, "granularity", lambda device: 2 << 20)
    other = placement.LayerRecord(split, E, 3, 30, 90)
    placement.records["other"] = other
    module.layer_name, name = "other", module.layer_name
    try:
        placement._merge_into_one_table(module, torch.device("cuda", 0))
    finally:
        module.layer_name = name
    assert other.fallback == "cuMemCreate[host] failed with an injected error"

    records = list(placement.records.values())
    merged = placement.LayerRecord("one table (VLLM_EXPERT_ONE_TABLE)", E, 3, 30, 90)
    line = placement._active_paths([*records, merged, merged])
    assert line.count(";") == 2  # three groups: two reasons, and the merged layers
    assert "one table (VLLM_EXPERT_ONE_TABLE) in 2 layers" in line
    assert (
        "split experts (VLLM_EXPERT_COLD_FILE), as the driver or the merge refused one "
        "table: the host-mapping probe failed: refused in 1 layers"
    ) in line
    assert "cuMemCreate[host] failed with an injected error in 1 layers" in line
    # one path, no fallback: the line as before
    assert placement._active_paths([merged]) == "one table (VLLM_EXPERT_ONE_TABLE)"
