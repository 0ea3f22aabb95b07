# SPDX-License-Identifier: Apache-2.0
"""Decode prefetch's two kernels (the series' expert_offload/decode_prefetch.py) on the CPU,
through Triton's interpreter, against their torch references: the mark kernel (which host rows
a batch of picks needs, each appended once, the counters) and the copy kernel (those rows'
words, past the table's VRAM part only, by a fixed number of programs looping over the work).

Triton fixes the interpreter mode when it is first imported, so these checks run in a
process of their own, started by tests/cpu/test_decode_prefetch.py with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "run through tests/cpu/test_decode_prefetch.py (or with TRITON_INTERPRET=1 set "
        "before Python starts): Triton fixes the interpreter mode when it is first imported"
    )
from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch as dp  # noqa: E402

assert type(dp._mark_kernel).__name__ == "InterpretedFunction", "not interpreted"


def _marks(host_rows: int) -> dp.Marks:
    return dp.Marks(
        marks=torch.zeros(host_rows, dtype=torch.int32),
        todo=torch.full((host_rows,), -7, dtype=torch.int32),
        count=torch.zeros(1, dtype=torch.int32),
        counters=torch.zeros(len(dp.COUNTERS), dtype=torch.int64),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mark_kernel_matches_its_reference(seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    # more picks than one block holds (two passes of the kernel's loop) for some seeds
    tokens = (3 + seed) * (40 if seed % 2 else 1)
    rows = dp.HostRows(gpu_rows=25, table_rows=40 + seed, row_bytes=96)
    host_rows = rows.table_rows - rows.gpu_rows
    experts = rows.table_rows
    expert_to_row = torch.randperm(experts, generator=g).to(torch.int32)
    # the guess: expert ids through the map; the picks: table rows, some repeated, with
    # ids outside the table mixed in
    guess = torch.randint(0, experts, (2, 8), generator=g).to(dtype)
    picks = torch.randint(-2, rows.table_rows + 2, (tokens, 8), generator=g).to(dtype)
    got, want = _marks(host_rows), _marks(host_rows)
    guessed = {}
    for m, mark in ((got, dp.launch_mark), (want, dp.mark_rows_reference)):
        m.count.fill_(5)  # whatever it held: each launch sets it
        mark(guess, rows, m, dp.GUESSED, expert_to_row)
        guessed[id(m)] = m.todo[: int(m.count)].tolist()
        mark(picks, rows, m, dp.FETCHED)
    assert int(want.counters[0]) > 0 and int(want.counters[1]) > 0, "should guess and miss"
    # the same rows to copy, each once (their order is the kernel's), and the same marks
    # and counters
    assert sorted(guessed[id(got)]) == sorted(guessed[id(want)])
    assert len(set(guessed[id(got)])) == len(guessed[id(got)])
    assert int(got.count) == int(want.count)
    n = int(want.count)
    assert sorted(got.todo[:n].tolist()) == sorted(want.todo[:n].tolist())
    assert len(set(got.todo[:n].tolist())) == n
    assert torch.equal(got.marks, want.marks)
    assert torch.equal(got.counters, want.counters)


@pytest.mark.parametrize("programs", [1, 3, 16])
def test_copy_kernel_matches_its_reference(programs: int) -> None:
    g = torch.Generator().manual_seed(programs)
    rows_total, gpu_rows = 12, 7
    parts_got, parts_want = [], []
    # rows smaller than a program's block (row 7 straddles the VRAM part: its first two
    # words are VRAM), and rows larger than one
    wide = dp._COPY_WORDS + 9
    for row_words, gpu_words in ((5, gpu_rows * 5 + 2), (wide, gpu_rows * wide)):
        src = torch.randint(-(2**62), 2**62, (rows_total * row_words,), generator=g)
        for parts in (parts_got, parts_want):
            dst = torch.full_like(src, -1)
            part = dp.CopyPart(src=src, dst=dst, row_words=row_words, gpu_words=gpu_words)
            parts.append(part)
    m = _marks(5)
    m.todo.copy_(torch.tensor([11, 7, 9, 0, 0], dtype=torch.int32))  # two beyond the count
    m.count.fill_(3)
    dp.launch_copy(m, parts_got, programs)
    dp.copy_rows_reference(m, parts_want)
    for a, b in zip(parts_got, parts_want, strict=True):
        assert torch.equal(a.dst, b.dst)
        assert torch.equal(a.dst[: a.gpu_words], torch.full_like(a.dst[: a.gpu_words], -1))
        w = a.row_words
        for r in (11, 9):
            assert torch.equal(a.dst[r * w : (r + 1) * w], a.src[r * w : (r + 1) * w])
        lo = max(7 * w, a.gpu_words)
        assert torch.equal(a.dst[lo : 8 * w], a.src[lo : 8 * w])
