# SPDX-License-Identifier: Apache-2.0
"""offload-01/02 inside the patched vLLM on the CPU: how layers are built with a cold file or
host layers, how checkpoint experts reach their table, the expert maps, unchanged parameter
names, start-up errors, and the weight_loader closure leak.

    scripts/test tests/cpu/test_offload_layers.py
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pathlib
import weakref

import pytest
import torch

E, K, HIDDEN, WIDTH = 16, 4, 64, 32
PREFIX = "model.layers.{}.mlp.experts"


@pytest.fixture(autouse=True)
def clean_offload_env(monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import placement, planner

    monkeypatch.delenv("VLLM_EXPERT_COLD_FILE", raising=False)
    monkeypatch.delenv("VLLM_EXPERT_HOST_LAYERS", raising=False)
    planner.reset_planner()
    placement.records.clear()
    yield
    planner.reset_planner()
    placement.records.clear()


def cold_file(tmp_path: pathlib.Path, layers: dict, budget: dict | None = None, **model) -> str:
    doc = {
        "format": "vllm-expert-offload/cold-set",
        "version": 1,
        "model": {"name": "unit", "num_experts": E, **model},
        "layers": {str(k): v for k, v in layers.items()},
    }
    if budget is not None:
        doc["budget"] = budget
    path = tmp_path / "cold.json"
    path.write_text(json.dumps(doc))
    return str(path)


def build(layer: int, **env: str):
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.expert_offload import planner
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    # several tests build the same layer; vLLM refuses a layer name it has seen
    get_current_vllm_config().compilation_config.static_forward_context.pop(
        PREFIX.format(layer), None
    )
    for k, v in env.items():
        os.environ[k] = v
    planner.reset_planner()
    try:
        return FusedMoEFactory(
            num_experts=E,
            top_k=K,
            hidden_size=HIDDEN,
            intermediate_size=WIDTH,
            params_dtype=torch.bfloat16,
            prefix=PREFIX.format(layer),
        )
    finally:
        for k in env:
            os.environ.pop(k, None)


def checkpoint(prefix_layer: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors whose every value is the expert's id."""
    out = []
    for e in range(E):
        for proj, shape in (
            ("gate_proj", (WIDTH, HIDDEN)),
            ("up_proj", (WIDTH, HIDDEN)),
            ("down_proj", (HIDDEN, WIDTH)),
        ):
            out.append((f"{e}.{proj}.weight", torch.full(shape, float(e), dtype=torch.bfloat16)))
    return out


# ---- construction ------------------------------------------------------------------------------
def test_cold_file_builds_two_tables_with_complementary_maps(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload.split import SplitRoutedExperts

    cold = [1, 5, 6, 15]
    upstream = build(2)
    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: cold}))
    gpu = runner.routed_experts
    assert isinstance(gpu, SplitRoutedExperts)
    host = gpu.host_experts
    gpu_rows = [e for e in range(E) if e not in cold]
    assert gpu.expert_map.tolist() == [gpu_rows.index(e) if e in gpu_rows else -1 for e in range(E)]
    assert host.expert_map.tolist() == [cold.index(e) if e in cold else -1 for e in range(E)]
    assert gpu.local_num_experts == E - len(cold) and host.local_num_experts == len(cold)

    # parameter names and module tree exactly upstream's; only the rows differ
    names = [n for n, _ in runner.named_parameters()]
    assert names == [n for n, _ in upstream.named_parameters()]
    assert [n for n, _ in runner.named_modules()] == [n for n, _ in upstream.named_modules()]
    assert list(runner.state_dict()) == list(upstream.state_dict())
    assert runner.routed_experts.w13_weight.shape[0] == E - len(cold)
    assert host.w13_weight.shape[0] == len(cold)
    assert all(p.device.type == "cpu" for p in host.parameters())


def test_layers_absent_from_the_cold_file_keep_every_expert(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    runner = build(3, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: [1]}))
    assert type(runner.routed_experts) is RoutedExperts
    assert runner.routed_experts.expert_map is None


