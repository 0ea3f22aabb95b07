# SPDX-License-Identifier: Apache-2.0
"""vLLM's own benchmark client, `vllm bench serve`, against unpatched vLLM and the compose
files' default offload path, served one after the other on one GPU.

    bench-vllm --model DIR --out DIR (--cold FILE | --host-experts-per-layer N)
               [--concurrency 1,4,16] [--input-len 256] [--output-len 128] [--repeats 3]
               [--seed 0] [--compare-with RESULT.json] [-- VLLM_SERVE_ARG...]
    bench-vllm --report OUT/SUITE.json [--compare-with RESULT.json]

For each configuration it starts `python3 -m vllm.entrypoints.cli.main serve DIR` in its own
process group (log: OUT/CONFIG/server.log), waits for /health, runs
`python3 -m vllm.entrypoints.cli.main bench serve` for every concurrency and repeat (random
dataset, --ignore-eos, temperature 0, fixed prompt and output lengths, seed + repeat, as many
warm-up requests as the concurrency, --save-result into OUT/CONFIG/), then stops the server:

  unpatched        the pinned vLLM (--vllm-site, default $EO_VLLM_SITE or /tmp/site)
  offload-03-swap  the patched copy first (--vllm-patched, default $EO_VLLM_PATCHED or
                   /tmp/vllm-patched) with the compose files' default settings: the cold file,
                   one table with the runtime swap, prefill staging

Both servers get EO_ALLOW_NO_API_KEY=1 (no API key on a local port) and the same arguments:
--max-num-seqs (the largest concurrency, at least 16), --max-num-batched-tokens 2048,
--no-enable-prefix-caching (a repeat's prompts are fresh) and a --max-model-len that holds a
prompt and its output; arguments after `--` come last and win. Every client run uses the
unpatched vLLM's client. The client starts once /health answers; a client that dies before
writing its result is started once more (a second torch process can fail to load while
another starts). Before and after every client run /metrics is scraped (host reads and swaps
per token) and VRAM and the server's RSS sampled.

Writes OUT/SUITE.json (--suite, default vllm-client; the suite format of
bench/results/README.md: one run per configuration and concurrency, every repeat's output
tokens/s, TPOT p50/p90, median TTFT, ratios against unpatched at the same concurrency), and
OUT/SUITE.md. --compare-with a bench-offload (e.g. the default24 part's) or scripts/bench
result sets this project's client's ratios beside vLLM's client's.
Exit codes: 0 every client run passed; 1 a client run failed or lost requests (what was
measured is still written); 2 usage; 3 a server did not start or died (its log's last
lines are printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from . import bench_vllm_report as rep
from .nvsmi import gpu_name
from .soak import (
    Server,
    ServerFailed,
    cold_file,
    extra_value,
    host_experts,
    split_serve_args,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 0, 1, 2, 3
SCRIPTS = pathlib.Path(__file__).resolve().parents[1]
VLLM_CLI = ["-m", "vllm.entrypoints.cli.main"]
CONFIGS = ("unpatched", "offload-03-swap")
RETRY_PAUSE_S = 5.0
GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] bench-vllm: {msg}", file=sys.stderr, flush=True)


# -- command line ------------------------------------------------------------------------


def _counts(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of concurrencies: {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be 1 or more: {text!r}")
    return sorted(set(vals))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench-vllm",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", type=pathlib.Path, help="the checkpoint folder to serve")
    ap.add_argument("--out", type=pathlib.Path, help="results folder")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--cold", type=pathlib.Path, help="the cold file of the default path")
    where.add_argument(
        "--host-experts-per-layer",
        type=int,
        help="make the cold file: the N least-used experts per layer (make-test-model DIR)",
    )
    ap.add_argument("--report", type=pathlib.Path, help="rewrite SUITE.md of a finished run")
    ap.add_argument("--compare-with", type=pathlib.Path, help="bench-offload or bench result")
    ap.add_argument("--suite", default="vllm-client", help="suite name and file name")
    ap.add_argument("--concurrency", type=_counts, default=[1, 4, 16], help="(1,4,16)")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens (256)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (128)")
    ap.add_argument("--repeats", type=int, default=3, help="client runs per concurrency (3)")
    ap.add_argument(
        "--prompts-per-stream", type=int, default=10, help="requests per concurrency slot (10)"
    )
    ap.add_argument("--min-prompts", type=int, default=32, help="requests per run at least (32)")
    ap.add_argument("--seed", type=int, default=0, help="the dataset's seed; repeat k: seed + k")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--health-timeout-s", type=float, default=900.0)
    ap.add_argument("--client-timeout-s", type=float, default=1800.0)
    ap.add_argument(
        "--vllm-site",
        type=pathlib.Path,
        default=pathlib.Path(os.environ.get("EO_VLLM_SITE") or "/tmp/site"),
        help="the pinned vLLM's site folder ($EO_VLLM_SITE, /tmp/site)",
    )
    ap.add_argument(
        "--vllm-patched",
        type=pathlib.Path,
        default=pathlib.Path(os.environ.get("EO_VLLM_PATCHED") or "/tmp/vllm-patched"),
        help="the patched copy of its vllm/ ($EO_VLLM_PATCHED, /tmp/vllm-patched)",
    )
    return ap


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the `vllm serve` arguments after `--` (exit 2 on a usage error)."""
    return split_serve_args(parser(), argv, usage_problem)


