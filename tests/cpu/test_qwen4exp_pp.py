# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism with Qwen4Exp's PLE layers, against the patched vLLM: PP=2 with PLE
passes config validation and the model state, non-first ranks keep the raw input ids and
the n-gram context (CUDA graph capture path of the V2 runner), and what still does not work
under PP (MTP's drafter; PLE under the V1 runner) is refused with a message naming the fix."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_qwen4exp_ple import text_config


def vllm_config(pp: int = 2, spec: str | None = None, ple: bool = True):
    """The parts of a VllmConfig that Qwen4Exp's config check and model state read."""
    config = text_config(ple_layer_ids=[1, 2] if ple else [])
    model_config = SimpleNamespace(
        hf_text_config=config,
        hf_config=config,
        multimodal_config=None,
        max_model_len=64,
        dtype=torch.bfloat16,
        enable_prompt_embeds=False,
        uses_mrope=False,
        uses_xdrope_dim=0,
        get_inputs_embeds_size=lambda: config.hidden_size,
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(
            mamba_ssm_cache_dtype="auto", mamba_cache_mode="none", use_kda_recoverssm=False
        ),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pp,
            enable_dbo=False,
            ubatch_size=1,
            data_parallel_size=1,
            tensor_parallel_size=1,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=16),
        speculative_config=None if spec is None else SimpleNamespace(method=spec),
        compilation_config=SimpleNamespace(),
        use_v2_model_runner=True,
    )


def verify(cfg) -> None:
    from vllm.model_executor.models.config import Qwen4ExpForCausalLMConfig

    Qwen4ExpForCausalLMConfig.verify_and_update_config(cfg)


def model_state(cfg):
    # The series' model_loader/utils.py imports expert_offload, which closes an import
    # cycle (fused_moe -> models.utils -> model_loader) when model_state is imported
    # first; an engine imports fused_moe long before. Import it first here as well.
    import vllm.model_executor.layers.fused_moe  # noqa: F401
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    return Qwen4ExpModelState(cfg, torch.nn.Identity(), None, torch.device("cpu"))


def test_pp2_with_ple_passes_the_config_check_and_the_model_state():
    cfg = vllm_config(pp=2)
    verify(cfg)
    state = model_state(cfg)
    assert state.needs_input_ids_on_all_pp_ranks
    assert state.uses_ngram_embedding and state.ngram_context_len == 2


def test_the_amd_model_state_accepts_pp2_too():
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (see model_state())
    from vllm.models.qwen4_exp.amd.model_state import Qwen4ExpModelState

    state = Qwen4ExpModelState(vllm_config(pp=2), torch.nn.Identity(), None, torch.device("cpu"))
    assert state.needs_input_ids_on_all_pp_ranks


def test_only_models_with_ple_ask_for_input_ids_on_every_rank():
    from vllm.v1.worker.gpu.model_states.interface import ModelState

    assert ModelState.needs_input_ids_on_all_pp_ranks is False
    assert not model_state(vllm_config(pp=2, ple=False)).needs_input_ids_on_all_pp_ranks


def test_mtp_under_pp_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError) as info:
        verify(vllm_config(pp=2, spec="mtp"))
    text = str(info.value)
    assert "MTP drafter" in text and "pipeline_parallel_size=2" in text
    assert "--speculative-config" in text and "--pipeline-parallel-size 1" in text
    verify(vllm_config(pp=1, spec="mtp"))  # PP=1 stays allowed


def test_ple_under_the_v1_runner_is_refused_with_the_fix(monkeypatch):
    from vllm.models.qwen4_exp.common.ple import check_ple_runner
    from vllm.platforms import current_platform

    # on the CPU no GPU runner runs the model: a CPU build (tests, tools) is let through
    cfg = vllm_config(pp=1)
    cfg.use_v2_model_runner = False
    check_ple_runner(cfg)
    monkeypatch.setattr(current_platform.__class__, "is_cuda_alike", lambda self: True)
    cfg = vllm_config(pp=1)
    check_ple_runner(cfg)
    cfg.use_v2_model_runner = False
    with pytest.raises(NotImplementedError) as info:
        check_ple_runner(cfg)
    text = str(info.value)
    assert "V2 model runner" in text and "VLLM_USE_V2_MODEL_RUNNER" in text
    no_ple = vllm_config(pp=1, ple=False)
    no_ple.use_v2_model_runner = False
    check_ple_runner(no_ple)  # models without PLE keep running under V1


