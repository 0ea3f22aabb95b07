# SPDX-License-Identifier: Apache-2.0
"""The state folder's ground rules: one server per folder, and writes that a kill cannot
leave half done.

- **Lock**: `lock` takes an exclusive, non-blocking `flock` on ``<folder>/.lock`` and
  returns its file descriptor, inheritable across `exec`. The lock is held for as long as
  that descriptor (or a copy of it in a child process) stays open: the start program keeps
  it open and execs `vllm serve`, so the server holds the folder until it exits, and the
  kernel releases it however the server ends (kill -9 included). Never close it before
  the server is done with the folder. A second start on the same folder is refused
  (`StateDirBusy`) with who holds it, as far as the lock file says.
- **Durable writes**: `write_atomic` writes a temporary file in the same folder, fsyncs it,
  renames it over the target and fsyncs the folder: a reader sees the old file or the new
  one, never an empty or partial file, even after a power loss.
- **Set aside**: `set_aside` moves a file or folder that cannot be used into
  ``<folder>/set-aside/``, renamed with the time, and says so in one warning line.

Test hook: ``EO_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself at the n-th time
(default the first) it passes the named point of the write path (`CRASH_POINTS`), so the
tests can kill a start at every write point. It is for tests only; a start refuses a name
that is no crash point.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable

LOCK_NAME = ".lock"
ASIDE_NAME = "set-aside"
TEMP_SUFFIX = ".tmp"
CRASH_ENV = "EO_CRASH_AT"

Log = Callable[[str], None]

# every point of a start's write path where a kill can land, in the order a start passes
# them; `write_atomic(point=W)` passes W.partial (half the temporary file written),
# W.written (temporary file complete and synced), W.renamed and W.saved (folder synced)
_WRITES = ("usage", "cold")
_STEPS = ("partial", "written", "renamed", "saved")
CRASH_POINTS: tuple[str, ...] = (
    "lock.taken",  # the lock is held
    "temp.removed",  # a temporary file of an interrupted write removed
    "aside.renamed",  # a file that cannot be used moved to set-aside/
    *(f"usage.{step}" for step in _STEPS),  # usage.json with the earlier runs added
    "run.file-removed",  # one file of a run folded into usage.json removed
    "run.folder-removed",  # that run's folder removed
    *(f"cold.{step}" for step in _STEPS),  # this start's cold file
    "run.created",  # this run's folder for the counting hook created
)

_passes: dict[str, int] = {}


class StateDirError(RuntimeError):
    """The state folder cannot be used; the message names the folder and the fix."""


class StateDirBusy(StateDirError):
    """Another process holds the state folder's lock."""


def _crash_target() -> tuple[str, int] | None:
    value = os.environ.get(CRASH_ENV, "")
    if not value:
        return None
    name, _, nth = value.partition(":")
    if name not in CRASH_POINTS or not (nth == "" or (nth.isdigit() and int(nth) > 0)):
        raise StateDirError(
            f"{CRASH_ENV}={value!r} names no crash point (a test hook): unset it, or give "
            f"one of {', '.join(CRASH_POINTS)}, optionally with :N for the N-th pass"
        )
    return name, int(nth or 1)


def crash_point(name: str) -> None:
    """Test hook (module docstring): SIGKILL this process here if EO_CRASH_AT says so."""
    if name not in CRASH_POINTS:
        raise ValueError(f"{name!r} is not in CRASH_POINTS")
    target = _crash_target()
    if target is None or target[0] != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(folder: pathlib.Path) -> None:
    """Make the folder's entries (a rename, a new or removed file) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: pathlib.Path, text: str, point: str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` durably (module docstring); ``point`` names the
    write for the crash hook ("usage" or "cold")."""
    if point not in _WRITES:
        raise ValueError(f"{point!r} is not one of {_WRITES}")
    path = pathlib.Path(path)
    data = text.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        try:
            half = len(data) // 2
            _write_all(fd, data[:half])
            crash_point(f"{point}.partial")
            _write_all(fd, data[half:])
            os.fchmod(fd, mode)  # mkstemp makes it private; these are ordinary data
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point(f"{point}.written")
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    crash_point(f"{point}.renamed")
    fsync_dir(path.parent)
    crash_point(f"{point}.saved")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def remove_stale_temps(folder: pathlib.Path) -> None:
    """Remove the temporary files of writes that a kill interrupted (call with the lock)."""
    for p in sorted(folder.glob(f".*{TEMP_SUFFIX}")):
        if p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
            crash_point("temp.removed")
    fsync_dir(folder)


