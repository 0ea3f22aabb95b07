# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp's PLE n-gram table read from the checkpoint file (VLLM_PLE_TABLE=file, auto),
against the patched vLLM on the CPU: a prompt's rows computed at arrival are upstream's n-gram
ids; rows gathered from a safetensors file equal the in-memory table's; the table is never
allocated nor read by the loader; the prefetch queue stays within its bounds, never blocks and
stops for a cancelled request; auto decides from given meminfo/cgroup figures; every bad
checkpoint is refused naming the file and the fix."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import numpy as np
import pytest
import torch
from test_qwen4exp_ple import (
    HEAD_DIM,
    CudaStandIn,
    build_embedding,
    caplog_vllm,  # noqa: F401 (fixture)
    expected_rows,
    text_config,
)
from vllm.models.qwen4_exp.common import ple_file as pf

GiB = 1 << 30
PREFIX = "model.layers.0.ple.ple_embedding.ngram_embedding"
CKPT = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"


def save(path, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def upstream_ids(emb, tokens, context=(0, 0)) -> np.ndarray:
    """What the forward computes for one request whose step holds `tokens`."""
    ids = emb.compute_ngram_ids(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor([0, len(tokens)], dtype=torch.int32),
        torch.tensor([list(context)], dtype=torch.int32),
    )
    return ids.reshape(-1).numpy()


# --- the rows of a prompt ------------------------------------------------------------------


@pytest.mark.parametrize("dense_id", [0, 1])
def test_prompt_rows_are_upstreams_ngram_ids(vllm_cpu, dense_id):
    emb = build_embedding(text_config(), dense_id)  # gpu placement: on the CPU here
    rows = pf.PromptRows(emb)
    prompt = [5, 9, 9, 0, 3, 7, 1, 60, 61, 0, 0, 12, 33]  # EOS (0) restarts n-grams
    want = upstream_ids(emb, prompt)
    assert np.array_equal(rows(prompt), want)
    assert len(set(want.tolist())) > 8  # not a constant
    # in chunks, with the tokens before each chunk as context, as chunked prefill runs it
    for cut in (1, 4, 7):
        head, tail = prompt[:cut], prompt[cut:]
        step = upstream_ids(emb, tail, context=([0, 0] + head)[-2:])
        assert np.array_equal(rows(tail, context=head), step)
        assert np.array_equal(np.concatenate([rows(head), rows(tail, context=head)]), want)


def test_prompt_rows_differ_per_layer(vllm_cpu):
    config = text_config()
    a, b = (pf.PromptRows(build_embedding(config, d)) for d in (0, 1))
    assert not np.array_equal(a([5, 9, 11]), b([5, 9, 11]))


# --- reading rows from the file ------------------------------------------------------------


def table(rows=1000, width=HEAD_DIM, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


def file_table(tmp_path, values, parts: int | None = None) -> pf.PLEFileTable:
    rows = values.shape[0]
    if parts is None:
        tensors = {f"{CKPT}.weight": values, "other.weight": torch.ones(3)}
    else:
        size = (rows + parts - 1) // parts
        tensors = {
            f"{CKPT}.shard_{k}.weight": values[k * size : (k + 1) * size] for k in range(parts)
        }
    # two files when sharded: shards 0.. in one, the rest in the other
    names = sorted(tensors)
    files = [
        save(tmp_path / "a.safetensors", {n: tensors[n] for n in names[: len(names) // 2 or 1]})
    ]
    if len(names) > 1:
        files.append(
            save(tmp_path / "b.safetensors", {n: tensors[n] for n in names[len(names) // 2 or 1 :]})
        )
    segments = pf.plan_segments(
        pf.table_tensors(files, PREFIX),
        rows=rows,
        width=values.shape[1],
        dtype=values.dtype,
        split_parts=parts or 1,
        what="of PLE layer test",
    )
    return pf.PLEFileTable(segments, width=values.shape[1], dtype=values.dtype, what="test")


@pytest.mark.parametrize("parts", [None, 3, 7])
def test_gather_equals_the_in_memory_table(vllm_cpu, tmp_path, parts):
    values = table()
    t = file_table(tmp_path, values, parts)
    ids = torch.tensor([[0, 999], [500, 1], [333, 334], [999, 0], [666, 667]])
    out = torch.empty(ids.shape[0], 2, HEAD_DIM, dtype=torch.bfloat16)
    pf.PLEFileLookup(t)(ids, out)
    assert torch.equal(out, torch.nn.functional.embedding(ids, values))
    # a larger step reuses (grows) the staging buffer and still matches
    many = torch.randint(0, 1000, (300, 2))
    out = torch.empty(300, 2, HEAD_DIM, dtype=torch.bfloat16)
    pf.PLEFileLookup(t)(many, out)
    assert torch.equal(out, torch.nn.functional.embedding(many, values))


def test_rows_past_the_table_read_as_zeros(vllm_cpu, tmp_path):
    """The padding rows the upstream loader zero-fills."""
    values = table(rows=100)
    t = file_table(tmp_path, values)
    out = np.full((3, t.row_bytes), 7, dtype=np.uint8)
    t.gather(np.array([5, 100, 120]), out)
    assert np.array_equal(out[0], values[5].view(torch.uint8).numpy()) and not out[1:].any()


def test_pages_are_the_rows_pages(vllm_cpu, tmp_path):
    values = table(rows=5000)  # 8 bytes a row: 512 rows a page
    t = file_table(tmp_path, values)
    [(fd, base)] = {(fd, b) for fd, b in t._offsets}
    pages = t.pages(np.array([0, 1, 511, 512, 4999]))
    want = sorted({(fd, (base + r * 8) // 4096 * 4096) for r in (0, 1, 511, 512, 4999)})
    assert pages == want
    assert t.read_pages(pages) == len(pages)
    assert t.missing_pages(np.array([0, 4999])) == (0, 2)  # just read: resident


# --- VLLM_PLE_TABLE=file through the layer ---------------------------------------------------


@pytest.fixture
def file_placement(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PLE_TABLE", "file")
    monkeypatch.delenv(pf.RESOLVED_ENV, raising=False)
    files: list[str] = []
    monkeypatch.setattr(pf, "model_files", lambda: files)
    return files


def test_file_table_is_never_allocated_and_reads_like_upstream(
    vllm_cpu, file_placement, tmp_path, monkeypatch
):
    config = text_config()
    rows = expected_rows(config, 0)
    spy = CudaStandIn()
    with spy, torch.device("cuda"):
        emb = build_embedding(config)
    weight = emb.ngram_embedding.weight
    assert weight.device.type == "meta" and tuple(weight.shape) == (rows, HEAD_DIM)
    assert max(spy.cuda_bytes) < rows * HEAD_DIM * 2  # the rest of the layer only
    emb = build_embedding(config)  # again on the CPU, to run its lookup here
    values = table(rows=rows, seed=3)
    file_placement.append(save(tmp_path / "model.safetensors", {f"{CKPT}.weight": values}))
    # the loader gets the checkpoint tensor but must not read it: a meta tensor would fail
    emb.load_weights([("ngram_embedding.weight", torch.empty(rows, HEAD_DIM, device="meta"))])
    assert emb.ngram_embedding.ple_file_lookup.table.rows == rows

    os.environ["VLLM_PLE_TABLE"] = "gpu"  # monkeypatched: restored after the test
    ref = build_embedding(config)
    ref.load_weights([("ngram_embedding.weight", values)])
    input_ids = torch.tensor([5, 9, 9, 0, 3, 7, 1], dtype=torch.long)
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    context = torch.tensor([[0, 0], [11, 12]], dtype=torch.int32)
    ids = emb.compute_ngram_ids(input_ids, qsl, context)
    out = torch.empty(7, emb.ngram_heads, HEAD_DIM, dtype=torch.bfloat16)
    emb.ngram_embedding.ple_file_lookup(ids, out)
    want = ref.ngram_embedding(ref.compute_ngram_ids(input_ids, qsl, context))
    assert torch.equal(out, want) and out.abs().sum() > 0

    # the layer's forward: one op computes the ids and reads the rows (outside CUDA graphs)
    from types import SimpleNamespace

    from vllm.models.qwen4_exp.nvidia import ple_layer

    layers = {}
    ctx = SimpleNamespace(no_compile_layers=layers)
    monkeypatch.setattr(ple_layer, "get_forward_context", lambda: ctx)
    layers[emb.layer_name] = SimpleNamespace(ple_embedding=emb)
    got = emb(input_ids, qsl, context)
    layers[emb.layer_name] = SimpleNamespace(ple_embedding=ref)
    assert torch.equal(got, ref(input_ids, qsl, context)) and got.shape == (7, 16)

    # the model state's prefetcher finds the table and reads a prompt's pages
    prefetcher = pf.prefetcher_for(torch.nn.ModuleDict({"ple": emb, "other": ref}))
    assert [t for t, _ in prefetcher.tables] == [emb.ngram_embedding.ple_file_lookup.table]
    assert prefetcher.submit("r1", [5, 9, 9, 0, 3])
    wait_until(lambda: prefetcher.pending_tokens == 0)
    assert prefetcher.counters.pages_read >= 1
    prefetcher.close()


def test_file_placement_logs_where_the_table_is(vllm_cpu, file_placement, caplog_vllm):  # noqa: F811
    build_embedding(text_config())
    assert "read from the checkpoint file through the page cache (VLLM_PLE_TABLE=file)" in (
        caplog_vllm.text
    )


# --- prefetching ------------------------------------------------------------------------------


class FakeTable:
    """Records the pages read ahead; a row is its own page."""

    def __init__(self):
        self.read: list[int] = []
        self.lock = threading.Lock()

    def will_need(self, ids):
        pages = np.unique(ids).tolist()
        with self.lock:
            self.read += pages
        return len(pages)


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_prefetch_reads_every_chunk_of_a_prompt():
    t = FakeTable()
    p = pf.PLEPrefetcher([(t, lambda toks, ctx: np.asarray(toks))], threads=2, chunk_tokens=4)
    assert p.submit("a", list(range(10)))
    wait_until(lambda: p.pending_tokens == 0)
    assert sorted(t.read) == list(range(10)) and p.counters.pages_read == 10
    p.close()


def test_prefetch_passes_the_tokens_before_each_chunk_as_context():
    seen = []
    p = pf.PLEPrefetcher(
        [(FakeTable(), lambda toks, ctx: seen.append((list(toks), list(ctx))) or np.asarray(toks))],
        threads=1,
        chunk_tokens=3,
        context_tokens=2,
    )
    p.submit("a", [1, 2, 3, 4, 5, 6, 7])
    wait_until(lambda: p.pending_tokens == 0)
    assert seen == [([1, 2, 3], []), ([4, 5, 6], [2, 3]), ([7], [5, 6])]
    p.close()


def blocked_prefetcher(**kw):
    """A prefetcher whose row computation waits for `gate`: jobs stay queued/running."""
    gate = threading.Event()
    started = threading.Event()
    t = FakeTable()

    def rows_of(toks, ctx):
        started.set()
        gate.wait(10)
        return np.asarray(toks)

    return pf.PLEPrefetcher([(t, rows_of)], **kw), t, gate, started


def test_submit_never_blocks_and_stays_within_its_bounds():
    p, t, gate, started = blocked_prefetcher(threads=1, max_jobs=2, max_pending_tokens=100)
    t0 = time.monotonic()
    assert p.submit("a", range(40))  # taken by the worker, which blocks
    started.wait(5)
    assert p.submit("b", range(40)) and p.submit("c", range(40))  # queue full now (2 jobs)
    assert p.pending_tokens == 100 and p.counters.tokens_dropped == 20  # c cut to 20 tokens
    assert not p.submit("d", range(10))  # no token room left
    assert p.counters.tokens_dropped == 30
    assert time.monotonic() - t0 < 1.0  # nothing waited on the blocked worker
    gate.set()
    wait_until(lambda: p.pending_tokens == 0)
    assert p.submit("e", range(5)) and p.submit("f", range(5))  # room again
    p.close()


def test_a_full_job_queue_drops_the_request_and_counts_it():
    p, _, gate, started = blocked_prefetcher(threads=1, max_jobs=1)
    p.submit("a", range(4))
    started.wait(5)
    assert p.submit("b", range(4))
    assert not p.submit("c", range(4))
    assert p.counters.requests_dropped == 1 and p.counters.tokens_dropped == 4
    gate.set()
    p.close()


def test_cancel_stops_a_request_between_chunks():
    p, t, gate, started = blocked_prefetcher(threads=1, chunk_tokens=10)
    p.submit("a", range(100))  # 10 chunks
    started.wait(5)  # first chunk in progress
    p.submit("b", range(5))  # queued behind it
    p.cancel("a")
    p.cancel("b")
    gate.set()
    wait_until(lambda: p.pending_tokens == 0)
    assert sorted(t.read) == list(range(10))  # a's first chunk only; nothing of b
    assert p.counters.requests_cancelled == 2
    # a request id submitted again later is read again
    p.submit("a", range(3))
    wait_until(lambda: p.pending_tokens == 0)
    assert sorted(t.read)[:3] == [0, 0, 1]
    p.close()


def test_cancelling_an_unknown_request_counts_nothing():
    p = pf.PLEPrefetcher([(FakeTable(), lambda toks, ctx: np.asarray(toks))], threads=1)
    p.cancel("never-submitted")
    assert p.counters.requests_cancelled == 0
    p.close()


def test_a_failing_read_does_not_stop_the_pool():
    calls = []

    def rows_of(toks, ctx):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("drive gone")
        return np.asarray(toks)

    t = FakeTable()
    p = pf.PLEPrefetcher([(t, rows_of)], threads=1)
    p.submit("a", [1])
    p.submit("b", [2])
    wait_until(lambda: p.pending_tokens == 0)
    assert t.read == [2]
    p.close()


# --- auto -------------------------------------------------------------------------------------


def fake_root(tmp_path, avail_gib, limit_gib=None, used_gib=1.0):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal: {512 * 1024**2} kB\nMemAvailable: {int(avail_gib * 1024**2)} kB\n"
    )
    cg = tmp_path / "sys" / "fs" / "cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("max\n" if limit_gib is None else f"{int(limit_gib * GiB)}\n")
    (cg / "memory.current").write_text(f"{int(used_gib * GiB)}\n")
    return str(tmp_path)


TABLE_BYTES = 320_001_536 * 160 * 2  # the target's table, 95.37 GiB


@pytest.mark.parametrize(
    "avail, limit, expected, source",
    [
        (200, None, "host", "MemAvailable"),
        (118.0, None, "file", "MemAvailable"),  # 107.37 GiB + 10% = 118.11 GiB
        (118.2, None, "host", "MemAvailable"),
        (200, 64, "file", "the container memory limit"),  # 63 GiB of room
        (200, 125, "host", "the container memory limit"),  # 124 GiB of room
    ],
)
def test_auto_against_meminfo_and_cgroup(tmp_path, avail, limit, expected, source):
    figures = pf.read_host_figures(fake_root(tmp_path, avail, limit))
    placement, why = pf.choose_placement(
        figures, table_bytes=TABLE_BYTES, host_expert_bytes=4 * GiB, reserve_bytes=8 * GiB
    )
    assert placement == expected and f"({source})" in why
    assert "n-gram tables 95.37 GiB + host experts 4.00 GiB + reserve 8.00 GiB, +10% = " in why
    # the preflight's rule gives the same answer for the same figures
    from eotools.ple_table import choose_placement as tool_rule

    room = figures.mem_available
    if figures.cgroup_limit is not None:
        room = min(room, figures.cgroup_limit - figures.cgroup_usage)
    assert tool_rule(room, TABLE_BYTES, 4 * GiB, 8 * GiB)[0] == expected


def test_cgroup_v2_without_a_limit_is_no_limit(tmp_path):
    figures = pf.read_host_figures(fake_root(tmp_path, 50))
    assert figures.cgroup_limit is None and figures.mem_available == 50 * GiB


def test_auto_decides_once_and_says_why(vllm_cpu, monkeypatch, caplog_vllm):  # noqa: F811
    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    monkeypatch.delenv(pf.RESOLVED_ENV, raising=False)
    monkeypatch.setattr(pf, "_on_cuda", lambda: True)
    monkeypatch.setenv("EO_HOST_BUDGET_GIB", "7.6")
    monkeypatch.setattr(pf, "read_host_figures", lambda: pf.HostFigures(64 * GiB))
    cfg = auto_config(pp=2)
    assert pf.resolve_placement(cfg) == "file"
    assert os.environ[pf.RESOLVED_ENV] == "file"
    assert "VLLM_PLE_TABLE=auto chose reading the checkpoint file (file)" in caplog_vllm.text
    # the target's table, 7.6 GiB per card x 2 of host experts: 118.94 GiB > 64 GiB
    assert "n-gram tables 95.37 GiB + host experts 15.20 GiB + reserve 8.00 GiB" in (
        caplog_vllm.text
    )
    # decided once: later calls (the workers) do not look at the host again
    monkeypatch.setattr(pf, "read_host_figures", lambda: pf.HostFigures(1 << 50))
    assert pf.resolve_placement(cfg) == "file"
    monkeypatch.delenv(pf.RESOLVED_ENV)


def test_file_mode_keeps_cuda_graphs_piecewise(monkeypatch):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv("VLLM_PLE_TABLE", "file")
    cc = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(ple_layer_ids=[1])),
        compilation_config=cc,
    )
    pf.configure(cfg)
    assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
    monkeypatch.setenv("VLLM_PLE_TABLE", "host")
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    pf.configure(cfg)
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


# --- bad input ------------------------------------------------------------------------------


def refused(fn) -> str:
    with pytest.raises(pf.PLEFileError) as e:
        fn()
    return str(e.value)


def plan(files, rows=1000, dtype=torch.bfloat16, parts=1):
    return pf.plan_segments(
        pf.table_tensors(files, PREFIX),
        rows=rows,
        width=HEAD_DIM,
        dtype=dtype,
        split_parts=parts,
        what="of PLE layer L",
    )


FIX = "re-download or re-convert the checkpoint"


def test_a_missing_table_is_refused(tmp_path):
    f = save(tmp_path / "m.safetensors", {"model.norm.weight": torch.ones(4)})
    text = refused(lambda: plan([f]))
    assert "no n-gram table of PLE layer L" in text and FIX in text


def test_a_table_of_another_shape_or_dtype_is_refused(tmp_path):
    f = save(tmp_path / "m.safetensors", {f"{CKPT}.weight": table(rows=999)})
    text = refused(lambda: plan([f]))
    assert f.endswith("m.safetensors") and f in text and "has shape [999, 4]" in text
    assert "expects [1000, 4]" in text and FIX in text
    g = save(tmp_path / "n.safetensors", {f"{CKPT}.weight": table().float()})
    text = refused(lambda: plan([g]))
    assert (
        g in text
        and "is F32, the model reads the n-gram table of PLE layer L as torch.bfloat16" in text
    )


def test_missing_row_shards_are_refused(tmp_path):
    values = table()
    size = 250
    f = save(
        tmp_path / "m.safetensors",
        {f"{CKPT}.shard_{k}.weight": values[k * size : (k + 1) * size] for k in (0, 1, 3)},
    )
    text = refused(lambda: plan([f], parts=4))
    assert "misses rows 500..749 (a shard file is missing?)" in text and FIX in text


def test_a_truncated_file_is_refused(tmp_path):
    f = save(tmp_path / "m.safetensors", {f"{CKPT}.weight": table()})
    segments = plan([f])
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    text = refused(
        lambda: pf.PLEFileTable(segments, width=HEAD_DIM, dtype=torch.bfloat16, what="L")
    )
    assert f"{f}: the file is truncated" in text and FIX in text


def test_a_truncated_header_is_refused(tmp_path):
    f = tmp_path / "m.safetensors"
    f.write_bytes(struct.pack("<Q", 1000) + json.dumps({}).encode())
    text = refused(lambda: pf.read_safetensors_header(str(f)))
    assert f"{f}: the safetensors header is truncated" in text and FIX in text


def test_a_file_that_cannot_be_mapped_is_refused(tmp_path, monkeypatch):
    f = save(tmp_path / "m.safetensors", {f"{CKPT}.weight": table()})
    segments = plan([f])

    def refuse(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(pf.mmap, "mmap", refuse)
    text = refused(
        lambda: pf.PLEFileTable(segments, width=HEAD_DIM, dtype=torch.bfloat16, what="L")
    )
    assert (
        f"{f}: cannot be memory-mapped" in text and "copy the checkpoint to a local drive" in text
    )


def test_no_safetensors_files_is_refused(tmp_path):
    text = refused(lambda: pf.checkpoint_files(str(tmp_path)))
    assert str(tmp_path) in text and "has no .safetensors file" in text


def test_a_slow_drive_is_a_start_up_warning(caplog_vllm, monkeypatch):  # noqa: F811
    monkeypatch.setenv("VLLM_PLE_PREFETCH_THREADS", "8")
    pf.check_read_rate(5000.0, "/models/m/model.safetensors")
    assert "random 4 KiB reads/s" not in caplog_vllm.text
    pf.check_read_rate(150.0, "/models/m/model.safetensors")
    text = caplog_vllm.text
    assert "the drive holding /models/m/model.safetensors served 150 random 4 KiB reads/s" in text
    # 8192 x 16 rows at 150 reads/s at queue depth 1: about 874 s, whatever the threads
    assert "take up to about 874 s to read before its prefill" in text
    assert "Put the checkpoint on an SSD" in text and "VLLM_PLE_TABLE=host" in text


def test_the_compile_cache_key_tells_autos_choices_apart(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    monkeypatch.setenv(pf.RESOLVED_ENV, "host")
    host = envs.compile_factors()
    monkeypatch.setenv(pf.RESOLVED_ENV, "file")
    assert envs.compile_factors() != host
    monkeypatch.setenv("VLLM_PLE_PREFETCH_THREADS", "3")
    monkeypatch.setenv("VLLM_PLE_FILE_EVICT", "1")
    factors = envs.compile_factors()
    assert "VLLM_PLE_PREFETCH_THREADS" not in factors and "VLLM_PLE_FILE_EVICT" not in factors


def test_evict_drops_the_tables_pages(vllm_cpu, tmp_path):
    """VLLM_PLE_FILE_EVICT's cold start; /tmp on a disk here (tmpfs has no cache to drop)."""
    values = table(rows=20000)  # 160 KB: 40 pages
    t = file_table(tmp_path, values)
    os.sync()  # written pages are dirty until then, and dirty pages are not dropped
    t.read_pages(t.pages(np.arange(20000)))
    assert t.missing_pages(np.arange(0, 20000, 512)) == (0, 40)
    t.evict()
    assert t.missing_pages(np.arange(0, 20000, 512)) == (40, 40)


def test_lookups_count_the_pages_a_forward_missed(vllm_cpu, tmp_path, monkeypatch, caplog_vllm):  # noqa: F811
    values = table(rows=20000)  # 8-byte rows: every 512th row on a page of its own
    t = file_table(tmp_path, values)
    os.sync()
    t.evict()
    monkeypatch.setattr(pf, "LOG_EVERY_S", 0.0)
    lookup = pf.PLEFileLookup(t)
    ids = torch.arange(0, 20000, 512).reshape(-1, 1)  # 40 rows on 40 pages
    out = torch.empty(40, 1, HEAD_DIM, dtype=torch.bfloat16)
    lookup(ids, out)
    assert (lookup.counters.gather_pages_missed, lookup.counters.gather_pages_checked) == (40, 40)
    lookup(ids, out)  # now in the page cache
    assert (lookup.counters.gather_pages_missed, lookup.counters.gather_pages_checked) == (40, 80)
    assert torch.equal(out, torch.nn.functional.embedding(ids, values))
    assert "2 lookups; 40 of 80 sampled row pages were not in the page cache" in caplog_vllm.text


def test_the_prefetcher_logs_its_counters(monkeypatch, caplog_vllm):  # noqa: F811
    monkeypatch.setattr(pf, "LOG_EVERY_S", 0.0)
    p = pf.PLEPrefetcher([(FakeTable(), lambda toks, ctx: np.asarray(toks))], threads=1)
    p.submit("a", [1, 2, 3])
    wait_until(lambda: "PLE prefetch: 1 requests, 3 pages read ahead" in caplog_vllm.text)
    p.close()


def test_the_model_state_prefetches_at_arrival_and_cancels_on_removal():
    from types import SimpleNamespace

    from test_qwen4exp_pp import model_state, vllm_config

    state = model_state(vllm_config(pp=1))
    assert state._ple_prefetcher() is None  # no table read from file in this model

    class Recorder:
        def __init__(self):
            self.calls = []

        def submit(self, req_id, tokens, start=0):
            self.calls.append(("submit", req_id, list(tokens), start))

        def cancel(self, req_id):
            self.calls.append(("cancel", req_id))

    state._ple_prefetch = rec = Recorder()
    new = SimpleNamespace(
        req_id="r1",
        prompt_token_ids=[5, 9, 11],
        prefill_token_ids=[5, 9, 11],
        mm_features=[],
        num_computed_tokens=0,
    )
    state.add_request(0, new)
    state.remove_request("r1")
    assert rec.calls == [("submit", "r1", [5, 9, 11], 0), ("cancel", "r1")]
    # prefix-cached tokens are computed already: the prefetch starts after them
    rec.calls.clear()
    state.add_request(0, SimpleNamespace(**{**vars(new), "num_computed_tokens": 2}))
    assert rec.calls == [("submit", "r1", [5, 9, 11], 2)]


def test_prompt_rows_are_safe_from_many_threads(vllm_cpu):
    """The prefetch threads share one PromptRows per layer: each call's buffers are its own."""
    emb = build_embedding(text_config(), 0)
    rows = pf.PromptRows(emb)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 60, size=int(rng.integers(1, 200))).tolist() for _ in range(40)]
    want = [rows(p) for p in prompts]
    errors: list[BaseException] = []
    wrong: list[int] = []
    start = threading.Barrier(8)

    def work(seed):
        start.wait()
        for i in np.random.default_rng(seed).permutation(len(prompts)):
            try:
                if not np.array_equal(rows(prompts[i]), want[i]):
                    wrong.append(int(i))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong


# --- review fixes: lookups over many shards, readahead, cancel by job, auto, headers --------


class CountingViews(list):
    """A table's per-segment views, counting the segments a gather touches."""

    touched = 0

    def __getitem__(self, k):
        CountingViews.touched += 1
        return super().__getitem__(k)


def test_many_shards_read_the_same_and_work_by_the_segments_hit(vllm_cpu, tmp_path, monkeypatch):
    """512 shards (upstream's split_ngram_parts): same rows and pages as one tensor, and a
    gather touches the segments its ids hit, not every segment."""
    values = table(rows=2048, width=4)
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = file_table(tmp_path / "one", values)
    many = file_table(tmp_path / "many", values, parts=512)
    assert len(many._views) == 512
    ids = np.array([5, 2047, 4, 1024, 7, 2048, -1, 6, 1025], dtype=np.int64)  # 3 segments
    out_one = np.empty((ids.size, one.row_bytes), np.uint8)
    out_many = np.empty_like(out_one)
    one.gather(ids, out_one)
    many._views = CountingViews(many._views)
    CountingViews.touched = 0
    scans = []  # whole-array passes: one per segment before the fix (512 here)
    real_nonzero = np.nonzero
    monkeypatch.setattr(np, "nonzero", lambda a: scans.append(1) or real_nonzero(a))
    many.gather(ids, out_many)
    many.pages(ids)
    many.missing_pages(ids)
    monkeypatch.undo()
    assert np.array_equal(out_one, out_many)
    assert CountingViews.touched == 3  # segments 1 (4..7), 256 (1024, 1025), 511 (2047)
    assert len(scans) <= 8  # a few passes over the ids, whatever the segment count
    want = torch.nn.functional.embedding(torch.tensor(np.clip(ids, 0, 2047)), values)
    got = torch.from_numpy(out_many).view(torch.bfloat16).reshape(ids.size, 4)
    valid = torch.tensor((ids >= 0) & (ids < 2048))
    assert torch.equal(got[valid], want[valid]) and not got[~valid].any()

    # pages: each row's page(s), the same set however the table is split into tensors
    def brute(t):
        out = set()
        for i in ids[(ids >= 0) & (ids < 2048)]:
            k = int(np.searchsorted(t._starts, i, side="right") - 1)
            fd, base = t._offsets[k]
            first = base + (int(i) - int(t._starts[k])) * t.row_bytes
            for p in range(first // pf.PAGE, (first + t.row_bytes - 1) // pf.PAGE + 1):
                out.add((fd, p * pf.PAGE))
        return sorted(out)

    for t in (one, many):
        assert t.pages(ids) == brute(t)
        assert t.missing_pages(ids)[1] == len(brute(t))


def test_readahead_asks_the_kernel_once_per_run_of_pages(vllm_cpu, tmp_path, monkeypatch):
    values = table(rows=40000, width=HEAD_DIM)  # 8-byte rows: 512 a page
    t = file_table(tmp_path, values, parts=3)
    calls = []
    monkeypatch.setattr(pf.os, "posix_fadvise", lambda *a: calls.append(a))
    ids = np.concatenate([np.arange(0, 2000), [20000, 39999, 39998]])  # 0..1999: 4-5 pages
    n = t.will_need(ids)
    assert n == len(t.pages(ids))
    assert all(c[3] == os.POSIX_FADV_WILLNEED for c in calls)
    advised = sorted((fd, off + i) for fd, off, ln, _ in calls for i in range(0, ln, pf.PAGE))
    assert advised == t.pages(ids)  # every page, once
    assert len(calls) == len(t.page_runs(ids)) < n  # adjacent pages merged into runs
    assert len(calls) == 3  # rows 0..1999 (in shard 0), 20000, 39998..39999


def test_prefetch_starts_after_the_computed_tokens(vllm_cpu):
    seen = []
    p = pf.PLEPrefetcher(
        [(FakeTable(), lambda toks, ctx: seen.append((list(toks), list(ctx))) or np.asarray(toks))],
        threads=1,
        chunk_tokens=3,
        context_tokens=2,
        max_pending_tokens=4,
    )
    p.submit("a", [1, 2, 3, 4, 5, 6, 7, 8], start=3)  # 3 prefix-cached; 4 of 5 fit the bound
    wait_until(lambda: p.pending_tokens == 0)
    assert seen == [([4, 5, 6], [2, 3]), ([7], [5, 6])]
    assert p.counters.tokens_dropped == 1
    p.close()


def test_re_adding_a_request_stops_its_old_job_and_runs_the_new_one():
    """A streaming update removes and re-adds a request: the old job stops, the new one runs
    to its end (cancel is by job, so the re-add never revives the stale job)."""
    p, t, gate, started = blocked_prefetcher(threads=1, chunk_tokens=10)
    p.submit("a", range(100))  # 10 chunks; the worker blocks in the first
    started.wait(5)
    p.cancel("a")  # remove_request
    p.submit("a", range(1000, 1030))  # add_request with the updated prompt: 3 chunks
    gate.set()
    wait_until(lambda: p.pending_tokens == 0)
    old = [r for r in t.read if r < 100]
    new = [r for r in t.read if r >= 1000]
    assert old == list(range(10))  # the first chunk only
    assert new == list(range(1000, 1030))  # all of the new job
    assert p.counters.requests_cancelled == 1
    # a re-add without a removal in between also makes the older job stale
    gate.clear()
    started.clear()
    t.read.clear()
    p.submit("b", range(100))
    started.wait(5)
    p.submit("b", range(2000, 2010))
    gate.set()
    wait_until(lambda: p.pending_tokens == 0)
    assert sorted(t.read) == [*range(10), *range(2000, 2010)]
    assert p.counters.requests_cancelled == 2  # the stale job counts as cancelled
    p.close()


def auto_config(quant=None, pp=1):
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=text_config(
                ngram_vocab_size_base=20_000_000,
                ple_layer_ids=[1],
                hidden_size=2560,
                ple_embed_dim=2560,
                heads_per_ngram=8,
                make_ngram_vocab_size_divisible_by=128,
            ),
            dtype=torch.bfloat16,
            quantization=quant,
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=1),
    )


def test_auto_counts_an_fp8_table_at_one_byte(vllm_cpu, monkeypatch, caplog_vllm):  # noqa: F811
    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    monkeypatch.delenv(pf.RESOLVED_ENV, raising=False)
    monkeypatch.delenv("EO_HOST_BUDGET_GIB", raising=False)
    monkeypatch.setattr(pf, "_on_cuda", lambda: True)
    monkeypatch.setattr(pf, "_told", set())
    # 47.68 GiB (FP8) + 8 GiB reserve, +10% = 61.3 GiB fits 64 GiB; BF16 (95.37) would not
    monkeypatch.setattr(pf, "read_host_figures", lambda: pf.HostFigures(64 * GiB))
    assert pf.resolve_placement(auto_config(quant="fp8")) == "host"
    assert "n-gram tables 47.68 GiB + host experts 0.00 GiB" in caplog_vllm.text
    monkeypatch.delenv(pf.RESOLVED_ENV)
    assert pf.resolve_placement(auto_config()) == "file"
    assert "n-gram tables 95.37 GiB" in caplog_vllm.text
    # an HF quantization_config says fp8 where model_config.quantization is not set yet
    from types import SimpleNamespace

    cfg = auto_config()
    cfg.model_config.quantization = None
    cfg.model_config.hf_config = SimpleNamespace(quantization_config={"quant_method": "fp8"})
    assert pf.table_element_bytes(cfg.model_config) == 1
    monkeypatch.delenv(pf.RESOLVED_ENV)


def test_auto_honours_the_start_programs_decision(vllm_cpu, monkeypatch, caplog_vllm):  # noqa: F811
    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    monkeypatch.setattr(pf, "_on_cuda", lambda: True)
    monkeypatch.setattr(pf, "_told", set())

    def no_figures():
        raise AssertionError("the host is not looked at again")

    monkeypatch.setattr(pf, "read_host_figures", no_figures)
    for decided in ("host", "file"):
        monkeypatch.setenv(pf.RESOLVED_ENV, decided)
        assert pf.resolve_placement(auto_config()) == decided
        assert pf.resolve_placement(auto_config()) == decided
        assert caplog_vllm.text.count(f"VLLM_PLE_TABLE=auto is {decided}, as decided") == 1


def test_auto_is_gpu_off_cuda(vllm_cpu, monkeypatch, caplog_vllm):  # noqa: F811
    """ROCm (or any platform without CUDA host registration): upstream's placement."""
    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    monkeypatch.setenv(pf.RESOLVED_ENV, "file")  # even where one was exported
    monkeypatch.setattr(pf, "_on_cuda", lambda: False)
    monkeypatch.setattr(pf, "_told", set())
    assert pf.resolve_placement(auto_config()) == "gpu"
    assert pf.resolve_placement(auto_config()) == "gpu"
    assert caplog_vllm.text.count("VLLM_PLE_TABLE=auto keeps them in VRAM (gpu)") == 1


def write_header(path, header, length=None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw)
    return str(path)


@pytest.mark.parametrize(
    "header, length, says",
    [
        ({}, 1 << 40, "declares a 1099511627776-byte safetensors header"),
        ([1, 2], None, "not a JSON object"),
        ({"t": 5}, None, "entry 't' is not an object"),
        ({"t": {"dtype": 3, "shape": [1], "data_offsets": [0, 2]}}, None, "no dtype string"),
        ({"t": {"dtype": "BF16", "shape": "1x2", "data_offsets": [0, 2]}}, None, "shape '1x2'"),
        ({"t": {"dtype": "BF16", "shape": [1, -2], "data_offsets": [0, 2]}}, None, "shape [1, -2]"),
        ({"t": {"dtype": "BF16", "shape": [1]}}, None, "data_offsets None"),
        ({"t": {"dtype": "BF16", "shape": [1], "data_offsets": [4, 2]}}, None, "[4, 2]"),
        ({"t": {"dtype": "BF16", "shape": [1], "data_offsets": [0, "2"]}}, None, "[0, '2']"),
        (b"[" * 100000, None, "not JSON"),
    ],
)
def test_a_corrupt_header_is_refused_naming_the_file(tmp_path, header, length, says):
    f = write_header(tmp_path / "bad.safetensors", header, length)
    text = refused(lambda: pf.read_safetensors_header(f))
    assert f in text and says in text and FIX in text


def test_the_file_list_is_the_loaders(tmp_path, monkeypatch):
    """Only the files model.safetensors.index.json names (as the default loader keeps them);
    a hub id is looked up in --download-dir."""
    for name in ("model-1.safetensors", "model-2.safetensors", "consolidated.safetensors"):
        save(tmp_path / name, {"x": torch.ones(1)})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    )
    assert pf.checkpoint_files(str(tmp_path)) == [
        str(tmp_path / "model-1.safetensors"),
        str(tmp_path / "model-2.safetensors"),
    ]
    import huggingface_hub

    seen = {}

    def fake_download(repo, **kw):
        seen.update(kw, repo=repo)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert len(pf.checkpoint_files("org/m", "main", "/data/hf")) == 2
    assert seen == {
        "repo": "org/m",
        "revision": "main",
        "cache_dir": "/data/hf",
        "local_files_only": True,
    }
