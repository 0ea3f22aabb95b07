# SPDX-License-Identifier: Apache-2.0
"""Shared by GPU tests and benchmarks: test models, cold files and engine runs on a GPU host.

Engine runs go through eotools.engine_probe in a fresh process per configuration, with the
unpatched or the patched vLLM first on PYTHONPATH:

- EO_VLLM_SITE: site folder with the pinned vLLM and its dependencies (unpatched);
- EO_VLLM_PATCHED: a folder holding only a patched copy of its ``vllm/`` package;
- EO_GPU_WORK: where models, cold files and results are cached (default /tmp/eo-gpu).

Results are cached by configuration, so tests that need the same run share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

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


def make_model(name: str, *args: str) -> pathlib.Path:
    """A make-test-model checkpoint under WORK/models/<name>, made once."""
    out = WORK / "models" / name
    done = out / ".complete"
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


_PROBE = [sys.executable, "-m", "eotools.engine_probe"]


def run_engine(
    name: str, config: dict, patched: bool, timeout: float = 900, tree: str | None = None
) -> dict:
    """Run (or fetch the cached result of) one engine configuration. `tree` overrides
    EO_VLLM_PATCHED (an A/B against another series); the cache key holds the series stamp
    of the tree used."""
    run = _Run(name, config, patched, tree)
    if run.result_file.exists():
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
    turns request by request (engine_probe.Baton): paired timings that a change of the
    host's speed during the run cannot tilt. Cached like run_engine; the cache key says
    that the run was paired and with what. The engines share the GPU's memory, so
    EO_GPU_MEMORY_UTILIZATION (or each config's engine settings) must leave room for both.
    `probe`: the command that runs one configuration (tests; default engine_probe)."""
    runs = [
        _Run(name, {**config, "paired_with": partner[0]}, patched, tree)
        for (name, config, patched), partner in ((leader, follower), (follower, leader))
    ]
    if all(r.result_file.exists() for r in runs):
        return runs[0].result(), runs[1].result()
    to_follower, to_leader = os.pipe(), os.pipe()  # (read, write) each
    batons = [
        (f"leader:{to_leader[0]}:{to_follower[1]}", [to_leader[0], to_follower[1]]),
        (f"follower:{to_follower[0]}:{to_leader[1]}", [to_follower[0], to_leader[1]]),
    ]
    procs, logs = [], []
    t0 = time.time()
    try:
        for run, (baton, fds) in zip(runs, batons, strict=True):
            lf = open(run.log_file, "w")  # noqa: SIM115 (closed below)
            logs.append(lf)
            procs.append(
                subprocess.Popen(
                    [*(probe or _PROBE), *run.start(", paired")],
                    env={**engine_env(run.patched, tree), "EO_BATON": baton},
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    pass_fds=fds,
                )
            )
    finally:
        for fd in (*to_follower, *to_leader):  # the children hold their own ends
            os.close(fd)
    try:
        codes = [p.wait(timeout=max(1.0, timeout - (time.time() - t0))) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    finally:
        for lf in logs:
            lf.close()
    for run, code in zip(runs, codes, strict=True):
        run.check(code, " (paired)")
    log(f"engine runs {runs[0].name} and {runs[1].name} (paired) done in {time.time() - t0:.0f} s")
    return runs[0].result(), runs[1].result()


def engine(**overrides) -> dict:
    """BASE_ENGINE with `overrides`. EO_GPU_MEMORY_UTILIZATION sets vLLM's start-up check of
    free GPU memory (the KV cache size is fixed anyway), so that engines whose timings do
    not matter can share one GPU; it is not in the compile cache's key."""
    out = dict(BASE_ENGINE)
    if share := os.environ.get("EO_GPU_MEMORY_UTILIZATION"):
        out["gpu_memory_utilization"] = float(share)
    out.update(overrides)
    return out
