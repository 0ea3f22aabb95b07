# SPDX-License-Identifier: Apache-2.0
"""Prefill staging of one-table layers (offload-03, VLLM_EXPERT_PREFILL_STAGING=1) on the GPU,
at the layer: two split layers merged into one table each, as vLLM's loader makes them. A
prefill-sized call runs the same kernel on a second VMM range per weight (the table's VRAM,
then a VRAM slot holding a copy of the host rows), so its output must be the unstaged call's
bit for bit (where the kernel itself repeats bit for bit; else within its own run-to-run
difference), on Marlin (INT4) and Triton (BF16), layer after layer and again when the slots
already hold the layers. Rows that change in host memory (what a swap does) are read stale
from a slot until a swap decision says so, then copied again.

    PYTHONPATH=scripts:$EO_VLLM_PATCHED:$EO_VLLM_SITE python3 -m pytest \\
        tests/gpu/test_prefill_staging_one_table_gpu.py -m gpu -s
"""

from __future__ import annotations

import types

import pytest
import torch
from eodev import gpu_harness as gh
from test_expert_map_kernels import H, _checkpoint, _forget_layers, _forward, _load, _process

pytestmark = pytest.mark.gpu

MIN_TOKENS = 256


@pytest.fixture(scope="module")
def vllm_context():
    from eodev.vllm_context import single_process_vllm
    from vllm.v1.worker.workspace import init_workspace_manager

    with single_process_vllm("nccl") as config:
        init_workspace_manager(torch.device("cuda"))
        yield config


@pytest.fixture(autouse=True)
def _fresh_layers(vllm_context):
    from vllm.model_executor.layers.fused_moe.expert_offload import prefill_staging, swap_runtime

    # the runtime swap refuses layers merged after its first forward: each case starts
    # with none (on an H200 the BF16 case met the INT4 case's runtime)
    swap_runtime.reset_runtime()
    prefill_staging.reset()
    yield
    _forget_layers()
    swap_runtime.reset_runtime()
    prefill_staging.reset()


def _same(out, ref, own: float) -> bool:
    """The staged output is the unstaged one: bit for bit where the kernel repeats itself
    bit for bit, else within its own run-to-run difference or half a BF16 step at the
    output's scale (a stale or half-copied row is off by the output's own size)."""
    if own == 0:
        return torch.equal(out, ref)
    diff = (out.float() - ref.float()).abs().max().item()
    return diff <= max(own, ref.abs().max().item() * 2**-8)


def _where(out, ref, ids, module) -> str:
    """Which tokens differ, and how many host rows each picked (the rows staging copies)."""
    bad = (out != ref).any(dim=-1).nonzero().flatten().tolist()
    if not bad:
        return "identical"
    table = module.__dict__["one_table"]
    rows = table.expert_to_row[ids[bad[:8]].long()]
    host = (rows >= table.gpu_rows).sum(-1).tolist()
    return f"{len(bad)} tokens differ, the first {bad[:8]}, host picks each {host}"


def _unstaged(config, module, x, w, ids):
    staging = module.__dict__.pop("prefill_staging")
    try:
        return _forward(config, module, x, w, ids)
    finally:
        module.__dict__["prefill_staging"] = staging


@pytest.mark.parametrize("quant,num_experts,top_k", [("int4", 512, 10), ("bf16", 128, 8)])
def test_staged_one_table_layers_give_the_unstaged_bits(
    vllm_context, tmp_path, monkeypatch, quant, num_experts, top_k
):
    from vllm.model_executor.layers.fused_moe.expert_offload import (
        prefill_staging,
        swap_runtime,
    )

    monkeypatch.setenv("VLLM_EXPERT_ONE_TABLE", "1")
    monkeypatch.setenv("VLLM_EXPERT_PREFILL_STAGING", "1")
    monkeypatch.setenv("VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS", str(MIN_TOKENS))
    prefill_staging.reset()
    weights = _checkpoint(num_experts, quant)
    g = torch.Generator().manual_seed(1)
    cold = torch.randperm(num_experts, generator=g)[: num_experts // 8].tolist()
    layers = []
    for layer in (1, 2):
        module = _load(num_experts, top_k, quant, weights, cold, tmp_path, layer)
        _process(module)
        assert "one_table" in module.__dict__, "the layer was not merged into one table"
        assert "prefill_staging" in module.__dict__, "the one-table layer is not staged"
        layers.append(module)
    staging = prefill_staging._one_table_staging
    assert staging.order == [m.layer_name for m in layers]
    gh.log(
        f"{quant}: {len(layers)} one-table layers staged, 2 x {staging.slot_bytes / 2**20:.1f} "
        f"MiB of slots; host rows per layer {layers[0].__dict__['one_table'].host_rows}"
    )

    def inputs(tokens: int, seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
        w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        return x, (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)

    for rnd in range(2):  # the second time the slots already hold the layers
        for tokens in (16, MIN_TOKENS, 1024):
            x, w, ids = inputs(tokens, 10 * rnd + tokens)
            for module in layers:
                before = staging.copies
                ref = _unstaged(vllm_context, module, x, w, ids)
                out = _forward(vllm_context, module, x, w, ids)
                again = _unstaged(vllm_context, module, x, w, ids)
                torch.cuda.synchronize()
                diff = (out.float() - ref.float()).abs().max().item()
                # the kernel's own run-to-run difference on the same rows, if any
                own = (again.float() - ref.float()).abs().max().item()
                gh.log(
                    f"{quant} round {rnd} tokens={tokens} {module.layer_name}: staged vs "
                    f"unstaged max|diff| {diff:.3g} ({_where(out, ref, ids, module)}); "
                    f"unstaged twice {own:.3g}; copies {staging.copies - before}"
                )
                assert _same(out, ref, own), (
                    f"staged differs by {diff:.3g}, the kernel from itself by {own:.3g}"
                )
                if tokens < MIN_TOKENS:
                    assert staging.copies == before  # decode-sized: not staged
    assert staging.copies >= 2

    # rows that move in host memory, as a swap moves them: stale until a decision says so
    module = layers[0]
    table = module.__dict__["one_table"]
    # the last row: in every weight's host part (the first host rows may share a granule
    # with the VRAM part), written from the first row, a GPU expert's
    last = len(table.row_to_expert) - 1
    with torch.inference_mode():
        for name in ("w13_weight", "w2_weight"):
            t = getattr(module, name)
            t[last].copy_(t[0])
    torch.cuda.synchronize()
    expert = table.row_to_expert[last]
    x, w, ids = inputs(1024, 99)
    ids[:, 0] = expert  # every token reads the changed row
    ref = _unstaged(vllm_context, module, x, w, ids)
    own = (_unstaged(vllm_context, module, x, w, ids).float() - ref.float()).abs().max().item()
    stale = _forward(vllm_context, module, x, w, ids)
    torch.cuda.synchronize()
    assert not _same(stale, ref, own), "the slot did not hold the old row"
    runtime = types.SimpleNamespace(decisions=1)
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: runtime)
    fresh = _forward(vllm_context, module, x, w, ids)
    torch.cuda.synchronize()
    assert _same(fresh, ref, own), "a swap decision did not make staging copy again"
    prefill_staging.reset()
