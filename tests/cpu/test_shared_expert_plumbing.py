# SPDX-License-Identifier: Apache-2.0
"""A MoE layer with a shared expert (Qwen3-Next / Qwen4Exp build theirs with
``FusedMoEFactory(shared_experts=..., gate=...)``), split by a cold file (offload-02) and
merged into one table (offload-03), against the same layer unsplit, on the CPU.

Everything is the patched vLLM's own code - the MoERunner with its gate and SharedExperts, the
modular kernel with its prepare/finalize, the split forward with its top-k reduction hooks, the
one-table row map - except the expert GEMMs, which the CPU build lacks: ``TorchExperts`` computes
each (token, slot) in torch and reduces through ``moe_sum`` as Marlin and Triton do, and the
router's top-k softmax and ``moe_sum`` get torch stand-ins. With per-slot GEMMs independent of
the batch (as Triton's are), the split layer must equal the unsplit one bit for bit, and the
shared expert must run once per layer call, on the layer's input, in each order vLLM can pick
for it: before the routed experts (NO_OVERLAP: one GPU without expert parallelism, and the
CPU), or inside the modular kernel's finalize (MK_INTERNAL_OVERLAPPED: a prepare/finalize
that supports async, i.e. an all2all backend). The aux-stream order needs CUDA
(tests/gpu/test_shared_expert_split.py).

    scripts/test tests/cpu/test_shared_expert_plumbing.py
"""

from __future__ import annotations

import os

import pytest
import torch
from test_offload_layers import HIDDEN, WIDTH, E, K, cold_file

COLD = [0, 7, 8, 13]


@pytest.fixture
def torch_kernels(vllm_cpu, monkeypatch):
    """Torch stand-ins for the CUDA-only ops the MoE forward calls on the CPU, and the
    modular kernels' workspace on the CPU."""
    import vllm._custom_ops as ops
    from vllm.v1.worker import workspace

    def topk_softmax(weights, ids, _indices, logits, renormalize=False, *args, **kwargs):
        p, i = torch.softmax(logits.float(), -1).topk(weights.shape[1], dim=-1)
        if renormalize:
            p = p / p.sum(-1, keepdim=True)
        weights.copy_(p)
        ids.copy_(i)

    def moe_sum(input, output, *args):
        output.copy_(input.float().sum(1).to(output.dtype))

    monkeypatch.setattr(ops, "topk_softmax", topk_softmax)
    monkeypatch.setattr(ops, "moe_sum", moe_sum)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(workspace, "_manager", None)
    workspace.init_workspace_manager(torch.device("cpu"))
    yield


def torch_experts_class():
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    class TorchExperts(TritonExperts):
        """Triton's expert kernel class with the GEMMs in torch: per (token, slot), the
        weighted expert output, zeros where the expert map says -1; then ``moe_sum``."""

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kw):
            expert_map = kw.get("expert_map", args[2] if len(args) > 2 else None)
            rows = topk_ids.long()
            if expert_map is not None:
                rows = expert_map[rows].long()
            slots = torch.zeros(*topk_ids.shape, hidden_states.shape[1], dtype=output.dtype)
            for t, s in ((t, s) for t in range(rows.shape[0]) for s in range(rows.shape[1])):
                r = int(rows[t, s])
                if r < 0:
                    continue
                gate, up = (w1[r].float() @ hidden_states[t].float()).chunk(2)
                act = torch.nn.functional.silu(gate) * up
                slots[t, s] = (topk_weights[t, s] * (w2[r].float() @ act)).to(output.dtype)
            self.moe_sum(slots, output)

    return TorchExperts


def async_prepare_finalize_class():
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )

    class AsyncNoEP(MoEPrepareAndFinalizeNoDPEPModular):
        """The no-EP prepare/finalize made asynchronous, as all2all backends are: the
        modular kernel then runs the shared expert inside its finalize."""

        def supports_async(self) -> bool:
            return True

        def prepare_async(self, *args, **kwargs):
            return lambda: self.prepare(*args, **kwargs)

        def finalize_async(self, *args, **kwargs):
            return lambda: self.finalize(*args, **kwargs)

    return AsyncNoEP


def set_kernel(module, async_finalize: bool) -> None:
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )

    pf = async_prepare_finalize_class() if async_finalize else MoEPrepareAndFinalizeNoDPEPModular
    experts = torch_experts_class()(module.moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)
    module.quant_method.moe_kernel = mk.FusedMoEKernel(pf(), experts)
    module.quant_method.moe_quant_config = FUSED_MOE_UNQUANTIZED_CONFIG


