# SPDX-License-Identifier: Apache-2.0
"""A MoE layer with a gated shared expert (Qwen3-Next / Qwen4Exp: ``Qwen3NextSparseMoeBlock``
builds its experts with ``FusedMoEFactory(shared_experts=..., gate=...)``), split by a cold
file (offload-02) and merged into one table (offload-03), against the same layer unsplit:
the same router gate, shared expert module and routed weights, on identical input.

What the test separates:
- a plumbing defect (the shared expert run twice, never, on other input, or its output
  consumed by the wrong call): the shared expert's forward is counted and its input compared
  per layer call, and the layer output differs from the unsplit one by about the shared
  expert's own output, which the test makes far larger than the bound;
- near-ties: on the BF16 (Triton) path the split layer must equal the unsplit layer bit for
  bit; on Marlin (INT4) the difference must stay within half a BF16 step at the output scale,
  the bound of tests/gpu/test_expert_map_kernels.py (Marlin's fp32 K-split partial sums
  depend on the problem size of each call).

Tokens 1, 7 and 64 run the shared expert on vLLM's aux stream (MULTI_STREAM_OVERLAPPED, at
most VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD = 256 tokens), 600 on the main stream before
the routed experts (NO_OVERLAP); the order each call took is logged and both must occur.

    PYTHONPATH=scripts:$EO_VLLM_PATCHED:$EO_VLLM_SITE python3 -m pytest \\
        tests/gpu/test_shared_expert_split.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch
from eodev import gpu_harness as gh
from test_expert_map_kernels import H, _checkpoint, _forget_layers, _load_runner, _process

pytestmark = pytest.mark.gpu

SHARED_N = 512  # the shared expert's width (Qwen4Exp test models: a few times N / top_k)
TOKENS = (1, 7, 64, 600)


@pytest.fixture(scope="module")
def vllm_context():
    from eodev.vllm_context import single_process_vllm
    from vllm.v1.worker.workspace import init_workspace_manager

    with single_process_vllm("nccl") as config:
        init_workspace_manager(torch.device("cuda"))
        # each MoE call finds its layer by name, not by call order in the forward context
        # (the test calls two layers, each in a forward context of its own)
        config.compilation_config.fast_moe_cold_start = False
        yield config


@pytest.fixture(autouse=True)
def _fresh_layers(vllm_context):
    yield
    _forget_layers()


class SharedExpert(torch.nn.Module):
    """The model's shared expert (Qwen3NextMLP = Qwen2MoeMLP with ``expert_gate``), BF16,
    random weights; counts its calls and keeps each call's input."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import ReplicatedLinear
        from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

        g = torch.Generator().manual_seed(seed)
        self.gate = ReplicatedLinear(H, 1, bias=False, prefix="model.layers.0.mlp.shared_gate")
        self.mlp = Qwen2MoeMLP(
            hidden_size=H,
            intermediate_size=SHARED_N,
            hidden_act="silu",
            quant_config=None,
            reduce_results=False,
            expert_gate=self.gate,
            prefix="model.layers.0.mlp.shared_expert",
        )
        for p in self.parameters():
            # large enough that a missing or doubled shared output dwarfs the bound
            p.data.copy_(torch.randn(p.shape, generator=g, device="cpu") * 2 / p.shape[-1] ** 0.5)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return self.mlp(x)


def _runner(layer, num_experts, top_k, quant, weights, cold_ids, tmp_path, shared, gate):
    """A MoE layer as Qwen3NextSparseMoeBlock builds it (router gate in the runner, gated
    shared expert, renormalised top-k), split by ``cold_ids`` if given, loaded and
    processed."""
    runner = _load_runner(
        num_experts,
        top_k,
        quant,
        weights,
        cold_ids,
        tmp_path,
        layer,
        renormalize=True,
        shared_experts=shared,
        gate=gate,
    )
    _process(runner.routed_experts)
    return runner