def usage_problem(args: argparse.Namespace, extra: list[str]) -> str | None:
    """What makes this command line unusable, before anything starts."""
    if args.compare_with is not None:
        try:
            read_json(args.compare_with)
        except ValueError as e:
            return f"--compare-with {args.compare_with}: {e}"
    if args.report is not None:
        if args.model or args.out or extra:
            return "--report takes only --compare-with"
        return None if args.report.is_file() else f"--report {args.report}: no such file"
    if args.model is None or args.out is None:
        return "need --model DIR and --out DIR (or --report SUITE.json)"
    if args.cold is None and args.host_experts_per_layer is None:
        return "need --cold FILE or --host-experts-per-layer N (the default path's host experts)"
    if not (args.model / "config.json").is_file():
        return f"--model {args.model}: not a checkpoint folder (no config.json)"
    if args.cold is not None and not args.cold.is_file():
        return f"--cold {args.cold}: no such file"
    if args.host_experts_per_layer is not None:
        if args.host_experts_per_layer < 1:
            return "--host-experts-per-layer must be 1 or more"
        if not (args.model / "synthetic_model.json").is_file():
            return (
                f"--host-experts-per-layer needs a make-test-model checkpoint "
                f"(no {args.model}/synthetic_model.json); give another model's --cold FILE"
            )
    if not (args.vllm_site / "vllm").is_dir():
        return f"--vllm-site {args.vllm_site}: no vllm/ there (set EO_VLLM_SITE)"
    if not (args.vllm_patched / "vllm").is_dir():
        return (
            f"--vllm-patched {args.vllm_patched}: no patched vllm/ there (scripts/test-gpu "
            f"makes it; set EO_VLLM_PATCHED)"
        )
    if min(args.input_len, args.output_len, args.repeats, args.min_prompts) < 1:
        return "need --input-len, --output-len, --repeats and --min-prompts of 1 or more"
    if args.output_len < 2:
        return "--output-len must be 2 or more (TPOT needs a second token)"
    given = extra_value(extra, "--max-model-len")
    if given is not None and (not given.isdigit() or int(given) < args.input_len + args.output_len):
        return f"--max-model-len {given} is below --input-len + --output-len"
    return None


# -- the commands ------------------------------------------------------------------------


def python_path(site: pathlib.Path, patched: pathlib.Path | None) -> str:
    """scripts/, the patched copy (the default path only), the pinned vLLM's site."""
    paths = [SCRIPTS, *([patched] if patched else []), site]
    return os.pathsep.join(str(p.resolve()) for p in paths)