class Shared(torch.nn.Module):
    """A gated shared expert (Qwen3NextMLP's shape: sigmoid(gate(x)) * mlp(x)) that
    records each call's input."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.up = torch.nn.Parameter((torch.randn(WIDTH, HIDDEN, generator=g) / 8).bfloat16())
        self.down = torch.nn.Parameter((torch.randn(HIDDEN, WIDTH, generator=g) / 4).bfloat16())
        self.gate = torch.nn.Parameter((torch.randn(1, HIDDEN, generator=g) / 8).bfloat16())
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        out = torch.nn.functional.silu(x @ self.up.T) @ self.down.T
        return torch.sigmoid(x @ self.gate.T) * out


class Gate(torch.nn.Linear):
    """The router gate as vLLM's ReplicatedLinear returns it: (logits, bias)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


def checkpoint() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for e in range(E):
        for proj, shape in (
            ("gate_proj", (WIDTH, HIDDEN)),
            ("up_proj", (WIDTH, HIDDEN)),
            ("down_proj", (HIDDEN, WIDTH)),
        ):
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
            out.append((f"{e}.{proj}.weight", w.bfloat16()))
    return out


def layer(tmp_path, index, cold, shared, gate, async_finalize, one_table=False):
    """MoE layer ``index`` as Qwen3NextSparseMoeBlock builds it, loaded, with torch
    kernels; split by ``cold`` if given, and merged into one table if asked."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table as ot
    from vllm.model_executor.layers.fused_moe.expert_offload import planner
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    prefix = f"model.layers.{index}.mlp.experts"
    get_current_vllm_config().compilation_config.static_forward_context.pop(prefix, None)
    os.environ.pop("VLLM_EXPERT_COLD_FILE", None)
    if cold:
        os.environ["VLLM_EXPERT_COLD_FILE"] = cold_file(tmp_path, {index: cold})
    planner.reset_planner()
    try:
        runner = FusedMoEFactory(
            num_experts=E,
            top_k=K,
            hidden_size=HIDDEN,
            intermediate_size=WIDTH,
            params_dtype=torch.bfloat16,
            renormalize=True,
            prefix=prefix,
            shared_experts=shared,
            gate=gate,
        )
    finally:
        os.environ.pop("VLLM_EXPERT_COLD_FILE", None)
        planner.reset_planner()
    list(runner.load_weights(iter(checkpoint())))
    module = runner.routed_experts
    set_kernel(module, async_finalize)
    if cold:
        set_kernel(module.host_experts, async_finalize)
        module.place_row_mask(torch.device("cpu"))
    if one_table:
        setup = lambda m: set_kernel(m, async_finalize)  # noqa: E731
        ot.KERNEL_SETUP["UnquantizedFusedMoEMethod"] = setup
        module.__dict__["one_table"] = ot.merge(module, ot.cpu_allocator)
    return runner


@pytest.fixture
def restore_kernel_setup():
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    saved = dict(one_table.KERNEL_SETUP)
    yield
    one_table.KERNEL_SETUP.clear()
    one_table.KERNEL_SETUP.update(saved)


@pytest.mark.parametrize("async_finalize", [False, True], ids=["no-overlap", "mk-internal"])
@pytest.mark.parametrize("mode", ["split", "one_table"])
def test_shared_expert_runs_once_and_the_split_layer_equals_the_full_layer(
    vllm_cpu, torch_kernels, restore_kernel_setup, tmp_path, mode, async_finalize
):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.expert_offload.split import SplitRoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    shared = Shared()
    gate = Gate(HIDDEN, E, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(gate.weight, std=HIDDEN**-0.5, generator=torch.Generator().manual_seed(2))
    full = layer(tmp_path, 1, None, shared, gate, async_finalize)
    split = layer(tmp_path, 2, COLD, shared, gate, async_finalize, mode == "one_table")
    assert isinstance(split.routed_experts, SplitRoutedExperts)
    assert ("one_table" in split.routed_experts.__dict__) == (mode == "one_table")

    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    expected = (
        SharedExpertsOrder.MK_INTERNAL_OVERLAPPED
        if async_finalize
        else SharedExpertsOrder.NO_OVERLAP
    )
    assert split.shared_experts._determine_shared_experts_order(x) == expected
    assert full.shared_experts._determine_shared_experts_order(x) == expected

    with torch.inference_mode(), set_forward_context(None, vllm_cpu, num_tokens=x.shape[0]):
        ref = full(x, x)
        assert len(shared.inputs) == 1
        shared.inputs.clear()
        out = split(x, x)
        assert len(shared.inputs) == 1, f"the shared expert ran {len(shared.inputs)} times"
        assert torch.equal(shared.inputs[0], x)
        shared_out = shared(x)
        # the routed experts' part and the shared expert's: what a dropped, doubled or
        # misplaced shared output would change
        routed = ref.float() - shared_out.float()
    assert shared_out.abs().max() > 0.1 and routed.abs().max() > 0.1
    picks = torch.softmax(gate(x)[0].float(), -1).topk(K, dim=-1).indices
    assert torch.isin(picks, torch.tensor(COLD)).any()  # some picks read host experts
    assert not torch.isin(picks, torch.tensor(COLD)).all()  # and some GPU experts
    assert torch.equal(out, ref), f"max |split - full| {(out.float() - ref.float()).abs().max()}"
