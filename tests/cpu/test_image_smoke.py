# SPDX-License-Identifier: Apache-2.0
"""scripts/image-smoke against a fake OpenAI server (no container engine: EO_LOG_FILE and
EO_PID): it passes on a server that answers, exposes the expert offload metrics and logged
the start-up lines, and fails, naming the problem, when one of those is missing.

    scripts/test tests/cpu/test_image_smoke.py
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading

import pytest

LOG = """preflight: OK   vllm: 0.29.0 with the series
INFO Expert offload active: split experts (VLLM_EXPERT_COLD_FILE) (4 of 4 MoE layers on this rank).
INFO Expert offload: routed experts on this rank: 0.012 GiB in host memory, 0.080 GiB in VRAM.
INFO Expert offload: host experts per MoE layer min/median/max = 64/64/64 of 512.
"""
METRICS = (
    "# TYPE vllm:expert_offload_info gauge\n"
    'vllm:expert_offload_info{path="offload-02",rank="dp0_pp0_tp0"} 1.0\n'
    "# TYPE vllm:expert_offload_host_bytes gauge\n"
    'vllm:expert_offload_host_bytes{rank="dp0_pp0_tp0"} 12582912.0\n'
)


def _server(metrics: str):
    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, body: str, ctype="application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send("")
            elif self.path == "/metrics":
                self._send(metrics, "text/plain")
            else:
                self.send_error(404)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            choice = {"text": " a b"} if "chat" not in self.path else {"message": {"content": "hi"}}
            self._send(json.dumps({"usage": {"completion_tokens": 2}, "choices": [choice]}))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    "metrics,log,ok,why",
    [
        (METRICS, LOG, True, "all checks passed"),
        ("# nothing\n", LOG, False, "/metrics has no expert offload metrics"),
        (METRICS, LOG.replace("preflight: OK", "preflight: skipped"), False, "preflight: OK"),
    ],
    ids=["good", "no-metrics", "no-preflight-line"],
)
def test_image_smoke_without_a_container_engine(repo_root, tmp_path, metrics, log, ok, why):
    server = _server(metrics)
    log_file = tmp_path / "server.log"
    log_file.write_text(log)
    env = {
        **os.environ,
        "EO_URL": f"http://127.0.0.1:{server.server_address[1]}",
        "EO_LOG_FILE": str(log_file),
        "EO_PID": str(os.getpid()),
        "EO_WAIT_S": "20",
    }
    try:
        r = subprocess.run(
            [str(repo_root / "scripts/image-smoke")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.shutdown()
    out = r.stdout + r.stderr
    assert (r.returncode == 0) == ok, out
    assert why in out
    if ok:
        assert "offload-02" in out and "GiB of experts on host" in out


def test_a_server_process_that_died_fails_the_wait(repo_root, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "server.log").write_text("Traceback: it crashed\n")
    env = {
        **os.environ,
        "EO_URL": "http://127.0.0.1:9",  # nothing listens
        "EO_LOG_FILE": str(tmp_path / "server.log"),
        "EO_PID": str(dead.pid),
    }
    r = subprocess.run(
        [str(repo_root / "scripts/image-smoke")], env=env, capture_output=True, text=True
    )
    assert r.returncode == 1
    assert "the service is not running" in r.stderr and "it crashed" in r.stderr