def test_host_layers_and_a_fully_cold_layer_use_the_whole_layer_path(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload.whole_layer import (
        HostLayerExperts,
    )

    runner = build(4, VLLM_EXPERT_HOST_LAYERS="0-1,4")
    assert isinstance(runner.routed_experts, HostLayerExperts)
    assert runner.routed_experts.w13_weight.shape[0] == E
    assert runner.routed_experts.expert_map is None
    full = build(5, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {5: list(range(E))}))
    assert isinstance(full.routed_experts, HostLayerExperts)


def test_loading_sends_every_checkpoint_expert_to_its_table(vllm_cpu, tmp_path):
    cold = [0, 7, 8]
    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: cold}))
    weights = checkpoint()
    loaded = list(runner.load_weights(iter(weights)))
    assert len(loaded) == len(weights)  # vLLM's loaded-weight bookkeeping sees every tensor
    gpu, host = runner.routed_experts, runner.routed_experts.host_experts
    gpu_rows = [e for e in range(E) if e not in cold]
    assert gpu.w13_weight[:, 0, 0].tolist() == gpu_rows
    assert gpu.w2_weight[:, 0, 0].tolist() == gpu_rows
    assert host.w13_weight[:, 0, 0].tolist() == cold
    assert host.w13_weight[:, WIDTH, 0].tolist() == cold  # up_proj half of w13
    assert host.w2_weight[:, 0, 0].tolist() == cold


# ---- the GPU table in one allocator block ----------------------------------------------------
def test_gpu_table_moves_into_one_block_with_its_parameters_unchanged(
    vllm_cpu, tmp_path, monkeypatch
):
    """offload-02 copies a split layer's GPU table into one allocation after repack (torch
    counts whole allocator blocks; see gpu_table_block's docstring). On the CPU the same code
    moves the same parameters: one storage, each tensor at an aligned offset of its own,
    the values, shapes, dtypes and Parameter objects unchanged, then the kernel set-up
    redone on the moved tensors."""
    from vllm.model_executor.layers.fused_moe.expert_offload import gpu_table_block

    cold = [0, 7, 8]
    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: cold}))
    list(runner.load_weights(iter(checkpoint())))
    gpu = runner.routed_experts
    before = {n: (p, p.detach().clone()) for n, p in gpu.named_parameters(recurse=False)}
    old_ptrs = {p.data_ptr() for p, _ in before.values()}
    seen = []
    monkeypatch.setitem(
        gpu_table_block.KERNEL_SETUP,
        type(gpu.quant_method).__name__,
        lambda m: seen.append({n: q.data_ptr() for n, q in m.named_parameters(recurse=False)}),
    )

    # the test layer's tensors are small; by default only those of 20 MiB or more move
    nbytes = gpu_table_block.hold_in_one_block(gpu, torch.device("cpu"), min_bytes=0)

    after = dict(gpu.named_parameters(recurse=False))
    assert list(after) == list(before) and len(after) >= 2
    storage = {p.untyped_storage().data_ptr() for p in after.values()}
    assert len(storage) == 1
    base = storage.pop()
    spans = sorted(
        (p.data_ptr() - base, p.data_ptr() - base + p.numel() * p.element_size())
        for p in after.values()
    )
    assert all(start % gpu_table_block.ALIGN == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= nbytes == gpu.w13_weight.untyped_storage().nbytes()
    for name, (param, value) in before.items():
        assert after[name] is param  # the same Parameter: references to it stay valid
        assert param.dtype == value.dtype and param.shape == value.shape
        assert torch.equal(param, value), name
    assert not old_ptrs & {p.data_ptr() for p in after.values()}
    gpu_rows = [e for e in range(E) if e not in cold]
    assert gpu.w13_weight[:, 0, 0].tolist() == gpu_rows
    # the kernel set-up ran once, on the moved tensors
    assert seen == [{n: p.data_ptr() for n, p in after.items()}]
    # the host table is not this module's parameter and stays where it was
    assert all(p.untyped_storage().data_ptr() != base for p in gpu.host_experts.parameters())


def test_gpu_block_leaves_strided_and_other_device_tensors_alone(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload import gpu_table_block

    module = torch.nn.Module()
    module.quant_method = object()
    module.a = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=False)
    module.b = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2).t(), requires_grad=False)
    module.c = torch.nn.Parameter(torch.ones(5, dtype=torch.int32), requires_grad=False)
    module.d = torch.nn.Parameter(torch.ones(4, device="meta"), requires_grad=False)
    strided = module.b.data_ptr()
    nbytes = gpu_table_block.hold_in_one_block(module, torch.device("cpu"), min_bytes=0)
    assert nbytes == 2 * gpu_table_block.ALIGN  # a (24 B) and c (20 B), each aligned
    assert module.a.untyped_storage().data_ptr() == module.c.untyped_storage().data_ptr()
    assert module.b.data_ptr() == strided and module.b.stride() == (1, 2)
    assert module.d.device.type == "meta"
    assert module.a.tolist() == [[0, 1, 2], [3, 4, 5]] and module.c.tolist() == [1] * 5
    # one tensor alone gains nothing from a block of its own
    lone = torch.nn.Module()
    lone.quant_method = object()
    lone.a = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    assert gpu_table_block.hold_in_one_block(lone, torch.device("cpu"), min_bytes=0) == 0


