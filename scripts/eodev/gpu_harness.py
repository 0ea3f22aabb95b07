# SPDX-License-Identifier: Apache-2.0
"""Shared by GPU tests and benchmarks: test models, cold files and engine runs on a GPU host.

Engine runs go through eodev.engine_probe in a fresh process per configuration, with the
unpatched or the patched vLLM first on PYTHONPATH:

- EO_VLLM_SITE: site folder with the pinned vLLM and its dependencies (unpatched);
- EO_VLLM_PATCHED: a folder holding only a patched copy of its ``vllm/`` package;
- EO_GPU_WORK: where models, cold files and results are cached (default /tmp/eo-gpu).

Results are cached by configuration, so tests that need the same run share it. Processes side
by side share the cache too: one that wants a model or run another is making waits for it
(a lock file beside it) and then reads it, instead of making it again beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

SCRIPTS = pathlib.Path(__file__).resolve().parents[1]
WORK = pathlib.Path(os.environ.get("EO_GPU_WORK", "/tmp/eo-gpu"))

# Engine settings every run shares: CUDA graphs on (few capture sizes keep start-up short),
# the Triton attention backend (the GPU host's bundle has no flash-attention kernels), a fixed
# KV cache so VRAM numbers compare across configurations.
BASE_ENGINE = {
    "attention_backend": "TRITON_ATTN",
    "max_model_len": 10240,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 2048,
    "kv_cache_memory_bytes": 4 << 30,
    "enable_prefix_caching": False,
    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]},
    "kernel_config": {"enable_jit_warmup": False, "enable_flashinfer_autotune": False},
    "seed": 0,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def held(*paths: pathlib.Path) -> Iterator[None]:
    """Exclusive locks on ``paths`` (a ``.lock`` file beside each), taken in sorted order so
    that two holders of overlapping sets cannot deadlock; released on exit, or when the
    process dies."""
    with contextlib.ExitStack() as stack:
        for path in sorted(set(paths)):
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(path.with_name(path.name + ".lock"), "w"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for another process making {path.name}")
                fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def make_model(name: str, *args: str) -> pathlib.Path:
    """A make-test-model checkpoint under WORK/models/<name>, made once (by one process of
    several that want it; the others wait for it)."""
    out = WORK / "models" / name
    done = out / ".complete"
    if done.exists():
        return out
    with held(out):
        if not done.exists():
            log(f"making test model {name}: {' '.join(args)}")
            cmd = [sys.executable, str(SCRIPTS / "make-test-model"), str(out), "--force", *args]
            subprocess.run(cmd, check=True)
            done.write_text("ok\n")
    return out


def patched_tree(override: str | None = None) -> str | None:
    """The folder holding the patched ``vllm/`` copy: `override`, else EO_VLLM_PATCHED."""
    return override or os.environ.get("EO_VLLM_PATCHED")


def series_stamp(tree: str | None) -> str | None:
    """The stamp scripts/test-gpu leaves in a patched copy (a digest of the series applied),
    so that cached results of one series are never returned for another."""
    if not tree:
        return None
    stamps = sorted(p.name for p in pathlib.Path(tree).glob(".series-*"))
    return ",".join(stamps) or None


def engine_env(patched: bool, tree: str | None = None) -> dict[str, str]:
    site = os.environ.get("EO_VLLM_SITE", "")
    paths = [str(SCRIPTS)]
    if patched:
        p = patched_tree(tree)
        if not p:
            raise RuntimeError("EO_VLLM_PATCHED is not set: no patched vLLM to run")
        paths.append(p)
    if site:
        paths.append(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EXPERT")}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Run:
    """One engine configuration's files in the cache: the config (with the series stamp of
    the patched tree, keyed by its digest), the result and the log."""

    def __init__(self, name: str, config: dict, patched: bool, tree: str | None) -> None:
        self.name, self.patched = name, patched
        self.config = {"name": name, **config, "patched": patched}
        if patched:
            self.config["series"] = series_stamp(patched_tree(tree))
        key = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()[:16]
        out_dir = WORK / "runs"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.result_file = out_dir / f"{name}-{key}.json"
        self.log_file = out_dir / f"{name}-{key}.log"
        self.cfg_file = out_dir / f"{name}-{key}.config.json"

    def start(self, what: str = "") -> list[str]:
        """Write the config and say so; the probe's arguments."""
        self.cfg_file.write_text(json.dumps(self.config))
        kind = ("patched" if self.patched else "unpatched") + what
        log(f"engine run {self.name} ({kind}) -> {self.log_file}")
        return [str(self.cfg_file), str(self.result_file)]

    def check(self, returncode: int, what: str = "") -> None:
        if returncode != 0:
            tail = self.log_file.read_text()[-3000:]
            raise RuntimeError(f"engine run {self.name}{what} failed (exit {returncode}):\n{tail}")

    def result(self) -> dict:
        return {**json.loads(self.result_file.read_text()), "log_file": str(self.log_file)}


