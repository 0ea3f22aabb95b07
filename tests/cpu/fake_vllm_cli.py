# SPDX-License-Identifier: Apache-2.0
"""A stand-in for `python3 -m vllm.entrypoints.cli.main` in the CPU tests of scripts/bench-vllm,
which put it in fake site folders as vllm/entrypoints/cli/main.py (the patched folder's
vllm/__init__.py says PATCHED = True):

- `serve MODEL --port P ...` answers /health, /v1/models and /metrics (the offload counters
  only with VLLM_EXPERT_COLD_FILE set), and POST /fake/run, which adds a client run's tokens
  to its counters (5 host reads and 0.5 swaps per token on the default path);
- `bench serve ...` checks that the server answers, then writes --result-dir/--result-filename
  with the fields vLLM 0.29.0's benchmarks/serve.py writes for --percentile-metrics
  ttft,tpot,itl,e2el --metric-percentiles 50,90,99: output tokens/s 100 per concurrency slot,
  0.8 times that on a patched server, 1% more per seed.

Every start appends {"argv", "env", "patched"} to $FAKE_VLLM_LOG. Failures: FAKE_SERVE=exit
(dies at start-up) or no-health (/health never answers 200); FAKE_BENCH=fail (exits 1),
mkl-once (the first run dies as torch does when it cannot load), lose-requests (2 failed).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import signal
import sys
import threading
import urllib.request

import vllm

MKL_ERROR = "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so."


def record(argv: list[str]) -> None:
    path = os.environ.get("FAKE_VLLM_LOG")
    if not path:
        return
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("VLLM_", "EO_ALLOW")) or k in ("PYTHONPATH", "OPENAI_API_KEY")
    }
    with open(path, "a") as f:
        f.write(json.dumps({"argv": argv, "env": env, "patched": vllm.PATCHED}) + "\n")


# -- serve -------------------------------------------------------------------------------


class Counters:
    def __init__(self, offload: bool) -> None:
        self.offload, self.tokens, self.lock = offload, 0.0, threading.Lock()

    def metrics(self) -> str:
        lines = [
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{engine="0"}} {self.tokens + 1000}',
        ]
        if self.offload:
            lines += [
                "# TYPE vllm:expert_offload_host_reads_total counter",
                f'vllm:expert_offload_host_reads_total{{rank="dp0_pp0_tp0"}} {self.tokens * 5}',
                "# TYPE vllm:expert_offload_swaps_total counter",
                f'vllm:expert_offload_swaps_total{{rank="dp0_pp0_tp0"}} {self.tokens * 0.5}',
            ]
        return "\n".join(lines) + "\n"


def serve(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args(argv)
    mode = os.environ.get("FAKE_SERVE", "")
    print("INFO starting the fake vLLM API server", flush=True)
    if mode == "exit":
        print("RuntimeError: no GPU here", flush=True)
        sys.exit(1)
    counters = Counters(bool(os.environ.get("VLLM_EXPERT_COLD_FILE")))

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send(503 if mode == "no-health" else 200, "")
            elif self.path == "/metrics":
                self._send(200, counters.metrics(), "text/plain")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": args.model}]}))
            elif self.path == "/fake/info":
                self._send(200, json.dumps({"patched": vllm.PATCHED}))
            else:
                self._send(404, "{}")

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/fake/run":
                with counters.lock:
                    counters.tokens += body["tokens"]
                self._send(200, "{}")
            else:
                self._send(404, "{}")

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    httpd.serve_forever()


# -- bench serve -------------------------------------------------------------------------


def metric_fields(name: str, median: float) -> dict[str, float]:
    """The fields serve.py's process_one_metric adds for one metric."""
    return {
        f"mean_{name}_ms": median * 1.05,
        f"median_{name}_ms": median,
        f"std_{name}_ms": median * 0.1,
        f"p50_{name}_ms": median,
        f"p90_{name}_ms": median * 1.2,
        f"p99_{name}_ms": median * 1.5,
    }


def bench(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--base-url", "--result-dir", "--result-filename", "--model", "--label"):
        ap.add_argument(flag, required=True)
    for flag in ("--num-prompts", "--max-concurrency", "--seed", "--random-output-len"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--random-input-len", type=int, required=True)
    args, _ = ap.parse_known_args(argv)
    mode = os.environ.get("FAKE_BENCH", "")
    if mode == "mkl-once":
        marker = pathlib.Path(args.result_dir) / ".mkl-once"
        if not marker.exists():
            marker.write_text("")
            print(MKL_ERROR, flush=True)
            sys.exit(1)
    if mode == "fail":
        print("ValueError: Initial test run failed", flush=True)
        sys.exit(1)
    with urllib.request.urlopen(args.base_url + "/health", timeout=5) as r:
        assert r.status == 200  # an HTTPError (503) ends this run with a traceback
    with urllib.request.urlopen(args.base_url + "/fake/info", timeout=5) as r:
        patched = json.loads(r.read())["patched"]
    c, n, out_len = args.max_concurrency, args.num_prompts, args.random_output_len
    failed = 2 if mode == "lose-requests" else 0
    tokens = (n - failed) * out_len
    req = urllib.request.Request(
        args.base_url + "/fake/run",
        json.dumps({"tokens": tokens + c * out_len}).encode(),  # the warm-ups too
        {"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).close()
    speed = 100.0 * c * (0.8 if patched else 1.0) * (1 + 0.01 * args.seed)
    duration = tokens / speed
    result = {
        "date": "20261204-220000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.model,
        "num_prompts": n,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": c,
        "duration": duration,
        "completed": n - failed,
        "failed": failed,
        "total_input_tokens": (n - failed) * args.random_input_len,
        "total_output_tokens": tokens,
        "request_throughput": (n - failed) / duration,
        "request_goodput": None,
        "output_throughput": speed,
        "total_token_throughput": speed * (1 + args.random_input_len / out_len),
        "max_output_tokens_per_s": speed * 1.1,
        "max_concurrent_requests": c,
        "rtfx": 0.0,
    }
    tpot = 1000.0 / (speed / c)
    for name, median in (("ttft", 20.0 * c), ("tpot", tpot), ("itl", tpot), ("e2el", 300.0)):
        result.update(metric_fields(name, median))
    out = pathlib.Path(args.result_dir) / args.result_filename
    out.write_text(json.dumps(result))
    print(f"Output token throughput (tok/s): {speed:.2f}", flush=True)


def main() -> None:
    argv = sys.argv[1:]
    record(argv)
    if argv[:1] == ["serve"]:
        serve(argv[1:])
    elif argv[:2] == ["bench", "serve"]:
        bench(argv[2:])
    else:
        sys.exit(f"fake vllm: unknown command {argv}")