def test_gpu_block_moves_only_tensors_that_never_share_a_segment(vllm_cpu):
    """While vLLM loads, requests under 20 MiB are cut from segments shared with other
    modules' weights; moving them left the router gates alone in segments nothing refilled
    (the process's VRAM saved 91.9% of the host bytes). They stay where they are."""
    from vllm.model_executor.layers.fused_moe.expert_offload import gpu_table_block

    assert gpu_table_block.ONE_SEGMENT == 20 * 1024 * 1024
    module = torch.nn.Module()
    module.quant_method = object()
    big = gpu_table_block.ONE_SEGMENT // 4  # float32 elements
    module.qweight = torch.nn.Parameter(torch.arange(float(big + 1)), requires_grad=False)
    module.scales = torch.nn.Parameter(torch.full((big,), 2.0), requires_grad=False)
    module.qzeros = torch.nn.Parameter(torch.ones(big - 1), requires_grad=False)
    zeros = module.qzeros.data_ptr()
    nbytes = gpu_table_block.hold_in_one_block(module, torch.device("cpu"))
    assert nbytes == 4 * (2 * big + 1) + gpu_table_block.ALIGN - 4  # two tensors, the first aligned
    assert module.qweight.untyped_storage().data_ptr() == module.scales.untyped_storage().data_ptr()
    assert module.qzeros.data_ptr() == zeros  # 4 bytes under the threshold: not moved
    assert module.qweight[-1].item() == big and module.scales.sum().item() == 2.0 * big
    # the default moves nothing of a table whose large tensors number fewer than two
    module.scales = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    assert gpu_table_block.hold_in_one_block(module, torch.device("cpu")) == 0


# ---- start-up errors -------------------------------------------------------------------------
def planner_for(
    tmp_path,
    layers=None,
    host_layers=frozenset(),
    num_layers=8,
    arch="Qwen3MoeForCausalLM",
    model=None,
    **facts,
):
    from vllm.model_executor.layers.fused_moe.expert_offload.config import OffloadSettings
    from vllm.model_executor.layers.fused_moe.expert_offload.planner import (
        ModelFacts,
        OffloadPlanner,
    )

    path = cold_file(tmp_path, layers, **(model or {})) if layers is not None else None
    facts = ModelFacts("/models/qwen-test", num_layers, architecture=arch, **facts)
    return OffloadPlanner(OffloadSettings(frozenset(host_layers), path), facts)


def error_of(fn):
    from vllm.model_executor.layers.fused_moe.expert_offload import ExpertOffloadError

    with pytest.raises(ExpertOffloadError) as e:
        fn()
    return str(e.value)


def test_cold_file_for_another_model_is_refused(tmp_path):
    msg = error_of(lambda: planner_for(tmp_path, {1: [2]}, model={"num_layers": 48}))
    assert "48 layers" in msg and "has 8" in msg and "select-cold-set" in msg
    msg = error_of(
        lambda: planner_for(tmp_path, {1: [2]}, model={"architecture": "DeepseekV3ForCausalLM"})
    )
    assert "DeepseekV3ForCausalLM" in msg and "Qwen3MoeForCausalLM" in msg


