# SPDX-License-Identifier: Apache-2.0
"""A stand-in for `vllm serve` in CPU tests of the serving scripts: /health, /metrics (with or
without the expert offload metrics), /v1/models, /v1/completions and /v1/chat/completions
answering one token, and the start-up lines image-smoke looks for, printed first. With
VLLM_API_KEY set, /v1/ answers 401 to a request without `Authorization: Bearer KEY`, as
vLLM's own check does; /health and /metrics need no key.

    python3 tests/cpu/fake_openai_server.py PORT [--no-metrics]
"""

import http.server
import json
import os
import sys

START_UP = """preflight: OK   vllm: 0.29.0 with the series
Expert offload active: split experts (VLLM_EXPERT_COLD_FILE) (4 of 4 MoE layers on this rank).
Expert offload: routed experts on this rank: 0.012 GiB in host memory, 0.080 GiB in VRAM.
Expert offload: host experts per MoE layer min/median/max = 64/64/64 of 512."""
METRICS = (
    'vllm:expert_offload_info{path="offload-02",rank="dp0_pp0_tp0"} 1.0\n'
    'vllm:expert_offload_host_bytes{rank="dp0_pp0_tp0"} 12582912.0\n'
)


def serve(port: int, metrics: str, api_key: str = "") -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _refused(self) -> bool:
            """Answer 401 to an API request without the key; True when it did."""
            if not api_key or not self.path.startswith("/v1"):
                return False
            if self.headers.get("Authorization") == f"Bearer {api_key}":
                return False
            self._send(json.dumps({"error": "Unauthorized"}), status=401)
            return True

        def _send(self, body: str, ctype: str = "application/json", status: int = 200) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self._refused():
                return
            if self.path in ("/health", "/metrics"):
                self._send(metrics if self.path == "/metrics" else "", "text/plain")
            elif self.path == "/v1/models":
                self._send(json.dumps({"object": "list", "data": [{"id": "tiny"}]}))
            else:
                self.send_error(404)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if self._refused():
                return
            chat = {"message": {"content": "hi"}}
            choice = chat if "chat" in self.path else {"text": " a"}
            self._send(json.dumps({"usage": {"completion_tokens": 1}, "choices": [choice]}))

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    print(START_UP, flush=True)
    metrics = "# none\n" if "--no-metrics" in sys.argv else METRICS
    serve(int(sys.argv[1]), metrics, os.environ.get("VLLM_API_KEY", ""))
