# SPDX-License-Identifier: Apache-2.0
"""What vLLM 0.29.0's MoE kernels do with expert ids that map to -1, and that a split layer
(offload-02: GPU table + host table, each with -1 for the other's experts) computes what
the unsplit layer computes (bit for bit on the Triton path). Marlin (GPTQ INT4) and the
unquantised (BF16, Triton) path.

    PYTHONPATH=scripts:$EO_VLLM_PATCHED:$EO_VLLM_SITE python3 -m pytest \\
        tests/gpu/test_expert_map_kernels.py -m gpu -s
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
from eodev import gpu_harness as gh
from eodev.testmodel import gptq

pytestmark = pytest.mark.gpu

H, N, GROUP = 2560, 640, 128
PREFIX = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def vllm_context():
    from eodev.vllm_context import single_process_vllm
    from vllm.v1.worker.workspace import init_workspace_manager

    with single_process_vllm("nccl") as config:
        init_workspace_manager(torch.device("cuda"))  # the modular kernels' scratch buffers
        yield config


def _forget_layers() -> None:
    """Unregister every layer the tests built (the forward context holds each by name), so
    that it is freed now: left there, a layer was freed when a later test built one of
    the same name, in the middle of that test's memory accounting."""
    from vllm.config import get_current_vllm_config

    context = get_current_vllm_config().compilation_config.static_forward_context
    for name in [k for k in context if k.startswith("model.layers.")]:
        context.pop(name)
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_layers(vllm_context):
    yield
    _forget_layers()


