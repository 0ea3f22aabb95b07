# SPDX-License-Identifier: Apache-2.0
"""Decode prefetch's kernels on a GPU: the mark and copy kernels against their torch
references with the table's host rows in host memory (a VMM range, as one table makes
them), the two inside a CUDA graph whose replays see other picks, and, marked `measurement`
(run with --measurements), the copy kernel's rate from host memory with the guess's
bounded programs and with the fallback's. The engine test (one table + swap + staging +
prefetch against unpatched) is in test_offload_correctness.py.

    scripts/test-gpu tests/gpu/test_decode_prefetch_gpu.py -rA -s [--measurements]
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch as dp
from vllm.model_executor.layers.fused_moe.expert_offload import vmm

if os.environ.get("TRITON_INTERPRET") == "1" and torch.cuda.is_available():
    raise RuntimeError("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels (unset it)")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS, GPU_BYTES = 64, 4 << 20
ROW_BYTES = 2_534_400  # one INT4 expert of the target geometry (w13 and w2 together)


@pytest.fixture
def table():
    """ROWS rows: the first in VRAM (GPU_BYTES rounded to the granularity, so one row
    straddles), the rest in host memory; filled with a pattern; and a VRAM copy target
    of the same layout."""
    with vmm.SplitTable(ROWS, ROW_BYTES, gpu_bytes=GPU_BYTES, device=0) as t:
        words = ROWS * ROW_BYTES // 8
        src = t.view(torch.int64, (words,))
        src.copy_(torch.arange(words, dtype=torch.int64, device="cuda") * 7919 + 13)
        dst = torch.full((words,), -1, dtype=torch.int64, device="cuda")
        part = dp.CopyPart(src=src, dst=dst, row_words=ROW_BYTES // 8, gpu_words=t.gpu_bytes // 8)
        yield t, part
        del src, part


def _marks(host_rows: int, device: str) -> dp.Marks:
    return dp.Marks(
        marks=torch.zeros(host_rows, dtype=torch.int32, device=device),
        todo=torch.zeros(host_rows, dtype=torch.int32, device=device),
        count=torch.zeros(1, dtype=torch.int32, device=device),
        counters=torch.zeros(len(dp.COUNTERS), dtype=torch.int64, device=device),
    )


def test_mark_kernel_matches_its_reference():
    g = torch.Generator().manual_seed(0)
    rows = dp.HostRows(gpu_rows=300, table_rows=512, row_bytes=ROW_BYTES)
    for tokens in (1, 4, 16, 64):
        picks = torch.randint(-1, 513, (tokens, 10), generator=g, dtype=torch.int32)
        guess = torch.randint(0, 512, (tokens, 10), generator=g)  # expert ids, int64
        expert_to_row = torch.randperm(512, generator=g).to(torch.int32)
        done = {}
        for device in ("cuda", "cpu"):
            m = _marks(512 - 300, device)
            dp.mark_rows(guess.to(device), rows, m, dp.GUESSED, expert_to_row.to(device))
            dp.mark_rows(picks.to(device), rows, m, dp.FETCHED)
            done[device] = dp.Marks(*(t.cpu() for t in (m.marks, m.todo, m.count, m.counters)))
        a, b = done["cuda"], done["cpu"]
        assert torch.equal(a.marks, b.marks) and torch.equal(a.counters, b.counters)
        assert torch.equal(a.count, b.count)
        n = int(b.count)
        # the same rows to copy, each once (which of a row's repeated picks claims it,
        # and so the order, is the GPU's)
        got = a.todo[:n].tolist()
        assert sorted(got) == sorted(b.todo[:n].tolist()) and len(set(got)) == n


def test_copy_kernel_copies_host_rows_past_the_vram_part(table):
    t, part = table
    first_host = t.gpu_bytes // ROW_BYTES  # straddles: its first bytes are VRAM
    rows = [ROWS - 1, first_host, first_host + 3]
    m = _marks(ROWS, "cuda")
    m.todo[:3] = torch.tensor(rows, dtype=torch.int32)
    m.count.fill_(3)
    for programs in (16, dp._FALLBACK_PROGRAMS):
        part.dst.fill_(-1)
        dp.copy_rows(m, [part], programs)
        torch.cuda.synchronize()
        w = part.row_words
        for r in rows:
            lo = max(r * w, part.gpu_words)
            assert torch.equal(part.dst[lo : (r + 1) * w], part.src[lo : (r + 1) * w])
        assert bool((part.dst[: part.gpu_words] == -1).all())  # the VRAM part: untouched
        copied = sum((r + 1) * w - max(r * w, part.gpu_words) for r in rows)
        assert int((part.dst != -1).sum()) == copied  # nothing else


def test_mark_and_copy_in_a_cuda_graph_follow_each_replays_picks(table):
    t, part = table
    gpu_rows = -(-t.gpu_bytes // ROW_BYTES)  # whole rows in VRAM only
    picks = torch.zeros(4, 8, dtype=torch.int32, device="cuda")
    m = _marks(ROWS - gpu_rows, "cuda")
    rows = dp.HostRows(gpu_rows=gpu_rows, table_rows=ROWS, row_bytes=ROW_BYTES)

    def step() -> None:
        m.marks.zero_()
        m.count.zero_()
        dp.mark_rows(picks, rows, m, dp.FETCHED)
        dp.copy_rows(m, [part], dp._FALLBACK_PROGRAMS)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        new = torch.randint(0, ROWS, (4, 8), generator=g, dtype=torch.int32)
        picks.copy_(new)
        part.dst.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        host = sorted({r for r in new.reshape(-1).tolist() if r >= gpu_rows})
        assert int(m.count) == len(host)
        w = part.row_words
        for r in host:
            assert torch.equal(part.dst[r * w : (r + 1) * w], part.src[r * w : (r + 1) * w])


@pytest.mark.measurement
def test_measure_copy_rate_from_host_memory(table):
    """The copy kernel moving 8 host rows (20 MB) into VRAM, with the guess's programs
    and the fallback's: the rate the overlap has to hide."""
    t, part = table
    gpu_rows = -(-t.gpu_bytes // ROW_BYTES)
    m = _marks(8, "cuda")
    m.todo.copy_(torch.arange(gpu_rows, gpu_rows + 8, dtype=torch.int32, device="cuda"))
    m.count.fill_(8)
    for programs in (4, 16, 32, dp._FALLBACK_PROGRAMS):
        dp.copy_rows(m, [part], programs)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dp.copy_rows(m, [part], programs)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / 10
        print(
            f"copy 8 host rows ({8 * ROW_BYTES:,} B) with {programs} programs: {us:.1f} us, "
            f"{8 * ROW_BYTES / us / 1000:.1f} GB/s"
        )
        w = part.row_words
        assert torch.equal(
            part.dst[gpu_rows * w : (gpu_rows + 8) * w], part.src[gpu_rows * w : (gpu_rows + 8) * w]
        )
