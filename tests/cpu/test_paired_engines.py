# SPDX-License-Identifier: Apache-2.0
"""gpu_harness.run_engine_pair / run_engine_group and engine_probe.Baton on the CPU, with a
stand-in probe: the engines time their requests in turns (never at once), in order, starting
only when all have started; one that finishes early, or dies at start-up, leaves the others
running, and a group's failure is reported for that member alone.

    scripts/test tests/cpu/test_paired_engines.py
"""

from __future__ import annotations

import pathlib
import sys

import pytest

FAKE = pathlib.Path(__file__).with_name("fake_engine_probe.py")


def _pair(tmp_path, monkeypatch, leader_requests, follower_requests, follower_startup):
    from eodev import gpu_harness as gh

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
    from eodev.engine_probe import Baton

    for spec in ("leader:3:4", "3", "3:x"):
        with pytest.raises(ValueError, match="READ_FD:WRITE_FD"):
            Baton(spec)
    idle = Baton(None)
    with idle.turn():  # no partner: no waiting
        pass
    assert idle.waited_s == 0.0


def _spans(*results):
    return sorted((a, b, tag) for tag, res in results for a, b in res["spans"])


def test_a_group_takes_turns_in_order_and_starts_when_all_have_started(tmp_path, monkeypatch):
    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 3, "startup_s": 0.0}, False, None),
        ("a", {"requests": 3, "startup_s": 0.6}, False, None),
        ("b", {"requests": 2, "startup_s": 0.2}, False, None),
    ]
    base, a, b = gh.run_engine_group(members, timeout=120, probe=[sys.executable, str(FAKE)])
    assert min(s[0] for s in _spans(("B", base), ("A", a), ("b", b))) >= a["started"]
    spans = _spans(("B", base), ("A", a), ("b", b))
    assert [s[2] for s in spans] == ["B", "A", "b", "B", "A", "b", "B", "A"]
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
    # each run's cache key names the others, so a pair's run is not a group's
    configs = sorted(p.name for p in (tmp_path / "runs").glob("*.config.json"))
    assert len(configs) == 3
    assert (
        '"paired_with": "a,b"' in next((tmp_path / "runs").glob("base-*.config.json")).read_text()
    )


def test_a_member_that_dies_at_start_up_fails_alone(tmp_path, monkeypatch):
    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 2, "startup_s": 0.0}, False, None),
        ("broken", {"requests": 2, "startup_s": 0.1, "fail_at_start": True}, False, None),
        ("ok", {"requests": 2, "startup_s": 0.0}, False, None),
    ]
    base, broken, ok = gh.run_engine_group(members, timeout=60, probe=[sys.executable, str(FAKE)])
    assert isinstance(broken, RuntimeError)
    assert "exit 3" in str(broken) and "start-up failed" in str(broken)
    spans = _spans(("B", base), ("O", ok))
    assert [s[2] for s in spans] == ["B", "O", "B", "O"]
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
    # run_engine_pair raises a member's failure
    with pytest.raises(RuntimeError, match="exit 3"):
        gh.run_engine_pair(
            members[0][:3], members[1][:3], timeout=60, probe=[sys.executable, str(FAKE)]
        )


def test_stagger_starts_the_others_once_the_first_have_started(tmp_path, monkeypatch):
    """stagger=2: a cold compile cache is filled by the first two engines before the
    others start (they would otherwise compile the same cache entries at once)."""
    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 2, "startup_s": 0.3}, False, None),
        ("a", {"requests": 2, "startup_s": 0.5}, False, None),
        ("b", {"requests": 2, "startup_s": 0.0}, False, None),
        ("c", {"requests": 1, "startup_s": 0.0}, False, None),
    ]
    base, a, b, c = gh.run_engine_group(
        members, timeout=60, probe=[sys.executable, str(FAKE)], stagger=2
    )
    assert min(b["launched"], c["launched"]) >= max(base["started"], a["started"])
    spans = _spans(("B", base), ("A", a), ("b", b), ("c", c))
    assert [s[2] for s in spans] == ["B", "A", "b", "c", "B", "A", "b"]
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))


