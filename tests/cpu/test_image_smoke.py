# SPDX-License-Identifier: Apache-2.0
"""scripts/image-smoke against a fake OpenAI server (no container engine: EO_LOG_FILE and
EO_PID): it passes on a server that answers, exposes the expert offload metrics and logged
the start-up lines, and fails, naming the problem, when one of those is missing; with an API
key it sends the key and fails on a server that answers without one.

    scripts/test tests/cpu/test_image_smoke.py
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest


def _without_keys(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in ("VLLM_API_KEY", "API_KEY_FILE")}


def _server(metrics: bool, api_key: str = ""):
    """The fake server in a process of its own (checking `api_key` when given), and its
    start-up lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(pathlib.Path(__file__).with_name("fake_openai_server.py"))]
    proc = subprocess.Popen(
        [*cmd, str(port), *([] if metrics else ["--no-metrics"])],
        stdout=subprocess.PIPE,
        text=True,
        env=_without_keys(os.environ) | ({"VLLM_API_KEY": api_key} if api_key else {}),
    )
    lines = [proc.stdout.readline() for _ in range(4)]  # printed before it serves
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    return proc, port, "".join(lines)


@pytest.mark.parametrize(
    "metrics,preflight,ok,why",
    [
        (True, True, True, "all checks passed"),
        (False, True, False, "/metrics has no expert offload metrics"),
        (True, False, False, "preflight: OK"),
    ],
    ids=["good", "no-metrics", "no-preflight-line"],
)
def test_image_smoke_without_a_container_engine(repo_root, tmp_path, metrics, preflight, ok, why):
    server, port, log = _server(metrics)
    log_file = tmp_path / "server.log"
    log_file.write_text(log if preflight else log.replace("preflight: OK", "preflight: skip"))
    try:
        r = _smoke(repo_root, port, log_file)
    finally:
        server.kill()
        server.wait()
    out = r.stdout + r.stderr
    assert (r.returncode == 0) == ok, out
    assert why in out
    if ok:
        assert "offload-02" in out and "GiB of experts on host" in out
        assert "no API key" in out  # an open server, said so


def _smoke(repo_root, port: int, log_file: pathlib.Path, **env: str):
    env = {
        **_without_keys(os.environ),
        "EO_URL": f"http://127.0.0.1:{port}",
        "EO_LOG_FILE": str(log_file),
        "EO_PID": str(os.getpid()),
        "EO_WAIT_S": "20",
        **env,
    }
    return subprocess.run(
        [str(repo_root / "scripts/image-smoke")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "server_key, smoke_env, ok, why",
    [
        ("k-123", {"VLLM_API_KEY": "k-123"}, True, "without the API key: 401"),
        ("k-123", {"API_KEY_FILE": "key-file"}, True, "without the API key: 401"),
        ("k-123", {"VLLM_API_KEY": "wrong"}, False, "POST /v1/completions failed"),
        ("k-123", {}, False, "POST /v1/completions failed"),
        ("", {"VLLM_API_KEY": "k-123"}, False, "answered 200, not 401: the API is open"),
        ("k-123", {"API_KEY_FILE": "missing"}, False, "API_KEY_FILE="),
    ],
    ids=["key", "key-file", "wrong-key", "no-key", "open-server", "no-key-file"],
)
def test_image_smoke_sends_the_api_key_and_checks_it_is_needed(
    repo_root, tmp_path, server_key, smoke_env, ok, why
):
    server, port, log = _server(True, server_key)
    log_file = tmp_path / "server.log"
    log_file.write_text(log)
    (tmp_path / "key-file").write_text("k-123\n")
    smoke_env = {k: str(tmp_path / v) if k == "API_KEY_FILE" else v for k, v in smoke_env.items()}
    try:
        r = _smoke(repo_root, port, log_file, **smoke_env)
    finally:
        server.kill()
        server.wait()
    out = r.stdout + r.stderr
    assert (r.returncode == 0) == ok, out
    assert why in out, out
    assert "k-123" not in out  # the key is never printed


def test_a_server_process_that_died_fails_the_wait(repo_root, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "server.log").write_text("Traceback: it crashed\n")
    env = {
        **_without_keys(os.environ),
        "EO_URL": "http://127.0.0.1:9",  # nothing listens
        "EO_LOG_FILE": str(tmp_path / "server.log"),
        "EO_PID": str(dead.pid),
    }
    r = subprocess.run(
        [str(repo_root / "scripts/image-smoke")], env=env, capture_output=True, text=True
    )
    assert r.returncode == 1
    assert "the service is not running" in r.stderr and "it crashed" in r.stderr
