# SPDX-License-Identifier: Apache-2.0
"""Soak test: mixed traffic through `vllm serve` with the series' default settings for a fixed
time, then the checks of scripts/eodev/soak_report.py.

    soak --model DIR --out DIR (--cold FILE | --host-experts-per-layer N) [--duration-s 900]
         [--warmup-s 120] [--port 8123] [--max-concurrency 16] [--long-tokens 32768]
         [--seed 0] [-- VLLM_SERVE_ARG...]

It starts `python3 -m vllm.entrypoints.cli.main serve DIR` (the vLLM on PYTHONPATH, e.g.
scripts:/tmp/vllm-patched:/tmp/site) in its own process group, its log in OUT/server.log,
with the one-table path, prefill staging, the runtime swap's self-check every --self-check
decisions, usage counting into OUT/counts.json and offload metrics on /metrics. DIR is a
make-test-model checkpoint: the prompts are its planted domains' held-out conversations and
random words, sent as token ids.

Order: a probe set (6 prompts, greedy, 32 tokens, alone on the server); --duration-s of
traffic from worker threads whose number in flight changes every --phase-s through a fixed
seeded sequence over 1..--max-concurrency (short, long, very long and random-token prompts,
16-256 tokens each, 15% cancelled by closing the connection after 1-20 tokens); the probe
set again; SIGTERM to the server's process group. Every --sample-s: the GPU's VRAM used, the
server's process tree's host RSS and a /metrics scrape.

Passes when: the self-check ran and never failed, the probes' greedy tokens are identical at
start and end, no request failed (other than the intended cancellations), VRAM and RSS grew by
less than 1% after the first --warmup-s of traffic, /metrics agrees with the client's counts,
and the server shut down by itself (exit 0) writing its usage counts.

Writes OUT/soak.json (rewritten after every sample, "complete": false until the end),
OUT/soak.md, OUT/soak.png (with matplotlib), OUT/requests.jsonl (every request).
`soak --report OUT` judges a run that stopped early (its host taken away) from what it left
in OUT: the checks it could not reach fail, and soak.md says it was interrupted.
Exit codes: 0 every check passed; 1 a check failed (results still written); 2 usage; 3 the
server did not start (the log's last lines are printed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from . import soak_report as rep
from .nvsmi import gpu_name
from .soak_traffic import (
    MAX_GEN,
    PlanPrompts,
    Sampler,
    Traffic,
    log,
    run_probes,
    sample_fn,
    scrape,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 0, 1, 2, 3
SETTLE_S = 3.0


# -- command line ------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="soak",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", type=pathlib.Path, required=True, help="make-test-model DIR")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="results folder")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--cold", type=pathlib.Path, help="the cold file to serve with")
    where.add_argument(
        "--host-experts-per-layer", type=int, help="make the cold file: N least-used per layer"
    )
    ap.add_argument("--duration-s", type=float, default=900.0, help="traffic time (900)")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="traffic before flatness (120)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=32768, help="longest prompt (32768)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-check", type=int, default=16, help="VLLM_EXPERT_SWAP_SELF_CHECK")
    ap.add_argument("--health-timeout-s", type=float, default=900.0)
    ap.add_argument("--phase-s", type=float, default=30.0, help="time per concurrency target")
    ap.add_argument("--sample-s", type=float, default=10.0, help="time between samples")
    ap.add_argument("--progress-s", type=float, default=30.0, help="time between progress lines")
    return ap


def split_serve_args(
    ap: argparse.ArgumentParser,
    argv: list[str],
    usage_problem: Callable[[argparse.Namespace, list[str]], str | None],
) -> tuple[argparse.Namespace, list[str]]:
    """A tool's options, and the `vllm serve` arguments after `--` (exit 2 on a usage error,
    including the one `usage_problem` names)."""
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    problem = usage_problem(args, extra)
    if problem:
        ap.error(problem)
    return args, extra


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the `vllm serve` arguments after `--` (exit 2 on a usage error)."""
    return split_serve_args(parser(), argv, usage_problem)