_PROBE = [sys.executable, "-m", "eodev.engine_probe"]


def run_engine(
    name: str, config: dict, patched: bool, timeout: float = 900, tree: str | None = None
) -> dict:
    """Run (or fetch the cached result of) one engine configuration. `tree` overrides
    EO_VLLM_PATCHED (an A/B against another series); the cache key holds the series stamp
    of the tree used."""
    run = _Run(name, config, patched, tree)
    if run.result_file.exists():
        return run.result()
    with held(run.result_file):
        if run.result_file.exists():  # another process made it while this one waited
            return run.result()
        t0 = time.time()
        with open(run.log_file, "w") as lf:
            r = subprocess.run(
                [*_PROBE, *run.start()],
                env=engine_env(patched, tree),
                stdout=lf,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        run.check(r.returncode)
        log(f"engine run {name} done in {time.time() - t0:.0f} s")
        return run.result()


def run_engine_pair(
    leader: tuple[str, dict, bool],
    follower: tuple[str, dict, bool],
    timeout: float = 1800,
    tree: str | None = None,
    probe: list[str] | None = None,
) -> tuple[dict, dict]:
    """Two engine configurations (name, config, patched) side by side on one GPU, taking
    turns request by request: run_engine_group of two, the leader's turn first. `tree`
    applies to the patched ones. Raises the first failure."""
    members = [(*leader, tree), (*follower, tree)]
    out = run_engine_group(members, timeout=timeout, probe=probe)
    for res in out:
        if isinstance(res, Exception):
            raise res
    return out[0], out[1]


def run_engine_group(
    members: list[tuple[str, dict, bool, str | None]],
    timeout: float = 1800,
    probe: list[str] | None = None,
    stagger: int = 0,
) -> list[dict | RuntimeError]:
    """Engine configurations (name, config, patched, tree) side by side on one GPU, taking
    turns request by request in this order (engine_probe.Baton, turns handed round by
    this process): timings that a change of the host's speed during the run cannot tilt,
    and start-ups that overlap. The round starts once every engine has started (or died),
    so no start-up overlaps a timed request. `stagger` N starts the first N alone and the
    others once those have started: engines with the same compile-cache key must not
    compile it at the same time (vLLM's cache index is not written atomically), so a
    cold cache is best filled by one unpatched and one patched engine first. Cached like
    run_engine: the cache key names the others ("paired_with"). The engines share the
    GPU's memory, so EO_GPU_MEMORY_UTILIZATION (or each config's engine settings) must
    leave room for all. Returns each member's result, or the RuntimeError of a member
    that failed (the others' results are kept). `probe`: the command that runs one
    configuration (tests; default engine_probe)."""
    names = [m[0] for m in members]
    runs = []
    for name, config, patched, tree in members:
        others = ",".join(n for n in names if n != name)
        runs.append(_Run(name, {**config, "paired_with": others}, patched, tree))
    if all(r.result_file.exists() for r in runs):
        return [r.result() for r in runs]
    with held(*(r.result_file for r in runs)):
        if all(r.result_file.exists() for r in runs):  # made while this process waited
            return [r.result() for r in runs]
        return _run_group(runs, members, timeout, probe, stagger)


def _run_group(
    runs: list[_Run],
    members: list[tuple[str, dict, bool, str | None]],
    timeout: float,
    probe: list[str] | None,
    stagger: int,
) -> list[dict | RuntimeError]:
    """run_engine_group's engines, started and handed turns (its caller holds their locks)."""
    names = [r.name for r in runs]
    procs: list[subprocess.Popen] = []
    logs, channels = [], []
    started: dict[int, bool] = {}  # member -> said it started (True) or died (False)
    t0 = time.time()
    deadline = t0 + timeout

    def spawn(i: int) -> None:
        _, _, patched, tree = members[i]
        runs[i].result_file.unlink(missing_ok=True)  # a result is this run's or none
        to_child, to_harness = os.pipe(), os.pipe()  # (read, write) each
        lf = open(runs[i].log_file, "w")  # noqa: SIM115 (closed below)
        logs.append(lf)
        try:
            procs.append(
                subprocess.Popen(
                    [*(probe or _PROBE), *runs[i].start(f", side by side with {len(runs) - 1}")],
                    env={**engine_env(patched, tree), "EO_BATON": f"{to_child[0]}:{to_harness[1]}"},
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    pass_fds=(to_child[0], to_harness[1]),
                )
            )
        except BaseException:
            _close([to_harness[0], to_child[1]])
            raise
        finally:
            _close([to_child[0], to_harness[1]])  # the child holds its own ends
        channels.append([to_harness[0], to_child[1]])

    try:
        first = min(stagger, len(runs)) if stagger > 0 else len(runs)
        for i in range(first):
            spawn(i)
        if first < len(runs):
            for i in range(first):
                started[i] = _started(channels[i], deadline)
            log(f"engine runs {', '.join(names[:first])} started; starting the others")
            for i in range(first, len(runs)):
                spawn(i)
    except BaseException:
        _kill(procs)
        for ch in channels:
            _close(ch)
        for lf in logs:
            lf.close()
        raise
    relay = threading.Thread(target=_hand_turns_round, args=(channels, started), daemon=True)
    relay.start()
    codes, late = [], set()
    try:
        for i, p in enumerate(procs):
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired:  # past the unit's deadline: this one alone
                p.kill()
                codes.append(p.wait())
                late.add(i)
    except BaseException:  # interrupted
        _kill(procs)
        raise
    finally:
        relay.join(timeout=10)
        for lf in logs:
            lf.close()
    out = _group_results(runs, codes, late, timeout)
    log(f"engine runs {', '.join(names)} (side by side) done in {time.time() - t0:.0f} s")
    return out


def _group_results(
    runs: list[_Run], codes: list[int], late: set[int], timeout: float
) -> list[dict | RuntimeError]:
    """Each side-by-side engine's result from its exit code, or the RuntimeError that says
    why there is none; an engine killed at the deadline after writing its result keeps it."""
    out: list[dict | RuntimeError] = []
    for i, (run, code) in enumerate(zip(runs, codes, strict=True)):
        if i in late and run.result_file.exists():  # it had finished; its exit hung
            log(f"engine run {run.name} killed at the deadline after writing its result")
            code = 0
        elif i in late:
            out.append(
                RuntimeError(f"engine run {run.name} killed at the deadline ({timeout:.0f} s)")
            )
            continue
        try:
            run.check(code, " (side by side)")
            out.append(run.result())
        except RuntimeError as e:
            out.append(e)
    return out


def _started(channel: list[int], deadline: float | None = None) -> bool:
    """Wait for an engine's start-up byte: True once it has started, False if it died
    first (its channel is then closed). Raises TimeoutExpired at the deadline, if any."""
    rfd = channel[0]
    wait = None if deadline is None else max(0.0, deadline - time.time())
    if not select.select([rfd], [], [], wait)[0]:
        raise subprocess.TimeoutExpired("engine start-up", wait or 0.0)
    if os.read(rfd, 1):
        return True
    _close(channel)
    return False


EXIT_GRACE_S = 60.0  # how long a finished engine may hold the turn while it exits


def _hand_turns_round(channels: list[list[int]], started: dict[int, bool]) -> None:
    """The turns of run_engine_group: wait until every engine has started (a byte each, or
    end of file from one that died; `started` holds those already waited for), then give
    the turn to each live engine in order and wait for it back. An engine that has
    finished (it answers "x") keeps the turn until it exits, or EXIT_GRACE_S; one that
    died (end of file, broken pipe) leaves the round at once. Closes every channel."""
    live = []
    for i, channel in enumerate(channels):
        if i not in started:
            started[i] = _started(channel)
        if started[i]:
            live.append(i)
    while live:
        for i in list(live):
            rfd, wfd = channels[i]
            try:
                os.write(wfd, b"t")
                back = os.read(rfd, 1)
            except OSError:  # BrokenPipeError: it closed its end
                back = b""
            if back == b"x":  # it has finished and is exiting: let its shutdown run alone
                select.select([rfd], [], [], EXIT_GRACE_S)
                back = b""
            if not back:
                live.remove(i)
                _close(channels[i])


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill engine processes and reap them (a killed engine frees its GPU memory)."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _close(fds: list[int]) -> None:
    """Close the descriptors in `fds` that are still open and mark them closed (-1), so
    that a second call cannot close a number the process has since reused."""
    for k, fd in enumerate(fds):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            fds[k] = -1


def engine(**overrides) -> dict:
    """BASE_ENGINE with `overrides`. EO_GPU_MEMORY_UTILIZATION sets vLLM's start-up check of
    free GPU memory (the KV cache size is fixed anyway), so that engines whose timings do
    not matter can share one GPU; it is not in the compile cache's key. EO_ENGINE_EXTRA (JSON)
    is merged into every engine's settings last, for what a GPU host's vLLM build lacks: e.g.
    '{"attention_config": {"flash_attn_version": 2}}' where the flash-attention kernels are
    missing but a backend (Qwen4Exp's QSA) would plan for FA3."""
    out = dict(BASE_ENGINE)
    if share := os.environ.get("EO_GPU_MEMORY_UTILIZATION"):
        out["gpu_memory_utilization"] = float(share)
    out.update(overrides)
    if extra := os.environ.get("EO_ENGINE_EXTRA"):
        out.update(json.loads(extra))
    return out