def test_a_group_past_its_timeout_is_killed(tmp_path, monkeypatch):
    """An engine that never finishes starting: the group raises TimeoutExpired at its
    deadline and kills every engine, including the one that stagger kept waiting."""
    import subprocess
    import time

    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 1, "startup_s": 60.0}, False, None),
        ("a", {"requests": 1, "startup_s": 0.0}, False, None),
        ("b", {"requests": 1, "startup_s": 0.0}, False, None),
    ]
    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        gh.run_engine_group(members, timeout=2, probe=[sys.executable, str(FAKE)], stagger=1)
    assert time.time() - t0 < 15
    assert not list((tmp_path / "runs").glob("*[0-9a-f].json"))  # no result was written


def test_a_finished_engine_shuts_down_before_the_next_timed_request(tmp_path, monkeypatch):
    """An engine that has run its last task keeps the turn until its process has exited:
    its shutdown (freeing its GPU memory) overlaps no other engine's timed request."""
    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 1, "startup_s": 0.0, "shutdown_s": 0.5}, False, None),
        ("a", {"requests": 3, "startup_s": 0.0}, False, None),
    ]
    base, a = gh.run_engine_group(members, timeout=60, probe=[sys.executable, str(FAKE)])
    later = [s for s in a["spans"] if s[0] >= base["finished"]]
    assert len(later) == 2  # the base finished after the first round
    assert min(s[0] for s in later) >= base["finished"] + 0.5


def test_a_hung_exit_holds_the_turn_only_for_the_grace_time(tmp_path, monkeypatch):
    """A finished engine whose exit hangs: the others go on after EXIT_GRACE_S, and at the
    unit's deadline it is killed, its result (written before the hang) kept."""
    import time

    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    monkeypatch.setattr(gh, "EXIT_GRACE_S", 0.3)
    members = [
        ("base", {"requests": 1, "startup_s": 0.0, "shutdown_s": 60.0}, False, None),
        ("a", {"requests": 3, "startup_s": 0.0}, False, None),
    ]
    t0 = time.time()
    base, a = gh.run_engine_group(members, timeout=4, probe=[sys.executable, str(FAKE)])
    assert time.time() - t0 < 15
    assert len(base["spans"]) == 1 and len(a["spans"]) == 3
    later = [s[0] for s in a["spans"] if s[0] >= base["finished"]]
    assert later and base["finished"] + 0.3 <= min(later) < base["finished"] + 3


def test_an_engine_that_hangs_in_a_request_fails_the_unit_without_raising(tmp_path, monkeypatch):
    """An engine stuck while it holds the turn: at the unit's deadline every engine still
    running is killed and reported failed; bench-offload then goes on with its other units."""
    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    members = [
        ("base", {"requests": 2, "startup_s": 0.0}, False, None),
        ("stuck", {"requests": 2, "startup_s": 0.0, "request_s": 60.0}, False, None),
    ]
    out = gh.run_engine_group(members, timeout=3, probe=[sys.executable, str(FAKE)])
    assert all(isinstance(x, RuntimeError) for x in out)
    assert "killed at the deadline" in str(out[1])


def test_processes_that_want_one_group_run_it_once(tmp_path, monkeypatch):
    # two callers at once (threads here; processes on a GPU host): the second waits for the
    # first's lock and reads its results instead of starting the same engines beside them
    import threading

    got: list = []
    callers = [
        threading.Thread(target=lambda: got.append(_pair(tmp_path, monkeypatch, 3, 3, 0.3)))
        for _ in range(2)
    ]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=120)
    assert len(got) == 2
    assert got[0][0]["started"] == got[1][0]["started"]  # one leader engine, not two
    assert got[0][1]["spans"] == got[1][1]["spans"]
    assert list(tmp_path.glob("runs/*.json.lock"))  # the locks are files beside the results


def test_processes_that_want_one_test_model_make_it_once(tmp_path, monkeypatch):
    import threading
    import time

    from eodev import gpu_harness as gh

    monkeypatch.setattr(gh, "WORK", tmp_path)
    made = []

    def make(cmd, check):
        made.append(cmd)
        time.sleep(0.3)  # long enough for the others to find the lock taken
        pathlib.Path(cmd[2]).mkdir(parents=True)  # a second maker would fail here

    monkeypatch.setattr(gh.subprocess, "run", make)
    got: list = []
    callers = [
        threading.Thread(target=lambda: got.append(gh.make_model("m", "--layers", "2")))
        for _ in range(3)
    ]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=30)
    assert len(made) == 1 and got == [tmp_path / "models" / "m"] * 3
    assert (tmp_path / "models" / "m" / ".complete").exists()