def usage_problem(args: argparse.Namespace, extra: list[str]) -> str | None:
    """What makes this command line unusable, before anything starts."""
    if not (args.model / "synthetic_model.json").is_file():
        return f"--model {args.model}: not a make-test-model checkpoint (no synthetic_model.json)"
    if args.cold is not None and not args.cold.is_file():
        return f"--cold {args.cold}: no such file"
    if args.duration_s <= 0 or args.warmup_s < 0 or args.warmup_s >= args.duration_s:
        return "need --duration-s > --warmup-s >= 0"
    if not 1 <= args.max_concurrency <= 256 or args.long_tokens < 64:
        return "need 1 <= --max-concurrency <= 256 and --long-tokens >= 64"
    given, need = extra_value(extra, "--max-model-len"), args.long_tokens + MAX_GEN[1]
    if given is not None and (not given.isdigit() or int(given) < need):
        return f"--max-model-len {given} is below --long-tokens + {MAX_GEN[1]} = {need}"
    return None


def extra_value(extra: list[str], flag: str) -> str | None:
    """The value of `flag` among the vLLM arguments (`--flag V` or `--flag=V`), last wins."""
    value = None
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            value = extra[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# -- the server --------------------------------------------------------------------------


def server_env(cold: pathlib.Path, out: pathlib.Path, self_check: int) -> dict[str, str]:
    """The series' default serving settings with the self-check on, and where the server
    writes its usage counts and metrics snapshots."""
    return {
        "VLLM_EXPERT_COLD_FILE": str(cold),
        "VLLM_EXPERT_ONE_TABLE": "1",
        "VLLM_EXPERT_PREFILL_STAGING": "1",
        "VLLM_EXPERT_SWAP_SELF_CHECK": str(self_check),
        "VLLM_EXPERT_COUNT_FILE": str(out / "counts.json"),
        "VLLM_EXPERT_METRICS_DIR": str(out / "metrics-snap"),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }


def server_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """`vllm serve` as the module (no console script needed), room for the longest prompt
    unless the extra arguments set --max-model-len; extra arguments come last and win."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(args.model.resolve())]
    cmd += ["--port", str(args.port), "--max-num-seqs", "16", "--max-num-batched-tokens", "2048"]
    if extra_value(extra, "--max-model-len") is None:
        length = -(-(args.long_tokens + MAX_GEN[1]) // 1024) * 1024
        cmd += ["--max-model-len", str(length)]
    return cmd + extra


class ServerFailed(RuntimeError):
    """The server died or never answered /health; the message ends with its log's tail."""


class Server:
    """`vllm serve` in its own session (its process group holds the engine core too), with
    `env` over this process's environment, or (inherit=False) with `env` alone."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], log_path: pathlib.Path, inherit: bool = True
    ) -> None:
        self.cmd, self.env, self.log_path, self.inherit = cmd, env, log_path, inherit
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.cmd,
                env={**os.environ, **self.env} if self.inherit else dict(self.env),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, base_url: str, timeout_s: float) -> float:
        """Seconds until /health answered 200; ServerFailed if the process exits first or
        the time runs out."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise ServerFailed(f"no answer on {base_url}/health in {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """SIGTERM the process group and wait for all of it; SIGKILL what is left after
        `timeout_s` (then the shutdown was not clean)."""
        assert self.proc is not None
        t0, pgid = time.monotonic(), self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        out: dict[str, Any] = {"signal": "SIGTERM to the process group", "killed": False}
        try:
            out["exit_code"] = self.proc.wait(timeout_s)
            while _group_alive(pgid) and time.monotonic() - t0 < timeout_s:
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            out["exit_code"] = None
        if _group_alive(pgid):
            out["killed"] = True
            _signal_group(pgid, signal.SIGKILL)
            if out["exit_code"] is None:
                self.proc.wait(30)
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def served_model(base_url: str) -> str:
    """The model name the server answers to (its /v1/models' first id)."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


# -- the run -----------------------------------------------------------------------------


def cold_file(args: argparse.Namespace) -> pathlib.Path:
    """--cold, or the synthetic cold file of --host-experts-per-layer (as bench-offload);
    bench-vllm makes its own the same way."""
    if args.cold is not None:
        return args.cold.resolve()
    from .synthetic_cold import synthetic_cold_file

    path = (args.out / f"cold-{args.host_experts_per_layer}.json").resolve()
    synthetic_cold_file(args.model, path, args.host_experts_per_layer)
    return path


def host_experts(cold: pathlib.Path) -> int | list[int] | None:
    """Host experts per layer in a cold file: one number, or the distinct counts."""
    try:
        layers = json.loads(cold.read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    counts = sorted({len(v) for v in layers.values()})
    return counts[0] if len(counts) == 1 else counts


def new_doc(
    args: argparse.Namespace, argv: list[str], extra: list[str], env: dict, cmd: list[str], plan
) -> dict:
    """The document's fixed part, written before the server starts."""
    cold = pathlib.Path(env["VLLM_EXPERT_COLD_FILE"])
    options = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    return {
        "suite": "soak",
        "complete": False,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu_name(),
        "command": ["scripts/soak", *argv],
        "model": {
            "path": str(args.model),
            "layers": plan.geometry.num_layers,
            "host_experts_per_layer": host_experts(cold),
        },
        "settings": {"env": env, "args": {**options, "vllm_args": extra}, "server": cmd},
        "warmup_s": args.warmup_s,
        "duration_s": 0.0,
        "samples": [],
    }


class Soak:
    """One run once the server is starting: probes, traffic, probes, shutdown, with samples
    throughout and soak.json rewritten after each."""

    def __init__(self, args: argparse.Namespace, doc: dict, server: Server, prompts) -> None:
        self.args, self.doc, self.server, self.prompts = args, doc, server, prompts
        self.base = f"http://127.0.0.1:{args.port}"
        self.t0 = time.monotonic()
        self.phase = ["start-up"]
        self.traffic: Traffic | None = None
        self.sampler: Sampler | None = None

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        """soak.json as far as the run got (called after every sample)."""
        if self.sampler is not None:
            self.doc["samples"] = list(self.sampler.samples)
        if self.traffic is not None:
            self.doc["traffic"] = rep.traffic_totals(self.traffic.snapshot())
        rep.write_json(self.doc, self.args.out)

    def run(self) -> int:
        try:
            self.doc["startup_s"] = round(
                self.server.wait_healthy(self.base, self.args.health_timeout_s), 1
            )
        except ServerFailed as e:
            log(f"the server did not start: {e}")
            self.doc["error"] = f"the server did not start: {str(e)[-4000:]}"
            rep.write_json(self.doc, self.args.out)
            return EXIT_NO_SERVER
        log(f"the server answers after {self.doc['startup_s']} s")
        self.t0 = time.monotonic()  # sample times count from here
        try:
            return self.finish(*self.serve())
        except Exception as e:  # keep what was measured, say why it stopped
            log(f"the soak stopped: {type(e).__name__}: {e}")
            self.doc["error"] = f"{type(e).__name__}: {e}"
            if self.sampler is not None:
                self.sampler.stop()
            self.save()
            raise

    def serve(self) -> tuple:
        """Probes, traffic, probes, with samples throughout; what finish() judges."""
        args = self.args
        model = served_model(self.base)
        self.traffic = Traffic(self.base, model, self.prompts, args)
        first = scrape(self.base)
        take = sample_fn(self.clock, self.server.pid, self.base, self.traffic, self.phase)
        self.sampler = Sampler(args.sample_s, take, self.save)
        self.sampler.start()
        probes = self.prompts.probes(args.seed)
        self.phase[0] = "probes-start"
        start_answers, records = run_probes(self.base, model, probes, self.clock, "start")
        self.phase[0] = "traffic"
        start = self.clock()
        window = {"traffic_start": start, "warmup_end": start + args.warmup_s}
        self.doc["window"] = window
        log(f"traffic for {args.duration_s:.0f} s, up to {args.max_concurrency} in flight")
        self.doc["duration_s"] = self.traffic.run(
            args.duration_s, args.phase_s, self.clock, args.progress_s, self.server.running
        )
        window["traffic_end"] = self.clock()
        self.phase[0] = "probes-end"
        end_answers, end_records = run_probes(self.base, model, probes, self.clock, "end")
        # vLLM counts a step after sending its output, and the offload series reach /metrics
        # about a second late (docs/metrics.md): let both catch up with the last request
        time.sleep(SETTLE_S)
        last = scrape(self.base)
        self.phase[0] = "shutdown"
        self.sampler.stop()
        answers = {"prompts": {n: len(p) for n, p in probes}, "start": start_answers}
        answers["end"] = end_answers
        all_records = records + self.traffic.snapshot() + end_records
        return answers, all_records, first, last

    def finish(self, probes: dict, records: list[dict], first, last) -> int:
        """Shut the server down, judge everything, write soak.json/.md/.png."""
        log("stopping the server (SIGTERM to its process group)")
        shutdown = self.server.stop(120.0)
        shutdown["counts"] = rep.check_counts_file(self.args.out / "counts.json")
        doc, out = self.doc, self.args.out
        checks = rep.count_self_checks(self.server.log_path.read_text(errors="replace"))
        doc.update(self_check_failures=checks["failures"], self_check_passes=checks["passes"])
        doc["self_check_failure_lines"] = checks["failure_lines"]
        doc["probes"] = {**probes, "compare": rep.compare_probes(probes["start"], probes["end"])}
        doc["traffic"] = rep.traffic_totals(records)
        doc["samples"] = samples = self.sampler.samples if self.sampler else []
        w = doc["window"]
        doc["growth"] = {
            name: rep.growth(samples, key, w["traffic_start"], w["warmup_end"], w["traffic_end"])
            for name, key in (("vram", "vram_gib"), ("rss", "rss_gib"))
        }
        doc["client"] = client = rep.client_counts(records)
        if first is None or last is None:
            doc["metrics_checks"] = [{"name": "scrape", "passed": False, "error": "no /metrics"}]
        else:
            series = [{"t": 0.0, **rep.watched(first)}, *samples]
            series.append({"t": self.clock(), **rep.watched(last)})
            doc["metrics_checks"] = rep.metrics_checks(first, last, series, client)
        doc["shutdown"] = shutdown
        doc["checks"] = rep.checks(doc)
        doc.update(passed=all(doc["checks"].values()), complete=True)
        write_all(doc, records, out)
        return EXIT_OK if doc["passed"] else EXIT_FAILED


def write_all(doc: dict, records: list[dict], out: pathlib.Path) -> None:
    """The final soak.json, soak.md, soak.png and requests.jsonl, and the verdict."""
    with open(out / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if rep.plot(doc, out / "soak.png") is None:
        log("matplotlib is not importable: no soak.png")
    rep.write_json(doc, out)
    (out / "soak.md").write_text(rep.markdown(doc))
    failed = [k for k, v in doc["checks"].items() if not v]
    log(f"{'PASSED' if doc['passed'] else 'FAILED: ' + ', '.join(failed)}; results in {out}")


def report_interrupted(out: pathlib.Path) -> int:
    """`soak --report OUT`: judge a run that stopped early from what it left in OUT."""
    try:
        doc = json.loads((out / "soak.json").read_text())
    except (OSError, ValueError) as e:
        print(f"soak: error: --report {out}: no readable soak.json ({e})", file=sys.stderr)
        return EXIT_USAGE
    if doc.get("complete"):
        print(f"soak: {out} holds a finished run; its soak.md already judges it", file=sys.stderr)
        return EXIT_USAGE
    log_path = out / "server.log"
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    rep.judge_interrupted(doc, text)
    if rep.plot(doc, out / "soak.png") is None:
        log("matplotlib is not importable: no soak.png")
    rep.write_json(doc, out)
    (out / "soak.md").write_text(rep.markdown(doc))
    log(f"interrupted after {doc['duration_s']:.0f} s of traffic; results in {out}")
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--report"]:
        if len(argv) != 2:
            print("soak: error: usage: soak --report OUT", file=sys.stderr)
            return EXIT_USAGE
        return report_interrupted(pathlib.Path(argv[1]))
    args, extra = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from .testmodel.plant import load_plan

    plan = load_plan(args.model)
    cold = cold_file(args)
    env = server_env(cold, args.out.resolve(), args.self_check)
    cmd = server_command(args, extra)
    doc = new_doc(args, argv, extra, env, cmd, plan)
    server = Server(cmd, env, args.out / "server.log")
    log(f"starting the server: {' '.join(cmd)} (log: {server.log_path})")
    # a SIGTERM (`timeout`, a job runner) leaves through the `finally` below: the server runs
    # in a session of its own and would otherwise outlive the soak, holding the GPU
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_FAILED))
    server.start()
    try:
        return Soak(args, doc, server, PlanPrompts(plan)).run()
    finally:
        if server.running():
            server.stop(30.0)
        signal.signal(signal.SIGTERM, before)