def set_aside(state: pathlib.Path, path: pathlib.Path, why: str, log: Log) -> pathlib.Path:
    """Move ``path`` (a file or folder of any kind) to state/set-aside/<time>-<name>, with
    one warning line naming it and why it is not used."""
    aside = state / ASIDE_NAME
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    if aside.is_symlink() or (aside.exists() and not aside.is_dir()):
        aside.rename(state / f"{ASIDE_NAME}.{stamp}.not-a-folder")
        log(f"budget-start: warning: {aside} is not a folder; renamed it")
    aside.mkdir(exist_ok=True)
    dest = aside / f"{stamp}-{path.name}"
    n = 1
    while dest.exists() or dest.is_symlink():
        dest = aside / f"{stamp}-{n}-{path.name}"
        n += 1
    path.rename(dest)
    crash_point("aside.renamed")
    fsync_dir(aside)
    fsync_dir(path.parent)
    log(f"budget-start: warning: {path} {why}; moved to {dest}, not used")
    return dest


def _holder(fd: int) -> str:
    """Who holds the lock, from what the holder writes into the lock file right after
    taking it (best effort: retried briefly while it is missing, or names a process of
    this host that is gone, as when a killed holder's successor has not written yet)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            text = os.pread(fd, 4096, 0).decode()
            doc, _ = json.JSONDecoder().raw_decode(text.strip())
            pid, host, since = int(doc["pid"]), str(doc["host"]), str(doc["since"])
            if host != socket.gethostname() or _alive(pid):
                return f" (pid {pid} on host {host[:64]!r}, since {since[:32]})"
        except (OSError, ValueError, TypeError, KeyError):
            pass
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def lock(state: pathlib.Path) -> int:
    """Take the state folder's lock; return its file descriptor, inheritable across exec.

    Keep the descriptor open for as long as the folder is used (module docstring): closing
    it releases the folder to the next start. Raises StateDirBusy when another process holds
    it, StateDirError when the folder or its lock file cannot be used."""
    _crash_target()  # refuse a mistyped test hook before anything is written
    try:
        state.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            state / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
        )
    except OSError as e:
        raise StateDirError(
            f"the state folder {state} cannot be used ({e.strerror}: {e.filename}): "
            "fix: give a folder this user can create and write (EO_STATE_DIR, compose: "
            f"STATE_DIR), and remove {state / LOCK_NAME} if it is not a file"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{state / LOCK_NAME} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held_by = _holder(fd)
        os.close(fd)
        raise StateDirBusy(
            f"the state folder {state} is in use by another server{held_by}: each server "
            "needs a state folder of its own; fix: stop the other server, or give this one "
            "another folder (EO_STATE_DIR, compose: STATE_DIR)"
        ) from None
    except OSError as e:
        os.close(fd)
        raise StateDirError(
            f"the state folder {state} cannot be locked ({e.strerror or e}): fix: remove "
            f"{state / LOCK_NAME} if it is not a file, and give a local folder or a network "
            "file system with working locks"
        ) from None
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    data = (json.dumps(holder) + "\n").encode()
    os.pwrite(fd, data, 0)  # then cut what an earlier holder wrote beyond it
    os.ftruncate(fd, len(data))
    os.set_inheritable(fd, True)
    crash_point("lock.taken")
    return fd