def _checkpoint(num_experts: int, quant: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors (what a safetensors file holds) with random values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(num_experts):
        for proj, (n_in, n_out) in (
            ("gate_proj", (H, N)),
            ("up_proj", (H, N)),
            ("down_proj", (N, H)),
        ):
            if quant == "int4":
                q = torch.randint(1, 16, (n_in, n_out), generator=g)
                s = (torch.rand(n_in // GROUP, n_out, generator=g) + 0.5) / (4.3 * n_in**0.5)
                out += [
                    (f"{e}.{proj}.qweight", gptq.pack_rows(q)),
                    (f"{e}.{proj}.scales", s.half()),
                    (f"{e}.{proj}.qzeros", gptq.qzeros(n_in, n_out, GROUP)),
                    (f"{e}.{proj}.g_idx", gptq.g_idx(n_in, GROUP)),
                ]
            else:
                w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
                out.append((f"{e}.{proj}.weight", w.bfloat16()))
    return out


def _build(num_experts, top_k, quant, weights, cold_ids, tmp_path):
    experts = _load(num_experts, top_k, quant, weights, cold_ids, tmp_path)
    _process(experts)
    return experts


def _set_up_layer(tmp_path, layer, num_experts, cold_ids, quant):
    """Before a MoE layer is built: a cold file naming `cold_ids` of `layer` in
    VLLM_EXPERT_COLD_FILE (none for the unsplit layer), a fresh planner, and the INT4
    layer's GPTQ config (None for BF16)."""
    from vllm.model_executor.layers.fused_moe.expert_offload import planner
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    os.environ.pop("VLLM_EXPERT_COLD_FILE", None)
    if cold_ids is not None:
        path = tmp_path / f"cold-{quant}-{layer}.json"
        path.write_text(
            json.dumps(
                {
                    "format": "vllm-expert-offload/cold-set",
                    "version": 1,
                    "model": {"name": "kernel-test", "num_experts": num_experts},
                    "layers": {str(layer): sorted(cold_ids)},
                }
            )
        )
        os.environ["VLLM_EXPERT_COLD_FILE"] = str(path)
    planner.reset_planner()
    if quant != "int4":
        return None
    return AutoGPTQConfig.from_config(
        {"bits": 4, "group_size": GROUP, "sym": True, "desc_act": False, "lm_head": False}
    )


def _load(num_experts, top_k, quant, weights, cold_ids, tmp_path, layer: int = 1):
    """MoE layer ``layer`` built (split by ``cold_ids`` on host, if given) and its
    checkpoint loaded, not yet repacked: vLLM loads every layer before it processes any."""
    return _load_runner(
        num_experts, top_k, quant, weights, cold_ids, tmp_path, layer
    ).routed_experts


def _load_runner(num_experts, top_k, quant, weights, cold_ids, tmp_path, layer=1, **factory):
    """The layer's runner (FusedMoEFactory, with `factory`'s extra arguments: a shared
    expert, a gate, ...) built and its checkpoint loaded, not yet repacked."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.expert_offload import planner
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    prefix = PREFIX.replace(".1.", f".{layer}.")
    # the full and the split layer share a name; vLLM refuses a layer name it has seen
    get_current_vllm_config().compilation_config.static_forward_context.pop(prefix, None)
    qc = _set_up_layer(tmp_path, layer, num_experts, cold_ids, quant)
    with torch.device("cuda"):
        runner = FusedMoEFactory(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=H,
            intermediate_size=N,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=prefix,
            **factory,
        )
    os.environ.pop("VLLM_EXPERT_COLD_FILE", None)
    planner.reset_planner()
    loaded = list(runner.load_weights(iter(weights)))
    assert len(loaded) == len(weights)
    return runner


def _process(experts) -> None:
    """The repack after loading, through expert offload's hook as vLLM's loader calls it."""
    from vllm.model_executor.layers.fused_moe import expert_offload
    from vllm.model_executor.model_loader.utils import device_loading_context

    if not expert_offload.process_weights_after_loading(
        experts, torch.device("cuda"), device_loading_context
    ):
        experts.quant_method.process_weights_after_loading(experts)
    experts._ensure_moe_quant_config_init()


def _forward(config, experts, x, w, ids, only_gpu_table=False):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    with set_forward_context(None, config, num_tokens=x.shape[0]):
        if only_gpu_table:
            return RoutedExperts.forward_modular(experts, x, w, ids)
        return experts.forward_modular(x, w, ids)


@pytest.mark.parametrize("quant,num_experts,top_k", [("int4", 512, 10), ("bf16", 128, 8)])
def test_split_layer_equals_full_layer(vllm_context, tmp_path, quant, num_experts, top_k):
    from vllm.model_executor.layers.fused_moe.expert_offload.split import SplitRoutedExperts

    weights = _checkpoint(num_experts, quant)
    g = torch.Generator().manual_seed(1)
    cold = torch.randperm(num_experts, generator=g)[: num_experts // 8].tolist()
    full = _build(num_experts, top_k, quant, weights, None, tmp_path)
    split = _build(num_experts, top_k, quant, weights, cold, tmp_path)
    assert isinstance(split, SplitRoutedExperts)
    host = split.host_experts
    arena = host._expert_offload_arena
    start, end = arena.host.data_ptr(), arena.host.data_ptr() + arena.nbytes
    for p in host.parameters():  # UVA views into the page-locked arena, not VRAM
        assert p.is_cuda and (p.numel() == 0 or start <= p.data_ptr() < end)
    kernel = type(full.quant_method.moe_kernel.fused_experts).__name__
    gh.log(
        f"{quant}: MoE experts kernel {kernel}; host table {host.local_num_experts} experts "
        f"in a {host._expert_offload_arena.nbytes / 2**20:.0f} MiB page-locked arena"
    )

    cold_t = torch.tensor(cold, device="cuda")
    for tokens in (1, 7, 64, 600):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, num_experts, device="cuda")
        w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float()
        ids = ids.to(torch.int32)
        ref = _forward(vllm_context, full, x, w, ids)
        out = _forward(vllm_context, split, x, w, ids)
        scale = ref.abs().max().item()
        diff = (out.float() - ref.float()).abs().max().item()
        gh.log(
            f"{quant} tokens={tokens}: split vs full max|diff| {diff:.3g} (max|out| {scale:.3g})"
        )
        # one reduction over both tables' slots. Triton's per-slot GEMMs do not depend on
        # the rest of the batch, so the split layer is the unsplit one bit for bit. Marlin
        # splits K across thread blocks by problem size (fp32 partial sums), so a slot's value
        # depends on how many blocks the call has: the same tokens in another batch of the
        # unsplit layer differ by as much. Bound: half a bf16 step at the output scale.
        if quant == "bf16":
            assert torch.equal(out, ref), f"split layer differs from the full layer by {diff:.3g}"
        else:
            alone = _forward(vllm_context, full, x[:1], w[:1], ids[:1])
            rebatched = (alone.float() - ref[:1].float()).abs().max().item()
            gh.log(f"{quant} tokens={tokens}: full layer, token 0 alone vs batched {rebatched:.3g}")
            assert diff <= scale * 2**-8

        # -1 ids contribute nothing: the GPU table alone equals the full layer with the host
        # experts' routing weights set to zero, up to one bf16 rounding of the sum (an expert
        # read out of range would add garbage of the output's own size)
        on_host = torch.isin(ids, cold_t)
        gpu_only = _forward(vllm_context, split, x, w, ids, only_gpu_table=True)
        masked = _forward(vllm_context, full, x, w.masked_fill(on_host, 0.0), ids)
        d2 = (gpu_only.float() - masked.float()).abs().max().item()
        gh.log(f"{quant} tokens={tokens}: GPU table alone vs masked full layer max|diff| {d2:.3g}")
        assert d2 <= scale * 2**-7

    # every id of every token on the other table: the kernel reads nothing and returns zeros
    ids = cold_t[:top_k].repeat(16, 1).to(torch.int32)
    w = torch.full(ids.shape, 1.0 / top_k, device="cuda")
    x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert _forward(vllm_context, split, x, w, ids, only_gpu_table=True).abs().max().item() == 0.0
    torch.cuda.synchronize()  # an out-of-range read would surface here as an illegal address


def _one_expert_checkpoint(num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """The INT4 checkpoint of ``_checkpoint`` with one expert's random tensors under every
    id: for memory accounting, where values do not matter and 512 random experts take
    a minute to make."""
    one = _checkpoint(1, "int4")
    return [(f"{e}.{name.split('.', 1)[1]}", t) for e in range(num_experts) for name, t in one]


def _cuda_allocated() -> int:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _cuda_storages(*modules: torch.nn.Module) -> tuple[set[int], int]:
    """Storage addresses of the modules' CUDA parameters and buffers (UVA views of host
    arenas excluded: they are not VRAM), and the parameters' bytes in VRAM."""
    ptrs, vram = set(), 0
    for m in modules:
        arena = getattr(m, "_expert_offload_arena", None)
        for t in (*m.parameters(), *m.buffers()):
            if not t.is_cuda or not t.numel():
                continue
            if arena is not None and isinstance(t, torch.nn.Parameter):
                continue  # a view into the page-locked arena
            ptrs.add(t.untyped_storage().data_ptr())
            if isinstance(t, torch.nn.Parameter):
                vram += t.numel() * t.element_size()
    return ptrs, vram


@pytest.mark.parametrize("layers", [1, 16])
def test_split_layer_saves_the_vram_it_places_on_host(vllm_context, tmp_path, layers):
    """offload-02 at the reference geometry (512 INT4 experts, 51 of them on host, as in
    the benchmark's 10% point): the VRAM that split layers hold after loading and repack
    is the unsplit layers' less the host tables' bytes, within 2% of them. With
    16 layers, every layer is loaded before any is repacked, as vLLM's loader does, so the
    caching allocator sees the engine's sequence of allocations. What the split layers
    hold beside their GPU experts is listed by the code that allocated it (CUDA allocator
    history), and the slack of the blocks that hold the experts is reported (torch counts
    whole blocks), so a failure names its cause."""
    from eodev.engine_probe import allocation_sites, expert_block_slack, weight_blocks
    from vllm.v1.worker.gpu_worker import Worker

    weights = _one_expert_checkpoint(512)
    cold = list(range(5, 512, 10))  # 51 experts spread over the table

    def build(cold_ids):
        """The layers, loaded and repacked under vLLM's own allocator setting for model
        loading; torch's allocated bytes they hold, its reserved bytes once the cache is
        emptied; a snapshot. Layers of earlier builds and tests are freed first: freed in
        the middle of a build, they made its layers seem to hold less than their own
        experts (seen on an H200, 2026-12-01 and 2026-12-02)."""
        _forget_layers()
        torch.cuda.empty_cache()
        base, reserved = _cuda_allocated(), torch.cuda.memory_reserved()
        with Worker._scoped_allocator_max_split(None, max_split_size_mb=20):
            model = []
            for n in range(layers):
                # each layer's router gate, made just before its experts as in Qwen3-MoE:
                # a 2.5 MiB tensor that shares its 20 MiB segment with them
                gate = torch.empty(512, 2560, dtype=torch.bfloat16, device="cuda")
                model.append(_load(512, 10, "int4", weights, cold_ids, tmp_path, n))
                model[-1].test_router_gate = gate
            for experts in model:
                _process(experts)
        held = _cuda_allocated() - base
        torch.cuda.empty_cache()
        return model, held, torch.cuda.memory_reserved() - reserved, memory._snapshot()

    def free(model) -> None:
        model.clear()
        _forget_layers()

    memory = torch.cuda.memory
    memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        full, full_held, full_reserved, full_snapshot = build(None)
        full_ptrs, full_vram = _cuda_storages(*full)
        full_blocks = weight_blocks(full_snapshot, full_ptrs, full_ptrs)
        free(full)
        split, split_held, split_reserved, snapshot = build(cold)
    finally:
        memory._record_memory_history(enabled=None)
    hosts = [m.host_experts for m in split]
    ptrs, gpu_vram = _cuda_storages(*split, *hosts)
    host_bytes = sum(h._expert_offload_arena.nbytes for h in hosts)
    saved = full_held - split_held
    beside = allocation_sites(snapshot, ptrs, top=8)
    slack = expert_block_slack(weight_blocks(snapshot, ptrs, ptrs))
    full_slack = expert_block_slack(full_blocks)
    gh.log(
        f"{layers} layer(s): full layers hold {full_held:,} B ({full_vram:,} B of experts, "
        f"blocks {full_slack:,} B over them), split layers {split_held:,} B "
        f"({gpu_vram:,} B of GPU experts, blocks {slack:,} B over them); "
        f"{host_bytes:,} B on host; VRAM saved {saved:,} B = {saved / host_bytes:.4f} of "
        "the host bytes"
    )
    kept = full_reserved - split_reserved
    gh.log(
        f"{layers} layer(s), reserved once the cache is emptied: full {full_reserved:,} B, "
        f"split {split_reserved:,} B; saved {kept:,} B = {kept / host_bytes:.4f} of the host "
        "bytes"
    )
    for row in beside["top"]:
        gh.log(f"  beside the experts: {row['bytes']:,} B in {row['count']} at {row['site']}")
    assert full_held >= full_vram
    assert saved >= 0.98 * host_bytes, (
        f"{layers} split layer(s) save {saved:,} B of VRAM for {host_bytes:,} B on host; "
        f"their experts' blocks exceed the experts by {slack:,} B (unsplit: "
        f"{full_slack:,} B); held beside the GPU experts: {beside['top'][:4]}"
    )
