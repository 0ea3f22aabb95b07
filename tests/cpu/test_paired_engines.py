# SPDX-License-Identifier: Apache-2.0
"""gpu_harness.run_engine_pair and engine_probe.Baton on the CPU, with a stand-in probe: the
two engines time their requests in turns (never at once), the leader starts only when the
follower has started too, and a partner that finishes early leaves the other running alone.

    scripts/test tests/cpu/test_paired_engines.py
"""

from __future__ import annotations

import pathlib
import sys

import pytest

FAKE = pathlib.Path(__file__).with_name("fake_engine_probe.py")


def _pair(tmp_path, monkeypatch, leader_requests, follower_requests, follower_startup):
    from eotools import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    return gh.run_engine_pair(
        ("lead", {"requests": leader_requests, "startup_s": 0.0}, False),
        ("follow", {"requests": follower_requests, "startup_s": follower_startup}, False),
        timeout=120,
        probe=[sys.executable, str(FAKE)],
    )


def test_turns_alternate_and_never_overlap(tmp_path, monkeypatch):
    lead, follow = _pair(tmp_path, monkeypatch, 4, 4, 0.5)
    # the leader waits for the follower's start-up before its first request
    assert lead["spans"][0][0] >= follow["started"]
    spans = sorted(
        [(a, b, "L") for a, b in lead["spans"]] + [(a, b, "F") for a, b in follow["spans"]]
    )
    assert [s[2] for s in spans] == ["L", "F"] * 4
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))  # one at a time
    assert lead["waited_s"] >= 0.4  # the follower's start-up and its turns


def test_a_partner_that_finishes_early_leaves_the_other_alone(tmp_path, monkeypatch):
    lead, follow = _pair(tmp_path, monkeypatch, 6, 2, 0.0)
    assert len(lead["spans"]) == 6 and len(follow["spans"]) == 2
    # cached: the same pair is not run again
    again = _pair(tmp_path, monkeypatch, 6, 2, 0.0)
    assert again[0]["spans"] == lead["spans"]


def test_a_bad_baton_spec_is_refused():
    from eotools.engine_probe import Baton

    with pytest.raises(ValueError, match="leader or follower"):
        Baton("boss:3:4")
    idle = Baton(None)
    with idle.turn():  # no partner: no waiting
        pass
    assert idle.waited_s == 0.0
