# SPDX-License-Identifier: Apache-2.0
"""bench-ple-read's parts that need no GPU: the ids it gathers (one row per n-gram head per
token, each head within its own vocabulary) and the added time per token it reports. The
timings themselves come from a GPU host (docs/benchmarks.md).

    scripts/test tests/cpu/test_ple_read.py
"""

from __future__ import annotations

import pytest
import torch
from eodev import ple_read


def test_each_head_draws_from_its_own_rows():
    ranges = ple_read.head_ranges(1600, 16)
    assert ranges[0] == (0, 100) and ranges[-1] == (1500, 1600)
    ids = ple_read.draw_ids(512, ranges, torch.Generator().manual_seed(1), "cpu")
    assert ids.shape == (512, 16) and ids.dtype == torch.int64
    for h, (first, end) in enumerate(ranges):
        col = ids[:, h]
        assert int(col.min()) >= first and int(col.max()) < end
        assert col.unique().numel() > 90  # spread over the head's 100 rows, not one row


def test_the_added_time_per_token_is_the_difference_over_the_tokens():
    vram = {"median_ms": 0.010, "p90_ms": 0.012}
    host = {"median_ms": 0.050, "p90_ms": 0.080}
    got = ple_read.added_per_token(4, vram, host)
    assert got["added_us_per_token_median"] == pytest.approx(10.0)
    assert got["added_us_per_token_p90"] == pytest.approx(17.0)
    assert got["ratio_median"] == pytest.approx(5.0)


def test_a_table_smaller_than_its_heads_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    with pytest.raises(SystemExit, match="fewer rows than --heads 16"):
        ple_read.main(["--table-gib", "0.000001"])