def test_the_ngram_context_comes_from_each_rank_s_own_request_state():
    """What a non-first rank's PLE reads: the last two tokens before each request's
    first scheduled token, from the token ids every rank keeps."""
    state = model_state(vllm_config(pp=2))
    all_token_ids = torch.tensor([[4, 5, 6, 7, 8], [9, 10, 11, 0, 0]], dtype=torch.int32)
    req_states = SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=all_token_ids),
        num_computed_tokens=SimpleNamespace(gpu=torch.tensor([3, 1])),
    )
    batch = SimpleNamespace(
        num_reqs=2, num_reqs_after_padding=3, idx_mapping=torch.tensor([1, 0], dtype=torch.int32)
    )
    context = state._prepare_ngram_context(batch, req_states)
    assert context.tolist() == [[0, 9], [5, 6], [0, 0]]


def capture_inputs(monkeypatch, state, first_rank: bool) -> dict:
    """Run the V2 runner's CUDA graph capture code for one batch shape on the CPU and
    return the inputs the model was called with (the graph itself, the attention metadata
    and the forward context are stubbed: there is no GPU)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu import cudagraph_utils as cg

    num_tokens, hidden = 8, 4
    desc = cg.BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, 2)

    def capture_one(self, create_forward_fn, progress_bar_desc=""):
        create_forward_fn(desc, False)(CUDAGraphMode.NONE)

    monkeypatch.setattr(cg.CudaGraphManager, "capture", capture_one)
    monkeypatch.setattr(cg, "prepare_inputs_to_capture", lambda *a, **k: (None, None))
    monkeypatch.setattr(cg, "set_forward_context", lambda *a, **k: contextlib.nullcontext())
    manager = object.__new__(cg.ModelCudaGraphManager)
    manager.__dict__.update(
        use_breakable_cg=False,
        max_num_reqs=4,
        dp_size=1,
        is_first_pp_rank=first_rank,
        is_last_pp_rank=False,
        vllm_config=None,
        hidden_states=None,
        intermediate_tensors=None,
        use_aux_hidden_state_outputs=False,
    )
    seen: dict = {}

    def model(**inputs):
        seen.update(inputs)
        return IntermediateTensors({"hidden_states": torch.zeros(num_tokens, hidden)})

    buffers = SimpleNamespace(
        input_ids=torch.arange(16, dtype=torch.int32),
        positions=torch.arange(16),
        is_padding=torch.zeros(16, dtype=torch.bool),
    )
    manager.capture(
        model,
        state,
        buffers,
        IntermediateTensors({"hidden_states": torch.ones(16, hidden)}),
        block_tables=None,
        attn_groups=[],
        kv_cache_config=None,
    )
    return seen


def test_capture_on_a_non_first_rank_keeps_the_ids_and_ngram_context(monkeypatch):
    seen = capture_inputs(monkeypatch, model_state(vllm_config(pp=2)), first_rank=False)
    assert seen["input_ids"] is not None and seen["input_ids"].tolist() == list(range(8))
    assert seen["inputs_embeds"] is None
    assert seen["intermediate_tensors"]["hidden_states"].shape == (8, 4)
    assert seen["ngram_context"].shape == (2, 2)
    assert seen["query_start_loc"].tolist() == [0, 4, 8]


def test_capture_on_a_non_first_rank_still_drops_the_ids_without_ple(monkeypatch):
    seen = capture_inputs(monkeypatch, model_state(vllm_config(pp=2, ple=False)), first_rank=False)
    assert seen["input_ids"] is None


def test_the_runner_keeps_ids_only_where_the_model_state_asks():
    """The eager path (GPUModelRunner.execute_model) reads the same flag; its body needs a
    GPU to run, so check the patched statement is there and guarded by the flag."""
    import inspect

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner.execute_model)
    guarded = (
        "if not self.model_state.needs_input_ids_on_all_pp_ranks:\n"
        '                model_inputs["input_ids"] = None'
    )
    assert guarded in source