def server_env(
    config: str, args: argparse.Namespace, cold: pathlib.Path | None
) -> tuple[dict[str, str], dict[str, str]]:
    """(the whole environment of a server, the part this tool sets): no VLLM_EXPERT_* setting
    from the caller's shell, the compose files' default offload settings for the default path."""
    patched = args.vllm_patched if config != "unpatched" else None
    own = {
        "PYTHONPATH": python_path(args.vllm_site, patched),
        "PYTHONUNBUFFERED": "1",
        "EO_ALLOW_NO_API_KEY": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    if config != "unpatched":
        assert cold is not None
        own.update(
            VLLM_EXPERT_COLD_FILE=str(cold),
            VLLM_EXPERT_ONE_TABLE="1",
            VLLM_EXPERT_PREFILL_STAGING="1",
        )
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EXPERT_")}
    return {**base, **own}, own


def model_len(args: argparse.Namespace) -> int:
    return max(2048, -(-(args.input_len + args.output_len) // 1024) * 1024)


def server_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """`vllm serve` as the module; the extra arguments come last and win."""
    cmd = [sys.executable, *VLLM_CLI, "serve", str(args.model.resolve()), "--port", str(args.port)]
    cmd += ["--max-num-seqs", str(max(16, *args.concurrency))]
    cmd += ["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"]
    if extra_value(extra, "--max-model-len") is None:
        cmd += ["--max-model-len", str(model_len(args))]
    return cmd + extra


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """Enough requests that every slot serves --prompts-per-stream of them, --min-prompts
    at least (a run at concurrency 1 lasts some seconds)."""
    return max(args.min_prompts, args.prompts_per_stream * concurrency)


def result_name(concurrency: int, repeat: int) -> str:
    return f"c{concurrency}-r{repeat}.json"


def client_command(
    args: argparse.Namespace, config: str, concurrency: int, repeat: int, folder: pathlib.Path
) -> list[str]:
    """`vllm bench serve` for one concurrency and repeat, its result saved in `folder`."""
    model = str(args.model.resolve())
    cmd = [sys.executable, *VLLM_CLI, "bench", "serve", "--backend", "openai"]
    cmd += ["--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "/v1/completions"]
    cmd += ["--model", model, "--tokenizer", model, "--dataset-name", "random"]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", "0", "--ignore-eos", "--temperature", "0"]
    cmd += ["--seed", str(args.seed + repeat), "--num-prompts", str(num_prompts(args, concurrency))]
    cmd += ["--max-concurrency", str(concurrency), "--num-warmups", str(concurrency)]
    cmd += ["--percentile-metrics", ",".join(rep.PERCENTILE_METRICS)]
    cmd += ["--metric-percentiles", ",".join(map(str, rep.PERCENTILES))]
    cmd += ["--save-result", "--result-dir", str(folder)]
    cmd += ["--result-filename", result_name(concurrency, repeat), "--label", config]
    cmd += ["--metadata", f"config={config}", f"repeat={repeat}", "--disable-tqdm"]
    return cmd


def client_env(args: argparse.Namespace) -> dict[str, str]:
    """The unpatched vLLM's client for both configurations (the series does not change it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EXPERT_")}
    env["PYTHONPATH"] = python_path(args.vllm_site, None)
    env["PYTHONUNBUFFERED"] = "1"
    # vLLM's Python client, whose result fields this tool reads (not the Rust one it can
    # hand `bench serve` to)
    env["VLLM_USE_RUST_BENCH"] = "0"
    return env


# -- one client run ----------------------------------------------------------------------


class ClientFailed(RuntimeError):
    """`vllm bench serve` exited non-zero, timed out or wrote no readable result."""


def run_client(
    cmd: list[str],
    env: dict[str, str],
    result: pathlib.Path,
    log_path: pathlib.Path,
    timeout: float,
) -> dict[str, Any]:
    """One client run, started once more if it dies before writing its result; its result."""
    for attempt in (1, 2):
        result.unlink(missing_ok=True)
        with open(log_path, "a") as logf:
            logf.write(f"$ {shlex.join(cmd)}\n")
            logf.flush()
            try:
                rc = subprocess.run(
                    cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                raise ClientFailed(f"vllm bench serve ran past {timeout:.0f} s") from None
        if rc == 0 and result.is_file():
            return rep.read_result(result)
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        what = f"exited {rc}" if rc else "exited 0 without writing its result"
        if attempt == 1 and not result.is_file():
            log(f"the client {what} before writing its result; starting it once more")
            time.sleep(RETRY_PAUSE_S)
            continue
        raise ClientFailed(f"vllm bench serve {what} ({log_path}):\n{tail}")
    raise AssertionError("unreachable")


# -- the server's counters and peaks -----------------------------------------------------


def counters(base_url: str):
    from .soak_traffic import scrape

    return scrape(base_url)


def counter_diff(before, after) -> dict[str, float | None] | None:
    """Generation tokens, host reads and swaps over one client run; None without /metrics."""
    if before is None or after is None:
        return None
    from .bench import prom

    d = prom.diff(before, after)["counters"]
    return {
        "generation_tokens": prom.total(d, prom.GENERATION_TOKENS),
        "host_reads": prom.total(d, prom.HOST_READS)
        if prom.exposed(after, prom.HOST_READS)
        else None,
        "swaps": prom.total(d, prom.SWAPS) if prom.exposed(after, prom.SWAPS) else None,
    }


class Peaks:
    """The GPU's VRAM used and the server's process tree's RSS, largest of the samples."""

    def __init__(self, pid: int) -> None:
        self.pid, self.vram, self.rss = pid, None, None

    def sample(self) -> None:
        from .soak_traffic import tree_rss_bytes, vram_used_gib

        vram, rss = vram_used_gib(), tree_rss_bytes(self.pid)
        if vram is not None:
            self.vram = max(self.vram or 0.0, vram)
        if rss:
            self.rss = max(self.rss or 0.0, rss / GiB)


# -- the run -----------------------------------------------------------------------------


def model_info(args: argparse.Namespace, cold: pathlib.Path) -> dict[str, Any]:
    try:
        config = json.loads((args.model / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return {
        "path": str(args.model),
        "layers": config.get("num_hidden_layers"),
        "num_experts": config.get("num_experts"),
        "host_experts_per_layer": host_experts(cold),
        "cold_file": str(cold),
    }


def host_fraction(model: dict[str, Any]) -> float | None:
    n, h = model.get("num_experts"), model.get("host_experts_per_layer")
    return h / n if isinstance(h, int) and n else None


def vllm_version(site: pathlib.Path) -> str | None:
    try:
        text = (site / "vllm" / "_version.py").read_text()
    except OSError:
        return None
    # setuptools-scm writes `__version__ = version = '0.29.0'`
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    return m.group(1) if m else None


def new_doc(args: argparse.Namespace, argv: list[str], model: dict[str, Any]) -> dict[str, Any]:
    return {
        "suite": args.suite,
        "complete": False,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu_name(),
        "command": shlex.join(["scripts/bench-vllm", *argv]),
        "model": model,
        "client": {
            "tool": "vllm bench serve",
            "vllm_version": vllm_version(args.vllm_site),
            "dataset": "random",
            "prompts": rep.PROMPTS,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "seed": args.seed,
            "repeats": args.repeats,
            "warmups": "as many warm-up requests as the concurrency",
            "num_prompts": {str(c): num_prompts(args, c) for c in args.concurrency},
        },
        "servers": {},
        "runs": [],
        "failed": [],
    }


def write(doc: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """SUITE.json (replaced whole) and SUITE.md."""
    path = out / f"{doc['suite']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(rep.add_ratios(doc), indent=1, default=str) + "\n")
    tmp.replace(path)
    path.with_suffix(".md").write_text(rep.markdown(doc))
    return path


def measure(
    args: argparse.Namespace, config: str, server: Server, record: dict, fraction: float | None
) -> list[dict[str, Any]]:
    """Every concurrency's repeats on a server that answers; one run entry per concurrency."""
    base, folder = f"http://127.0.0.1:{args.port}", args.out / config
    peaks = Peaks(server.pid)
    peaks.sample()
    env, out = client_env(args), []
    by_c: dict[int, list[dict[str, Any]]] = {}
    for c in args.concurrency:
        for k in range(args.repeats):
            log(f"{config}: concurrency {c}, repeat {k + 1} of {args.repeats}")
            result = folder / result_name(c, k)
            before = counters(base)
            one: dict[str, Any] = {"raw": str(result.relative_to(args.out))}
            try:
                res = run_client(
                    client_command(args, config, c, k, folder),
                    env,
                    result,
                    folder / "client.log",
                    args.client_timeout_s,
                )
                one["figures"] = rep.repeat_figures(res)
            except (ClientFailed, rep.ResultError) as e:
                one["error"] = str(e)
                log(f"{config}: concurrency {c}, repeat {k + 1}: {e}")
            one["counters"] = counter_diff(before, counters(base))
            peaks.sample()
            by_c.setdefault(c, []).append(one)
            if not server.running():
                raise ServerFailed(f"the server exited during the client runs:\n{server.tail()}")
    record.update(peak_vram_gib=peaks.vram, peak_host_gib=peaks.rss)
    for c, repeats in by_c.items():
        out.append(
            rep.run_entry(
                config=config,
                staging=config != "unpatched",
                concurrency=c,
                host_fraction=fraction,
                repeats=repeats,
                server=record,
            )
        )
    return out


def run_config(
    args: argparse.Namespace, extra: list[str], config: str, cold: pathlib.Path, doc: dict
) -> int:
    """Start one server, measure, stop it; its runs into `doc`."""
    folder = args.out / config
    folder.mkdir(parents=True, exist_ok=True)
    env, own = server_env(config, args, cold)
    cmd = server_command(args, extra)
    record: dict[str, Any] = {"command": cmd, "env": own, "log": str(folder / "server.log")}
    doc["servers"][config] = record
    server = Server(cmd, env, folder / "server.log", inherit=False)
    log(f"starting {config}: {shlex.join(cmd)} (log: {server.log_path})")
    server.start()
    try:
        base = f"http://127.0.0.1:{args.port}"
        record["startup_s"] = round(server.wait_healthy(base, args.health_timeout_s), 1)
        log(f"{config} answers after {record['startup_s']} s")
        fraction = 0.0 if config == "unpatched" else host_fraction(doc["model"])
        runs = measure(args, config, server, record, fraction)
    except ServerFailed as e:
        msg = f"{config}: the server did not start or died: {e}"
        log(msg)
        doc["failed"].append(msg[-4000:])
        return EXIT_NO_SERVER
    finally:
        # also after the server's own process exited: what it started may still run
        log(f"stopping {config} (SIGTERM to its process group)")
        record["shutdown"] = server.stop(120.0)
    doc["runs"] += runs
    bad = [r for r in runs if r["client_errors"] or r["failed"] or r["repeats"] < args.repeats]
    for r in bad:
        doc["failed"].append(
            f"{config} at concurrency {r['concurrency']}: {r['repeats']} of {args.repeats} "
            f"client runs measured, {r['failed']} failed requests"
            + (f"; {r['client_errors'][0].splitlines()[0]}" if r["client_errors"] else "")
        )
    return EXIT_FAILED if bad else EXIT_OK


def read_json(path: pathlib.Path, *keys: str) -> dict[str, Any]:
    """A JSON object with `keys`; ValueError saying what is wrong otherwise."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"not readable JSON ({e})") from None
    if not isinstance(doc, dict) or not set(keys) <= doc.keys():
        raise ValueError(f"a JSON object with {', '.join(keys)} expected")
    return doc


def report_again(args: argparse.Namespace) -> int:
    """`--report SUITE.json`: the comparison and SUITE.md again, e.g. after a later
    bench-offload run."""
    try:
        doc = read_json(args.report, "suite", "runs", "client")
    except ValueError as e:
        print(f"bench-vllm: error: --report {args.report}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.compare_with is not None:
        other = read_json(args.compare_with)
        rep.add_ratios(doc)
        doc["comparison"] = rep.comparison(doc, other, str(args.compare_with))
    path = write(doc, args.report.parent)
    log(f"report written: {path.with_suffix('.md')}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse_args(argv)
    if args.report is not None:
        return report_again(args)
    other = read_json(args.compare_with) if args.compare_with else None
    args.out.mkdir(parents=True, exist_ok=True)
    cold = cold_file(args)
    doc = new_doc(args, argv, model_info(args, cold))
    write(doc, args.out)
    # a SIGTERM (`timeout`, a job runner) leaves through run_config's `finally`: the server
    # runs in a session of its own and would otherwise outlive this tool, holding the GPU
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_FAILED))
    rc = EXIT_OK
    try:
        for config in CONFIGS:
            got = run_config(args, extra, config, cold, doc)
            rc = max(rc, got)
            write(doc, args.out)
            if got == EXIT_NO_SERVER:
                break
    finally:
        signal.signal(signal.SIGTERM, before)
    if other is not None:
        doc["comparison"] = rep.comparison(rep.add_ratios(doc), other, str(args.compare_with))
    doc["complete"] = rc != EXIT_NO_SERVER
    path = write(doc, args.out)
    verdict = "every client run passed" if rc == EXIT_OK else "; ".join(doc["failed"][:3])
    log(f"{verdict}; results in {path} and {path.with_suffix('.md')}")
    return rc
