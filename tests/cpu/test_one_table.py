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
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table, processing

    runner, setups = loaded
    module = runner.routed_experts
    events = []
    monkeypatch.setenv("VLLM_EXPERT_SWAP", "0")
    monkeypatch.setattr(processing, "_one_table_refusal", lambda index: None)
    monkeypatch.setattr(processing, "records", {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty the pool"))

    def allocate(rows, gpu_rows, row_shape, dtype, device):  # VRAM played by the CPU
        events.append("allocate")
        owner = one_table.VramRows(torch.empty((rows, *row_shape), dtype=dtype))
        return owner.table, owner

    monkeypatch.setattr(one_table, "vmm_allocator", allocate)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    nbytes += sum(
        p.numel() * p.element_size() for p in module.host_experts.parameters(recurse=False)
    )
    processing._merge_into_one_table(module, torch.device("cuda", 0))

    assert events[0] == "empty the pool" and events.count("empty the pool") == 1
    assert events.count("allocate") >= 2 and setups  # merged: w13 and w2 at least
    assert "one_table" in module.__dict__
    record = processing.records[module.layer_name]
    assert record.path == "one table (VLLM_EXPERT_ONE_TABLE)"
    assert (record.gpu_bytes, record.host_bytes) == (nbytes, 0)
