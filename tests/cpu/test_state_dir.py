# SPDX-License-Identifier: Apache-2.0
"""The budget-only start's state folder survives kills, races and bad files.

- kill -9 at every write point of a start (state_dir.CRASH_POINTS, through the EO_CRASH_AT
  test hook), then start again: no run lost or counted twice, no empty or partial file;
- two starts racing on one folder, 50 times: one serves, the other is refused, naming the
  folder, the holder and the fix; every winner's counts are added exactly once;
- corrupt or foreign state: set aside with one warning line, the start goes on, and the
  next start does not warn again (no crash loop);
- the lock outlives exec and is released by the kernel; writes are synced before and after
  the rename; the record of folded runs stays bounded.

    scripts/test tests/cpu/test_state_dir.py
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from eotools import budget_start, state_dir, usage_state
from eotools.cold_contract import read_json
from eotools.coldset import model_identity
from eotools.counts import Counts
from eotools.selection import GiB, expert_bytes

HERE = pathlib.Path(__file__).resolve().parent


def budget(model: pathlib.Path) -> float:
    return 6 * expert_bytes(model) / GiB  # six experts per stage


def plan(model, state, pp=2):
    """One start in this process; the lock is released as the server's exit would."""
    messages: list[str] = []
    start = budget_start.plan(model, budget(model), pp, state, log=messages.append)
    os.close(start.lock_fd)
    return start, messages


def counts_doc(model, decode, tokens=100, rank=(0, 1), **model_kw) -> dict:
    """A counts file as the counting hook writes it (the model name is the path vLLM got)."""
    ident = {**model_identity(model), "name": str(model), "revision": None, **model_kw}
    decode = np.asarray(decode, dtype=np.int64)
    extra = {"rank": {"pp_rank": rank[0], "pp_size": rank[1], "dp_rank": 0, "dp_size": 1}}
    if rank[1] > 1:
        extra["layers"] = [i for i, row in enumerate(decode) if row.any()]
    c = Counts(
        ident,
        {"name": "served", "tokens": {"prefill": 0, "decode": tokens}},
        np.zeros_like(decode),
        decode,
        8,
        "vllm counting hook",
        extra,
    )
    return c.to_json()


def write_run(model, count_file: pathlib.Path, decode, tokens=100) -> None:
    """One run's counts as two pipeline ranks write them (layers 0-1 and 2-3)."""
    stem = count_file.with_suffix("")
    for rank, layers in ((0, [0, 1]), (1, [2, 3])):
        part = np.zeros_like(decode)
        part[layers] = decode[layers]
        doc = counts_doc(model, part, tokens, (rank, 2))
        pathlib.Path(f"{stem}.pp{rank}.json").write_text(json.dumps(doc))


def usage(state) -> dict:
    return read_json(state / "usage.json", 1 << 26)


def shape(model) -> tuple[int, int]:
    ident = model_identity(model)
    return ident["num_layers"], ident["num_experts"]


def pattern(model, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, size=shape(model))