def _merge(runner) -> None:
    """offload-03 as placement._merge_into_one_table does it (VMM ranges, host rows)."""
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table, vmm

    module = runner.routed_experts
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    module.__dict__["one_table"] = one_table.merge(
        module, one_table.vmm_allocator, vmm.granularity(device)
    )


def _forward(config, runner, x):
    from vllm.forward_context import set_forward_context

    with torch.inference_mode(), set_forward_context(None, config, num_tokens=x.shape[0]):
        out = runner(x, x)  # Qwen3NextSparseMoeBlock: router_logits=hidden_states
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("mode", ["split", "one_table"])
@pytest.mark.parametrize("quant,num_experts,top_k", [("int4", 64, 4), ("bf16", 64, 4)])
def test_split_layer_with_shared_expert_equals_full_layer(
    vllm_context, tmp_path, mode, quant, num_experts, top_k
):
    from vllm.model_executor.layers.fused_moe.expert_offload.split import SplitRoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
    from vllm.model_executor.layers.linear import ReplicatedLinear

    weights = _checkpoint(num_experts, quant)
    with torch.device("cuda"):
        shared = SharedExpert(seed=3).to(torch.bfloat16)
        gate = ReplicatedLinear(
            H, num_experts, bias=False, quant_config=None, prefix="model.layers.0.mlp.gate"
        ).to(torch.bfloat16)
    gate.weight.data.copy_(torch.randn(num_experts, H, device="cuda") / H**0.5)
    g = torch.Generator().manual_seed(1)
    cold = torch.randperm(num_experts, generator=g, device="cpu")[
        : num_experts // 4
    ].tolist()  # 16 of 64
    full = _runner(1, num_experts, top_k, quant, weights, None, tmp_path, shared, gate)
    split = _runner(2, num_experts, top_k, quant, weights, cold, tmp_path, shared, gate)
    assert isinstance(split.routed_experts, SplitRoutedExperts)
    if mode == "one_table":
        _merge(split)
        assert "one_table" in split.routed_experts.__dict__
    assert full.shared_experts is not None and split.shared_experts is not None

    calls: list[str] = []
    for runner, name in ((full, "full"), (split, mode)):
        inner = runner.routed_experts.forward_modular
        runner.routed_experts.forward_modular = lambda *a, _inner=inner, _name=name, **k: (
            calls.append(_name) or _inner(*a, **k)
        )

    orders = set()
    for tokens in TOKENS:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        order = split.shared_experts._determine_shared_experts_order(x)
        assert order != SharedExpertsOrder.MK_INTERNAL_OVERLAPPED  # no all2all on one GPU
        orders.add(order)

        shared.inputs.clear()
        calls.clear()
        ref = _forward(vllm_context, full, x)
        assert len(shared.inputs) == 1
        shared.inputs.clear()
        out = _forward(vllm_context, split, x)
        assert calls == ["full", mode]  # each layer ran its own routed experts
        # the shared expert ran once, on the layer's input
        assert len(shared.inputs) == 1, f"shared expert ran {len(shared.inputs)} times"
        assert torch.equal(shared.inputs[0], x)
        with torch.inference_mode():
            shared_out = shared(x).float()
        shared.inputs.clear()

        scale = ref.abs().max().item()
        bound = scale * 2**-8
        diff = (out.float() - ref.float()).abs().max().item()
        # the test can tell a missing or doubled shared expert from rounding
        assert shared_out.abs().max().item() > 16 * bound
        gh.log(
            f"{quant} {mode} tokens={tokens} {order.name}: max|split - full| {diff:.3g}, "
            f"max|out| {scale:.3g}, max|shared| {shared_out.abs().max().item():.3g}"
        )
        if quant == "bf16":
            assert torch.equal(out, ref), f"{mode} differs from the full layer by {diff:.3g}"
        else:
            assert diff <= bound, f"{mode} differs from the full layer by {diff:.3g}"
    assert orders == {
        SharedExpertsOrder.MULTI_STREAM_OVERLAPPED,
        SharedExpertsOrder.NO_OVERLAP,
    }, f"shared expert orders seen: {orders}"
