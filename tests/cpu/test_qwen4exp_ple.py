# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp's PLE n-gram table in host memory (VLLM_PLE_TABLE=host), against the patched
vLLM: the table is never allocated on the GPU while built, loaded or post-processed, the
loader fills it from whole tables and row shards, the lookup reads it, and start-up refuses
with a message naming the fix when the host cannot hold or page-lock it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

HEAD_DIM = 4  # ple_embed_dim 16 over 2 x 2 n-gram heads
NGRAM_BASE = 500  # small tables, still larger than every other tensor of the layer


def text_config(**overrides):
    from vllm.transformers_utils.configs.qwen4_exp import Qwen4ExpTextConfig

    args = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        ple_layer_ids=[1, 2],
        ple_embed_dim=16,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=NGRAM_BASE,
        make_ngram_vocab_size_divisible_by=8,
        eos_token_id=0,
    )
    args.update(overrides)
    return Qwen4ExpTextConfig(**args)


class CudaStandIn(TorchFunctionMode):
    """Stands in for a GPU on a CPU-only machine: every tensor asked for on CUDA is made
    on the meta device instead (no memory) and its bytes recorded, so a test can assert
    what would have been allocated in VRAM."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda_bytes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "meta"
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self.cuda_bytes.append(out.numel() * out.element_size())
            return out
        return func(*args, **kwargs)


@pytest.fixture
def host_placement(monkeypatch):
    """VLLM_PLE_TABLE=host on a 'CUDA' platform whose registration and UVA view are
    recorded: the device view is a meta tensor (something that is not host memory and
    not allocated), as the real one is a CUDA tensor whose bytes are host memory."""
    # imported before the platform says CUDA: some modules pick CUDA kernels on import
    import vllm.model_executor.model_loader.utils  # noqa: F401
    import vllm.models.qwen4_exp.nvidia.ple_layer  # noqa: F401
    from vllm.models.qwen4_exp.common import ple
    from vllm.platforms import current_platform

    monkeypatch.setenv("VLLM_PLE_TABLE", "host")
    monkeypatch.setattr(current_platform.__class__, "is_cuda", lambda self: True)
    registered: list[tuple[int, int]] = []

    def register(ptr: int, nbytes: int) -> int:
        registered.append((ptr, nbytes))
        return 0

    monkeypatch.setattr(ple, "_cuda_host_register", register)
    monkeypatch.setattr(
        ple, "_device_view", lambda host: torch.empty(host.shape, dtype=host.dtype, device="meta")
    )
    monkeypatch.setattr(ple, "_available_host_memory", lambda: (1 << 40, "test"))
    return registered


def build_embedding(config, dense_id: int = 0, params_dtype=torch.bfloat16):
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding

    return Qwen4ExpNGramEmbedding(
        config,
        int(config.ple_embed_dim),
        dense_id,
        max_total_tokens=32,
        max_num_reqs=4,
        prefix=f"model.layers.{dense_id}.ple.ple_embedding",
        layer_name=f"model.layers.{dense_id}.ple",
        params_dtype=params_dtype,
    )


def expected_rows(config, dense_id: int) -> int:
    """Rows of one PLE layer's table from the config alone, as the preflight counts them:
    one prime per n-gram head (heads numbered across layers), padded."""
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding as E

    heads = (config.ngram_size - 1) * config.heads_per_ngram
    total = sum(
        E._nth_prime_after(config.ngram_vocab_size_base - 1, dense_id * heads + h + 1)
        for h in range(heads)
    )
    d = config.make_ngram_vocab_size_divisible_by
    return (total + d - 1) // d * d


def test_host_table_is_never_allocated_on_the_gpu(vllm_cpu, host_placement):
    from vllm.model_executor.model_loader.utils import device_loading_context

    config = text_config()
    spy = CudaStandIn()
    with spy, torch.device("cuda"):
        emb = build_embedding(config)
    weight = emb.ngram_embedding.weight
    rows = expected_rows(config, 0)
    table_bytes = rows * HEAD_DIM * 2
    assert tuple(weight.shape) == (rows, HEAD_DIM)
    # everything else of the layer was asked for on the GPU, as upstream: the spy works
    assert spy.cuda_bytes, "the stand-in saw no CUDA allocation at all"
    assert max(spy.cuda_bytes) < table_bytes, spy.cuda_bytes
    # the parameter is the device view of the registered host buffer, which holds the table
    host = weight.ple_host_table
    assert weight.device.type == "meta" and weight._vllm_is_uva_offloaded
    assert host.device.type == "cpu" and tuple(host.shape) == (rows, HEAD_DIM)
    ((ptr, nbytes),) = host_placement
    assert ptr == host.data_ptr() and nbytes >= table_bytes and ptr % 4096 == 0

    # loading: whole table, then a row shard; nothing goes to the GPU
    values = torch.randn(rows, HEAD_DIM).to(torch.bfloat16)
    with spy, torch.device("cuda"):
        emb.load_weights([("ngram_embedding.weight", values)])
    assert torch.equal(host, values)
    emb.split_ngram_parts = 4
    shard_rows = (rows + 3) // 4
    shard = torch.full((shard_rows, HEAD_DIM), 7.0, dtype=torch.bfloat16)
    with spy, torch.device("cuda"):
        emb.load_weights([("ngram_embedding.shard_1.weight", shard)])
    assert torch.equal(host[shard_rows : 2 * shard_rows], shard)
    assert torch.equal(host[:shard_rows], values[:shard_rows])
    assert max(spy.cuda_bytes) < table_bytes

    # process_weights_after_loading moves CPU parameters to the GPU and back; the table
    # must stay the same view of the same host memory
    with spy, device_loading_context(emb.ngram_embedding, torch.device("cuda")):
        pass
    assert emb.ngram_embedding.weight is weight and weight.device.type == "meta"
    assert max(spy.cuda_bytes) < table_bytes
    assert torch.equal(host[:shard_rows], values[:shard_rows])


def test_the_same_table_through_upstream_placement_is_allocated_on_the_gpu(vllm_cpu):
    """The spy above can fail: with VLLM_PLE_TABLE=gpu the table is a CUDA allocation."""
    config = text_config()
    spy = CudaStandIn()
    with spy, torch.device("cuda"):
        build_embedding(config)
    assert max(spy.cuda_bytes) == expected_rows(config, 0) * HEAD_DIM * 2


def test_each_ple_layer_has_its_own_table_size(vllm_cpu, host_placement):
    config = text_config()
    with CudaStandIn(), torch.device("cuda"):
        a, b = build_embedding(config, 0), build_embedding(config, 1)
    assert a.ngram_embedding.weight.shape[0] == expected_rows(config, 0)
    assert b.ngram_embedding.weight.shape[0] == expected_rows(config, 1)
    assert expected_rows(config, 0) != expected_rows(config, 1)


def test_fp8_table_keeps_its_scale_on_the_gpu_and_its_rows_on_the_host(vllm_cpu, host_placement):
    from vllm.models.qwen4_exp.nvidia import ple_layer

    config = text_config()
    spy = CudaStandIn()
    with contextlib.ExitStack() as stack:
        stack.enter_context(spy)
        stack.enter_context(torch.device("cuda"))
        emb = ple_layer.Qwen4ExpNGramEmbedding(
            config,
            16,
            0,
            max_total_tokens=32,
            max_num_reqs=4,
            prefix="p",
            layer_name="l",
            params_dtype=torch.bfloat16,
        )
        # same table built with the FP8 method the checkpoint's quant config selects
        fp8 = ple_layer.build_ple_table(
            lambda: ple_layer.PLEVocabParallelEmbedding(
                expected_rows(config, 0),
                HEAD_DIM,
                params_dtype=torch.bfloat16,
                padding_size=8,
                quant_method=ple_layer.Qwen4ExpPLEFp8EmbeddingMethod(),
            ),
            "of test layer",
        )
    del emb
    assert fp8.weight.dtype == torch.float8_e4m3fn
    assert fp8.weight.ple_host_table.device.type == "cpu"
    # the scale went where the layer was built (the stand-in GPU is the meta device here)
    assert fp8.weight_scale.device.type == "meta"
    assert type(fp8.weight).__name__ == "ModelWeightParameter"  # vLLM's class, loader kept
    assert fp8.weight.weight_loader.__self__ is fp8
    assert max(spy.cuda_bytes) < expected_rows(config, 0) * HEAD_DIM
    rows = torch.randn(expected_rows(config, 0), HEAD_DIM).to(torch.float8_e4m3fn)
    fp8.weight.weight_loader(fp8.weight, rows)
    assert torch.equal(fp8.weight.ple_host_table.view(torch.uint8), rows.view(torch.uint8))


def test_lookup_through_the_host_table_matches_the_table_in_device_memory(
    vllm_cpu, host_placement, monkeypatch
):
    """The loaded host table, read as the GPU would (its view), gives the same embeddings
    as the upstream placement loaded from the same checkpoint shards."""
    from vllm.models.qwen4_exp.common import ple

    config = text_config()
    monkeypatch.setattr(ple, "_device_view", lambda host: host)  # CPU: the view is the memory
    host_emb = build_embedding(config)
    monkeypatch.setenv("VLLM_PLE_TABLE", "gpu")
    ref_emb = build_embedding(config)
    rows = host_emb.ngram_embedding.weight.shape[0]
    parts = 3
    host_emb.split_ngram_parts = ref_emb.split_ngram_parts = parts
    size = (rows + parts - 1) // parts
    table = torch.randn(rows, HEAD_DIM).to(torch.bfloat16)
    shards = [
        (f"ngram_embedding.shard_{k}.weight", table[k * size : (k + 1) * size])
        for k in range(parts)
    ]
    host_emb.load_weights(shards)
    ref_emb.load_weights(shards)

    input_ids = torch.tensor([5, 9, 9, 0, 3, 7, 1], dtype=torch.long)
    query_start_loc = torch.tensor([0, 4, 7], dtype=torch.int32)
    context = torch.tensor([[0, 0], [11, 12]], dtype=torch.int32)

    # what forward() does, without the custom op that finds the layer in a forward context
    def lookup(emb):
        ids = emb.compute_ngram_ids(input_ids, query_start_loc, context)
        return emb.ngram_embedding(ids).flatten(-2)

    out, ref = lookup(host_emb), lookup(ref_emb)
    assert out.shape == (7, 16)
    assert torch.equal(out, ref)
    assert out.abs().sum() > 0


def error_text(fn) -> str:
    from vllm.models.qwen4_exp.common.ple import PLETableError

    with pytest.raises(PLETableError) as info:
        fn()
    return str(info.value)


def test_too_little_host_memory_is_refused_before_anything_is_pinned(
    vllm_cpu, host_placement, monkeypatch
):
    from vllm.models.qwen4_exp.common import ple

    config = text_config()
    table = expected_rows(config, 0) * HEAD_DIM * 2
    monkeypatch.setattr(ple, "_available_host_memory", lambda: (table // 2, "the test limit"))
    text = error_text(lambda: build_embedding(config))
    gib = 1 << 30
    assert f"needs {table / gib:.2f} GiB" in text
    assert f"only {table // 2 / gib:.2f} GiB is available (the test limit)" in text
    assert "VLLM_PLE_TABLE=gpu" in text and "VLLM_PLE_TABLE=host" in text
    assert host_placement == []


def test_a_refused_page_lock_names_the_memlock_limit_and_the_fix(
    vllm_cpu, host_placement, monkeypatch
):
    from vllm.models.qwen4_exp.common import ple

    monkeypatch.setattr(ple, "_cuda_host_register", lambda ptr, n: 2)
    text = error_text(lambda: build_embedding(text_config()))
    assert "cudaHostRegister error 2" in text
    assert "locked-memory limit" in text and "ulimit -l unlimited" in text
    assert "memlock: -1" in text and "VLLM_PLE_TABLE=gpu" in text


def test_host_placement_off_cuda_is_refused(vllm_cpu, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_TABLE", "host")
    text = error_text(lambda: build_embedding(text_config()))
    assert "needs an NVIDIA GPU" in text and "VLLM_PLE_TABLE=gpu" in text


def test_an_unknown_placement_is_refused(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_PLE_TABLE", "disk")
    with pytest.raises(ValueError, match="VLLM_PLE_TABLE"):
        envs.VLLM_PLE_TABLE  # noqa: B018


def test_start_up_logs_the_table_bytes_and_where_they_are(vllm_cpu, host_placement, caplog_vllm):
    config = text_config()
    with CudaStandIn(), torch.device("cuda"):
        build_embedding(config)
    rows = expected_rows(config, 0)
    nbytes = rows * HEAD_DIM * 2
    assert nbytes < (1 << 30) // 10  # a small table is shown in MiB, not as "0.00 GiB"
    line = (
        f"PLE n-gram table of PLE layer model.layers.0.ple: "
        f"{nbytes / (1 << 20):.2f} MiB ({rows} rows x {HEAD_DIM}, "
        "torch.bfloat16) in page-locked host memory, read by the GPU through UVA "
        "(VLLM_PLE_TABLE=host)"
    )
    assert line in caplog_vllm.text


@pytest.fixture
def caplog_vllm(caplog):
    """vLLM's loggers do not propagate to the root logger; capture them directly."""
    import logging

    logger = logging.getLogger("vllm")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="vllm")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