def cli(repo_root, model, state, **env):
    cmd = [sys.executable, str(repo_root / "scripts/budget-start")]
    args = ["--budget-gib", repr(budget(model)), "--state-dir", str(state), "--model", str(model)]
    return subprocess.run(
        [*cmd, *args, "--pp-size", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def exported_count_file(stdout: str) -> pathlib.Path:
    for line in stdout.splitlines():
        if line.startswith("export VLLM_EXPERT_COUNT_FILE="):
            return pathlib.Path(line.split("=", 1)[1])
    raise AssertionError(f"no VLLM_EXPERT_COUNT_FILE in {stdout!r}")


def assert_whole_files(state: pathlib.Path, allowed_decode: list[np.ndarray]) -> None:
    """usage.json and the cold file are absent, or whole and valid: never empty or partial."""
    if (state / "usage.json").exists():
        decode = np.asarray(usage(state)["decode"])
        assert any(np.array_equal(decode, d) for d in allowed_decode)
    for cold in state.glob("cold-*.json"):
        doc = read_json(cold, 1 << 20)
        assert doc["layers"] and doc["format"] == "vllm-expert-offload/cold-set"


# ---- kill -9 at every write point -------------------------------------------------------

CRASHES = [*state_dir.CRASH_POINTS, "run.file-removed:2", "legacy:usage.saved"]


@pytest.mark.parametrize("crash", CRASHES)
def test_a_kill_at_any_write_point_loses_and_doubles_nothing(
    repo_root, tiny_model, tmp_path, crash
):
    state = tmp_path / "state"
    a, b, c = (pattern(tiny_model, seed) for seed in (1, 2, 3))
    # run A is in usage.json already; run B's counts wait in its run folder
    start, _ = plan(tiny_model, state)
    write_run(tiny_model, start.count_file, a)
    start, _ = plan(tiny_model, state)
    legacy = crash.startswith("legacy:")
    if legacy:  # the layout before run ids: the hook's files directly in run/
        start.count_file.parent.rmdir()
        write_run(tiny_model, state / "run" / "counts.json", b)
        crash = crash.removeprefix("legacy:")
    else:
        write_run(tiny_model, start.count_file, b)
    # what every write point needs: a stale temporary file, counts of another model
    (state / ".usage.json.x1y2.tmp").write_text('{"format": "vllm-expe')
    foreign = state / "run" / usage_state.new_run_id()
    foreign.mkdir()
    doc = counts_doc(tiny_model, b, name="/models/another-model-of-this-shape")
    (foreign / "counts.json").write_text(json.dumps(doc))

    killed = cli(repo_root, tiny_model, state, EO_CRASH_AT=crash)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "Traceback" not in killed.stderr
    assert_whole_files(state, [a, a + b])

    again = cli(repo_root, tiny_model, state)
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    doc = usage(state)
    assert np.array_equal(np.asarray(doc["decode"]), a + b)  # B once, A once
    assert doc["runs"] == 2 and doc["data"]["tokens"]["decode"] == 200
    assert_whole_files(state, [a + b])
    assert not list(state.glob(".*.tmp"))
    assert len(list((state / "set-aside").iterdir())) == 1  # the foreign run, once
    (only,) = (state / "run").iterdir()  # this start's folder; folded and killed runs gone
    assert exported_count_file(again.stdout) == only / "counts.json"

    # the run the restarted server counts is added at the next start, once
    write_run(tiny_model, only / "counts.json", c)
    start, messages = plan(tiny_model, state)
    doc = usage(state)
    assert np.array_equal(np.asarray(doc["decode"]), a + b + c) and doc["runs"] == 3
    assert not any("warning" in m for m in messages)
    assert start.kind == "learned" and start.tokens_learned == 300


def test_a_mistyped_crash_point_is_refused(repo_root, tiny_model, tmp_path):
    r = cli(repo_root, tiny_model, tmp_path / "state", EO_CRASH_AT="usage.saevd")
    assert r.returncode == 3 and "EO_CRASH_AT='usage.saevd' names no crash point" in r.stderr
    assert not (tmp_path / "state" / ".lock").exists()


# ---- two starts racing on one folder ----------------------------------------------------


def _driver(tiny_model, state, value: int) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "state_start_driver.py"), str(tiny_model), str(state)]
    return subprocess.Popen(
        [*cmd, repr(budget(tiny_model)), str(value)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_starts_racing_on_one_folder(tiny_model, tmp_path):
    state = tmp_path / "state"
    expected = np.zeros(shape(tiny_model), dtype=np.int64)
    for round_ in range(50):
        values = (2 * round_ + 1, 2 * round_ + 2)
        procs = [_driver(tiny_model, state, v) for v in values]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:  # release both at once
            p.stdin.write("go\n")
            p.stdin.flush()
        first = [p.stdout.readline().strip() for p in procs]
        assert sorted(first) == ["", "serving"], (round_, first)
        winner = first.index("serving")
        win, lose = procs[winner], procs[1 - winner]
        assert lose.wait(timeout=60) == 3
        refusal = lose.stderr.read()
        assert f"the state folder {state} is in use by another server (pid {win.pid} " in refusal
        assert "fix: stop the other server, or give this one another folder" in refusal
        assert "Traceback" not in refusal
        if round_ % 2:  # the server is killed; the kernel releases the lock
            win.kill()
            win.wait(timeout=60)
        else:
            win.stdin.close()
            assert win.wait(timeout=60) == 0
        for p in procs:
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
        expected += values[winner]
        assert len(list((state / "run").iterdir())) == 1  # only the winner's run waits
    start, messages = plan(tiny_model, state, pp=1)
    doc = usage(state)
    assert np.array_equal(np.asarray(doc["decode"]), expected)
    assert doc["runs"] == 50 and len(doc["folded_runs"]) == 50
    assert not (state / "set-aside").exists() and start.kind == "learned"


# ---- the lock ---------------------------------------------------------------------------


def test_the_lock_is_held_across_exec_until_the_server_exits(tiny_model, tmp_path):
    state = tmp_path / "state"
    start = budget_start.plan(tiny_model, budget(tiny_model), 2, state, log=lambda m: None)
    assert os.get_inheritable(start.lock_fd)
    # the start program execs vLLM with the descriptor open: a child inherits it
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        close_fds=False,
    )
    os.close(start.lock_fd)
    try:
        with pytest.raises(state_dir.StateDirBusy, match="in use by another server"):
            budget_start.plan(tiny_model, budget(tiny_model), 2, state, log=lambda m: None)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    start, _ = plan(tiny_model, state)  # released when the server exited
    assert start.kind == "initial"


def test_a_lock_file_that_is_not_a_file_is_refused_with_the_fix(repo_root, tiny_model, tmp_path):
    state = tmp_path / "state"
    (state / ".lock").mkdir(parents=True)
    r = cli(repo_root, tiny_model, state)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert f"the state folder {state} cannot be used" in r.stderr
    assert f"remove {state / '.lock'}" in r.stderr
    assert not list(state.glob("cold-*.json"))


def test_a_state_folder_that_cannot_be_made_is_refused(repo_root, tiny_model, tmp_path):
    (tmp_path / "file").write_text("x")
    r = cli(repo_root, tiny_model, tmp_path / "file" / "state")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert "cannot be used" in r.stderr and "fix: give a folder this user can" in r.stderr


def test_a_failed_start_releases_the_folder(tiny_model, tmp_path):
    state = tmp_path / "state"
    with pytest.raises(ValueError, match="lower the budget"):
        budget_start.plan(tiny_model, 1000.0, 2, state, log=lambda m: None)
    start, _ = plan(tiny_model, state)
    assert start.kind == "initial"


# ---- durable writes ---------------------------------------------------------------------


def test_writes_are_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(a, b):
        events.append("rename")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "usage.json"
    target.write_text("old")
    state_dir.write_atomic(target, '{"new": 1}\n', "usage")
    assert events == ["fsync-file", "rename", "fsync-dir"]
    assert target.read_text() == '{"new": 1}\n' and oct(target.stat().st_mode)[-3:] == "644"
    assert [p.name for p in tmp_path.iterdir()] == ["usage.json"]


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "cold-3GiB.json"
    target.write_text('{"old": 1}\n')

    def stopped(a, b):  # SIGTERM turned into an exception by the start program
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        state_dir.write_atomic(target, '{"new": 1}\n', "cold")
    assert target.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["cold-3GiB.json"]


def test_the_record_of_folded_runs_stays_bounded(tiny_model, tmp_path):
    state = tmp_path / "state"
    start, _ = plan(tiny_model, state)
    write_run(tiny_model, start.count_file, pattern(tiny_model, 4))
    plan(tiny_model, state)
    doc = usage(state)
    old = [f"20200101T000000Z-{i:08x}" for i in range(usage_state.FOLDED_KEPT + 40)]
    doc["folded_runs"] = old
    (state / "usage.json").write_text(json.dumps(doc))
    start, _ = plan(tiny_model, state)  # nothing to fold: the record is not rewritten
    write_run(tiny_model, start.count_file, pattern(tiny_model, 5))
    plan(tiny_model, state)
    folded = usage(state)["folded_runs"]
    assert len(folded) == usage_state.FOLDED_KEPT
    assert folded[0] == start.run_id and folded[1:] == old[: usage_state.FOLDED_KEPT - 1]


# ---- corrupt or foreign state -----------------------------------------------------------


def _usage_doc(model, **over) -> dict:
    ident = model_identity(model)
    decode = pattern(model, 7)
    doc = Counts(
        ident,
        {"name": "served traffic", "tokens": {"prefill": 0, "decode": 50}},
        np.zeros_like(decode),
        decode,
        8,
        "scripts/budget-start",
        {"runs": 1, "folded_runs": []},
    ).to_json()
    return {**doc, **over}


def _text(state, name, text):
    (state / name).write_text(text)
    return name


def _usage_case(edit):
    """A usage.json made bad by `edit(model, doc) -> text`; a good run waits beside it."""

    def setup(state, model):
        text = edit(model, _usage_doc(model))
        if text is not None:
            (state / "usage.json").write_text(text)
        return "usage.json"

    return setup


def _fifo(state, model):
    os.mkfifo(state / "usage.json")
    return "usage.json"


def _dir(state, model):
    (state / "usage.json").mkdir()
    return "usage.json"


def _not_utf8(state, model):
    (state / "usage.json").write_bytes(b'{"\xff\xfe": 1}')
    return "usage.json"


def _dev_zero(state, model):
    (state / "usage.json").symlink_to("/dev/zero")
    return "usage.json"


def _run_case(write):
    """A run folder made bad by `write(model, folder)`; a good usage.json sits beside it."""

    def setup(state, model):
        (state / "usage.json").write_text(json.dumps(_usage_doc(model)))
        folder = state / "run" / usage_state.new_run_id()
        folder.mkdir(parents=True)
        write(model, folder)
        return folder.name

    return setup


def _doc_text(model, **kw) -> str:
    return json.dumps(counts_doc(model, np.ones(shape(model)), **kw))


def _run_is_a_file(state, model):
    (state / "usage.json").write_text(json.dumps(_usage_doc(model)))
    (state / "run").write_text("not a folder")
    return "run"


def _unknown_folder(state, model):
    (state / "usage.json").write_text(json.dumps(_usage_doc(model)))
    (state / "run" / "notes").mkdir(parents=True)
    return "notes"


def _legacy_other_model(state, model):
    (state / "usage.json").write_text(json.dumps(_usage_doc(model)))
    (state / "run").mkdir()
    (state / "run" / "counts.json").write_text(_doc_text(model, name="/m/other"))
    return "counts.json"


def _missing_rank(model, folder):
    doc = counts_doc(model, np.ones(shape(model)), rank=(0, 2))
    (folder / "counts.pp0.json").write_text(json.dumps(doc))


def _negative(model, folder):
    doc = counts_doc(model, np.ones(shape(model)))
    doc["decode"][0][0] = -5
    (folder / "counts.json").write_text(json.dumps(doc))


def _nan_text(model, doc):
    return json.dumps(doc).replace('"top_k": 8', '"top_k": NaN')


def _duplicate_key(model, doc):
    return json.dumps(doc).replace('"top_k": 8', '"top_k": 8, "top_k": 9')


CORRUPT = {
    # usage.json (a good run waits beside it and is still learned from)
    "usage-truncated": (_usage_case(lambda m, d: json.dumps(d)[:200]), "not valid JSON"),
    "usage-empty": (_usage_case(lambda m, d: ""), "not valid JSON"),
    "usage-data-is-a-list": (
        _usage_case(lambda m, d: json.dumps({**d, "data": []})),
        "'model' and 'data' must be objects",
    ),
    "usage-top-level-list": (_usage_case(lambda m, d: "[]"), "not an expert-counts file"),
    "usage-wrong-format": (
        _usage_case(lambda m, d: json.dumps({**d, "format": "vllm-expert-offload/cold-set"})),
        "not an expert-counts file",
    ),
    "usage-version-2": (_usage_case(lambda m, d: json.dumps({**d, "version": 2})), "version 2"),
    "usage-nan": (_usage_case(_nan_text), "NaN is not a number"),
    "usage-duplicate-key": (_usage_case(_duplicate_key), "'top_k' appears twice"),
    "usage-not-utf8": (_not_utf8, "not UTF-8"),
    "usage-fractional-counts": (
        _usage_case(lambda m, d: json.dumps({**d, "decode": np.full(shape(m), 1.5).tolist()})),
        "whole numbers",
    ),
    "usage-bad-runs": (_usage_case(lambda m, d: json.dumps({**d, "runs": -1})), "'runs' -1"),
    "usage-bad-folded-runs": (
        _usage_case(lambda m, d: json.dumps({**d, "folded_runs": "all"})),
        "'folded_runs'",
    ),
    "usage-another-model-same-shape": (
        _usage_case(lambda m, d: json.dumps({**d, "model": {**d["model"], "name": "other"}})),
        "counts model 'other', this start serves 'tiny-int4-4l'",
    ),
    "usage-another-revision": (
        _usage_case(lambda m, d: json.dumps({**d, "model": {**d["model"], "revision": "abc"}})),
        "counts revision 'abc'",
    ),
    "usage-another-shape": (
        _usage_case(lambda m, d: json.dumps({**d, "model": {**d["model"], "num_layers": 48}})),
        "num_layers 48",
    ),
    "usage-a-fifo": (_fifo, "a FIFO"),
    "usage-a-directory": (_dir, "a directory"),
    "usage-dev-zero": (_dev_zero, "not a regular file"),
    # run folders and files (a good usage.json sits beside them and is kept)
    "run-another-model-same-shape": (
        _run_case(lambda m, f: (f / "counts.json").write_text(_doc_text(m, name="/m/other"))),
        "counts model '/m/other'",
    ),
    "run-another-architecture": (
        _run_case(
            lambda m, f: (f / "counts.json").write_text(_doc_text(m, architecture="OtherMoE"))
        ),
        "architecture 'OtherMoE'",
    ),
    "run-truncated": (
        _run_case(lambda m, f: (f / "counts.json").write_text(_doc_text(m)[:-40])),
        "counts.json cannot be read (not valid JSON",
    ),
    "run-a-fifo": (_run_case(lambda m, f: os.mkfifo(f / "counts.json")), "a FIFO"),
    "run-missing-rank": (_run_case(_missing_rank), "pipeline rank files [0]"),
    "run-negative-counts": (_run_case(_negative), "negative counts"),
    "run-is-a-file": (_run_is_a_file, "is not a folder"),
    "run-unknown-folder": (_unknown_folder, "is not a run folder"),
    "legacy-another-model": (_legacy_other_model, "counts model '/m/other'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_or_foreign_state_is_set_aside_and_the_start_goes_on(tiny_model, tmp_path, case):
    setup, why = CORRUPT[case]
    state = tmp_path / "state"
    state.mkdir()
    good_run = None
    if case.startswith("usage-"):  # a good run beside the bad history
        good_run = pattern(tiny_model, 8)
        folder = state / "run" / usage_state.new_run_id()
        folder.mkdir(parents=True)
        write_run(tiny_model, folder / "counts.json", good_run)
    name = setup(state, tiny_model)

    start, messages = plan(tiny_model, state)
    warnings = [m for m in messages if "warning" in m]
    assert len(warnings) == 1, messages
    assert name in warnings[0] and why in warnings[0] and "not used" in warnings[0]
    (aside,) = (state / "set-aside").iterdir()
    assert aside.name.endswith(f"-{name}") and aside.name[:8].isdigit()
    if good_run is not None:  # the run is learned from; the bad history is not
        assert np.array_equal(np.asarray(usage(state)["decode"]), good_run)
        assert start.kind == "learned"
    else:  # the good history is kept as it was
        assert np.array_equal(np.asarray(usage(state)["decode"]), pattern(tiny_model, 7))
        assert start.kind == "learned" and usage(state)["runs"] == 1
    assert read_json(start.cold_file, 1 << 20)["layers"]

    _, again = plan(tiny_model, state)  # no crash loop, nothing more to warn about
    assert not any("warning" in m for m in again), again
    assert len(list((state / "set-aside").iterdir())) == 1


def test_a_run_that_counted_nothing_is_removed_quietly(tiny_model, tmp_path):
    state = tmp_path / "state"
    plan(tiny_model, state)  # the server was stopped before it wrote any counts
    start, messages = plan(tiny_model, state)
    assert [p.name for p in (state / "run").iterdir()] == [start.run_id]
    assert not any("warning" in m for m in messages) and not (state / "usage.json").exists()