def test_cold_file_with_another_expert_count_is_refused(vllm_cpu, tmp_path):
    path = cold_file(tmp_path, {2: [3]}, num_experts=128)
    msg = error_of(lambda: build(2, VLLM_EXPERT_COLD_FILE=path))
    assert "128 experts per layer" in msg and f"has {E}" in msg


def test_cold_file_layer_or_expert_out_of_range_or_duplicated(tmp_path):
    msg = error_of(lambda: planner_for(tmp_path, {8: [1]}))
    assert "layer(s) 8" in msg and "0-7" in msg
    msg = error_of(lambda: planner_for(tmp_path, {1: [3, E]}))
    assert f"[{E}]" in msg and f"0-{E - 1}" in msg
    msg = error_of(lambda: planner_for(tmp_path, {1: [3, 4, 3]}))
    assert "[3]" in msg and "more than once" in msg
    msg = error_of(lambda: planner_for(tmp_path, {1: [-1]}))
    assert "outside" in msg


def test_broken_cold_files_are_refused(tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload.cold_file import load_cold_file

    bad = tmp_path / "bad.json"
    for text, words in (
        ("{not json", "not readable as JSON"),
        (json.dumps({"format": "x"}), "not a cold file"),
        (json.dumps({"format": "vllm-expert-offload/cold-set", "version": 9}), "version 9"),
        (
            json.dumps(
                {
                    "format": "vllm-expert-offload/cold-set",
                    "version": 1,
                    "model": {"num_experts": 4},
                    "layers": {"x": [1]},
                }
            ),
            "not a layer number",
        ),
    ):
        bad.write_text(text)
        assert words in error_of(lambda: load_cold_file(str(bad)))
    assert "no such file" in error_of(lambda: load_cold_file(str(tmp_path / "missing.json")))


COLD_HEAD = '{"format": "vllm-expert-offload/cold-set", "version": 1, '
MODEL = '"model": {"name": "unit", "num_experts": 16}'
# (file text, words the one-line error must hold); each failed with a traceback or passed
# silently before the loader checked it
BAD_VALUES = {
    "budget as a string": (
        COLD_HEAD + MODEL + ', "budget": "3GiB", "layers": {"1": [2]}}',
        "'budget' must be an object",
    ),
    "a stage budget as a string": (
        COLD_HEAD
        + MODEL
        + ', "budget": {"pipeline_parallel_size": 1, "gib_per_stage": ["3GiB"]},'
        + ' "layers": {"1": [2]}}',
        "'gib_per_stage' must be a list of GiB per pipeline stage as numbers",
    ),
    "a budget per stage missing": (
        COLD_HEAD
        + MODEL
        + ', "budget": {"pipeline_parallel_size": 2, "gib_per_stage": [3]},'
        + ' "layers": {"1": [2]}}',
        "has 1 values for pipeline_parallel_size 2",
    ),
    "a superscript digit as layer key": (
        COLD_HEAD + MODEL + ', "layers": {"\u00b2": [2]}}',
        "layer key '²' is not a layer number",
    ),
    "a zero-padded layer key": (
        COLD_HEAD + MODEL + ', "layers": {"07": [2], "7": [3]}}',
        "layer key '07' is not a layer number",
    ),
    "no layers": (COLD_HEAD + MODEL + ', "layers": {}}', "lists no host expert"),
    "only empty layers": (COLD_HEAD + MODEL + ', "layers": {"1": []}}', "lists no host expert"),
    "an empty file": ("", "the file is empty"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_cold_file_values_of_the_wrong_kind_are_refused_in_one_line(tmp_path, case):
    from vllm.model_executor.layers.fused_moe.expert_offload.cold_file import load_cold_file

    text, words = BAD_VALUES[case]
    path = tmp_path / "cold.json"
    path.write_text(text)
    msg = error_of(lambda: load_cold_file(str(path)))
    assert words in msg and "\n" not in msg
    assert msg.startswith(f"VLLM_EXPERT_COLD_FILE={path}: ")
    assert "select-cold-set" in msg


def test_a_directory_as_cold_file_is_called_a_directory(tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload.cold_file import load_cold_file

    msg = error_of(lambda: load_cold_file(str(tmp_path)))
    assert "is a directory, not a cold file" in msg and "no such file" not in msg
    assert "not its folder" in msg


def test_a_cold_file_naming_the_mtp_layer_is_refused(tmp_path):
    """Qwen4Exp's MTP MoE layer is mtp.layers.{num_hidden_layers}.mlp.experts: it has a
    layer number, the factory builds it, and it is never offloaded."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.expert_offload.planner import mtp_layer_count

    # ModelFacts.current() counts them from the config: Qwen4Exp's code adds one by default
    assert mtp_layer_count("Qwen4ExpForCausalLM", SimpleNamespace()) == 1
    assert mtp_layer_count("Qwen4ExpForCausalLM", SimpleNamespace(mtp_num_hidden_layers=2)) == 2
    assert mtp_layer_count("Qwen3MoeForCausalLM", SimpleNamespace()) == 0
    msg = error_of(
        lambda: planner_for(tmp_path, {1: [2], 8: [1]}, arch="Qwen4ExpForCausalLM", mtp_layers=1)
    )
    assert "layer 8 is the model's MTP layer (mtp.layers.8.mlp.experts)" in msg
    assert "remove layer(s) 8 from 'layers'" in msg
    # a model with no MTP layers: the same file is one layer too many
    msg = error_of(lambda: planner_for(tmp_path, {1: [2], 8: [1]}))
    assert "MTP" not in msg and "layer(s) 8" in msg and "0-7" in msg


def test_a_qwen3_moe_cold_file_for_a_qwen4exp_model_names_every_mismatch(tmp_path):
    made_for = {"architecture": "Qwen3MoeForCausalLM", "num_layers": 8, "num_experts": E}
    msg = error_of(
        lambda: planner_for(
            tmp_path,
            {1: [2]},
            num_layers=4,
            arch="Qwen4ExpForCausalLM",
            model=made_for,
            num_experts=64,
        )
    )
    assert "made for a Qwen3MoeForCausalLM model" in msg and "Qwen4ExpForCausalLM" in msg
    assert "8 layers" in msg and "has 4" in msg
    assert f"made for {E} experts per layer" in msg and "has 64" in msg
    assert "use a cold file made for this model (scripts/select-cold-set)" in msg


def test_model_facts_read_experts_and_mtp_layers_from_the_config(monkeypatch):
    """What the start-up checks compare a cold file with, from a Qwen4Exp-like config."""
    from types import SimpleNamespace

    import vllm.config
    from vllm.model_executor.layers.fused_moe.expert_offload.planner import ModelFacts

    mc = SimpleNamespace(
        model="/models/q4",
        hf_config=SimpleNamespace(architectures=["Qwen4ExpForCausalLM"]),
        hf_text_config=SimpleNamespace(num_hidden_layers=4, num_experts=64),
    )
    config = SimpleNamespace(model_config=mc)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)
    facts = ModelFacts.current()
    assert (facts.num_layers, facts.num_experts, facts.mtp_layers) == (4, 64, 1)
    assert facts.architecture == "Qwen4ExpForCausalLM"


def test_a_cold_file_for_another_model_name_is_used_with_a_warning(tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    log = logging.getLogger("vllm.model_executor.layers.fused_moe.expert_offload.planner")
    log.addHandler(handler)
    try:
        planner_for(tmp_path, {1: [2]}, model={"name": "Other-Model"})
        planner_for(tmp_path, {1: [2]}, model={"name": "/elsewhere/qwen-test"})
    finally:
        log.removeHandler(handler)
    [warning] = records  # the same folder name elsewhere is the same model
    assert "'Other-Model'" in warning and "/models/qwen-test" in warning


def test_host_layers_that_do_not_exist_are_refused(tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload.config import parse_layer_list

    msg = error_of(lambda: planner_for(tmp_path, host_layers={3, 9, 10}))
    assert "9-10" in msg and "8 layers (0-7)" in msg
    assert parse_layer_list("0-2, 5,7-7") == {0, 1, 2, 5, 7}
    assert "runs backwards" in error_of(lambda: parse_layer_list("5-3"))
    assert "cannot read 'x'" in error_of(lambda: parse_layer_list("1,x"))


def test_a_layer_in_both_lists_is_refused(tmp_path):
    msg = error_of(lambda: planner_for(tmp_path, {2: [1]}, host_layers={2}))
    assert "also in VLLM_EXPERT_HOST_LAYERS" in msg


def test_host_budget_beyond_available_memory_is_refused(vllm_cpu, tmp_path, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import host_memory

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: (1000, "a test limit"))
    msg = error_of(lambda: build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: [1, 2]})))
    assert "GiB of host memory" in msg and "a test limit" in msg and "smaller cold set" in msg


def test_cold_budget_smaller_than_the_bytes_is_refused(vllm_cpu, tmp_path):
    budget = {"pipeline_parallel_size": 1, "gib_per_stage": [1e-5]}
    path = cold_file(tmp_path, {2: [1, 2, 3]}, budget=budget)
    msg = error_of(lambda: build(2, VLLM_EXPERT_COLD_FILE=path))
    assert "budget" in msg and "another model, quantisation or pipeline split" in msg
    # 3 experts x 12 KiB against 1e-5 GiB, in units that show them (not "0.00 GiB")
    assert "36.00 KiB on pipeline rank 0" in msg and "budget of 10.49 KiB per stage" in msg


def test_unsupported_quantisation_is_refused(vllm_cpu, tmp_path, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import config

    monkeypatch.setattr(config, "SUPPORTED_QUANT_METHODS", ("AutoGPTQMoEMethod",))
    msg = error_of(lambda: build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: [1]})))
    assert "UnquantizedFusedMoEMethod" in msg and "does not support" in msg


# ---- processing, the closure leak, start-up lines -----------------------------------------------
def fake_repack(module):
    """What a repack does to the parameters: replace them with new tensors (vLLM's
    replace_parameter registers new Parameters when the type differs)."""
    from vllm.model_executor.layers.quantization.utils import replace_parameter

    for name in ("w13_weight", "w2_weight"):
        replace_parameter(module, name, getattr(module, name).data.clone() * 2)


def leak_probe(cold_path: str, closure_loaders: bool = False) -> str:
    """Load a split layer the way vLLM does (reload metadata recorded right after the model is
    built), repack, and say whether the host table's load-format tensors are still alive.

    ``closure_loaders``: give each GPU-table parameter a weight_loader closure that captures
    the host parameter of the same name, as a closure-based loader would; vLLM keeps
    weight_loader attributes (and the reload metadata's copies) for the model's life."""
    from vllm.model_executor.layers.fused_moe.expert_offload import (
        process_weights_after_loading,
    )
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import device_loading_context

    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_path)
    if closure_loaders:
        host = runner.routed_experts.host_experts
        for name in ("w13_weight", "w2_weight"):
            param = getattr(runner.routed_experts, name)
            load, held = param.weight_loader, getattr(host, name)
            param.weight_loader = lambda *a, f=load, h=held, **k: f(*a, **k)
    record_metadata_for_reloading(runner)
    list(runner.load_weights(iter(checkpoint())))
    host = runner.routed_experts.host_experts
    old = [weakref.ref(host.w13_weight), weakref.ref(host.w2_weight)]
    host.quant_method.process_weights_after_loading = fake_repack
    runner.routed_experts.quant_method.process_weights_after_loading = fake_repack
    cpu = torch.device("cpu")
    assert process_weights_after_loading(runner.routed_experts, cpu, device_loading_context)
    assert host.w13_weight[:, 0, 0].tolist() == [2.0, 10.0]  # the repacked host table
    gc.collect()
    return "alive" if any(r() is not None for r in old) else "freed"


def test_load_format_copies_are_freed_after_repack(vllm_cpu, tmp_path):
    assert leak_probe(cold_file(tmp_path, {2: [1, 5]})) == "freed"


def test_the_leak_probe_finds_a_closure_that_keeps_the_load_format_copy(vllm_cpu, tmp_path):
    """The probe can fail: with loaders that capture the host parameters it finds them alive."""
    assert leak_probe(cold_file(tmp_path, {2: [1, 5]}), closure_loaders=True) == "alive"


def loaded_split_model(tmp_path) -> torch.nn.ModuleDict:
    """Two MoE layers after loading: layer 2 split (experts 1, 5, 9 on host), layer 3 not."""
    from vllm.model_executor.layers.fused_moe import expert_offload
    from vllm.model_executor.model_loader.utils import device_loading_context

    runner = build(2, VLLM_EXPERT_COLD_FILE=cold_file(tmp_path, {2: [1, 5, 9]}))
    other = build(3)
    list(runner.load_weights(iter(checkpoint())))
    runner.routed_experts.quant_method.process_weights_after_loading = fake_repack
    runner.routed_experts.host_experts.quant_method.process_weights_after_loading = fake_repack
    expert_offload.process_weights_after_loading(
        runner.routed_experts, torch.device("cpu"), device_loading_context
    )
    return torch.nn.ModuleDict({"a": runner, "b": other})


def test_startup_lines_say_where_the_experts_are(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.fused_moe import expert_offload

    model = loaded_split_model(tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    log = logging.getLogger("vllm.model_executor.layers.fused_moe.expert_offload.placement")
    log.addHandler(handler)
    try:
        expert_offload.log_summary(model)
    finally:
        log.removeHandler(handler)
    text = "\n".join(records)
    assert "split experts (VLLM_EXPERT_COLD_FILE)" in text and "1 of 2 MoE layers" in text
    assert "GiB in host memory" in text and "GiB in VRAM" in text
    assert f"min/median/max = 0/1.5/3 of {E}" in text
    assert "more experts per layer in host memory than the cold file" not in text

    # one table that moved 2 GPU experts into host rows (to keep its VRAM within
    # offload-02's) says so
    from vllm.model_executor.layers.fused_moe.expert_offload import placement

    name = model["a"].routed_experts.layer_name
    placement.records[name].moved_to_host = 2
    records.clear()
    log.addHandler(handler)
    try:
        expert_offload.log_summary(model)
    finally:
        log.removeHandler(handler)
        placement.records[name].moved_to_host = 0
    text = "\n".join(records)
    assert "keeps 2 more experts per layer in host memory than the cold file, in 1 layers" in text


def test_only_this_pipeline_ranks_layers_count_towards_its_budget(tmp_path):
    """Layers outside this rank are never built here and do not count against its host memory;
    a stage budget is compared with the bytes of this rank's layers only."""
    from vllm.model_executor.layers.fused_moe.expert_offload.config import OffloadSettings
    from vllm.model_executor.layers.fused_moe.expert_offload.planner import (
        ModelFacts,
        OffloadPlanner,
    )

    path = cold_file(
        tmp_path,
        {1: [1, 2], 5: [1, 2, 3], 6: [4]},
        budget={"pipeline_parallel_size": 2, "gib_per_stage": [1.0, 1e-9]},
    )
    rank1 = ModelFacts("/m", 8, first_layer=4, end_layer=8, pp_rank=1, pp_size=2)
    planner = OffloadPlanner(OffloadSettings(frozenset({0, 7}), path), rank1)
    assert planner.host_experts_on_rank(E) == E + 3 + 1  # layer 7 whole, layers 5 and 6
    msg = error_of(lambda: planner.check_budget(1000, E))  # 4 cold experts > 1e-9 GiB
    assert "pipeline rank 1" in msg
    rank0 = ModelFacts("/m", 8, first_layer=0, end_layer=4, pp_rank=0, pp_size=2)
    planner = OffloadPlanner(OffloadSettings(frozenset({0, 7}), path), rank0)
    assert planner.host_experts_on_rank(E) == E + 2
    planner.check_budget(1000, E)  # 2 cold experts x 1000 bytes fit rank 0's 1 GiB


def test_split_layers_refuse_a_kernel_not_known_to_honour_expert_maps():
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.expert_offload.config import (
        check_expert_map_kernel,
    )

    class FlashInferExperts:  # stands for any kernel outside the known list
        pass

    class TritonExperts:
        pass

    def method(cls):
        return SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=cls()))

    check_expert_map_kernel(method(TritonExperts), "model.layers.3.mlp.experts")
    msg = error_of(lambda: check_expert_map_kernel(method(FlashInferExperts), "layer 3"))
    assert "FlashInferExperts" in msg and "--moe-backend" in msg
