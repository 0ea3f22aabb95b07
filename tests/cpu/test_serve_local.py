# SPDX-License-Identifier: Apache-2.0
"""scripts/serve-local's orchestration on the CPU, with a fake server in place of the image's
entrypoint (EO_ENTRYPOINT): the tiny model and cold file are made, the server gets
compose/tiny.yml's arguments with this host's model path, image-smoke and the compose file's
healthcheck command run against it, and the server is stopped afterwards.

    scripts/test tests/cpu/test_serve_local.py
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_host(repo_root, tmp_path) -> dict[str, str]:
    """An up-to-date patched vLLM copy (not patched again) and a fake server in place of the
    image's entrypoint that records its arguments and environment; the environment to run
    serve-local with."""
    site, patched = tmp_path / "site", tmp_path / "patched"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "_version.py").write_text("__version__ = '0.29.0'\n")
    stamp = subprocess.run(
        ["bash", "-c", "cat patches/series patches/*.patch | sha256sum | cut -c1-16"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    patched.mkdir()
    (patched / f".series-{stamp}").touch()
    entry = tmp_path / "entrypoint"
    entry.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$@" > {tmp_path}/args\n'
        f"env > {tmp_path}/env\n"
        "while [[ $# -gt 0 && $1 != --port ]]; do shift; done\n"
        f'exec python3 {repo_root}/tests/cpu/fake_openai_server.py "$2"\n'
    )
    entry.chmod(0o755)
    keys = ("VLLM_API_KEY", "EO_ALLOW_NO_API_KEY", "API_KEY_FILE")
    return {
        **{k: v for k, v in os.environ.items() if k not in keys},
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "EO_VLLM_SITE": str(site),
        "EO_VLLM_PATCHED": str(patched),
        "EO_ENTRYPOINT": str(entry),
        "PORT": str(_free_port()),
    }


def test_serve_local_runs_the_tiny_service_and_checks_it(repo_root, tmp_path):
    env = fake_host(repo_root, tmp_path)
    port = int(env["PORT"])
    work = tmp_path / "work"
    r = subprocess.run(
        [str(repo_root / "scripts/serve-local"), str(work), "--attention-backend", "TRITON_ATTN"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "image-smoke: all checks passed" in out
    assert "serve-local: the healthcheck command succeeded" in out
    args = (tmp_path / "args").read_text().split("\n")
    assert args[0] == str(work / "tiny")  # compose's /models/tiny, where this host has it
    assert args[args.index("--served-model-name") + 1] == "tiny"
    assert args[args.index("--port") + 1] == str(port)
    # without an API key, on this host's loopback only
    assert args[args.index("--host") + 1] == "127.0.0.1"
    # this host's extra arguments come after the compose file's
    assert args.index("--attention-backend") > args.index("--kv-cache-memory-bytes")
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert (work / "tiny-cold.json").is_file()
    with socket.socket() as s:  # the server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0
    # closed by default: a key made for the run, which the server (the fake checks it as
    # vLLM does) and image-smoke got, and the model is read offline
    seen = _env(tmp_path)
    assert len(seen["VLLM_API_KEY"]) == 32 and seen["EO_ALLOW_NO_API_KEY"] == "0"
    assert seen["HF_HUB_OFFLINE"] == "1"
    assert "image-smoke: without the API key: 401" in out and "API key: required" in out
    assert seen["VLLM_API_KEY"] not in out


def _env(tmp_path) -> dict[str, str]:
    """The environment the fake entrypoint was started with."""
    text = (tmp_path / "env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.mark.parametrize(
    "shell, key, said",
    [
        ({"VLLM_API_KEY": "mine-123"}, "mine-123", "image-smoke: without the API key: 401"),
        ({"EO_ALLOW_NO_API_KEY": "1"}, "", "image-smoke: no API key"),
    ],
    ids=["shell-key", "open"],
)
def test_serve_local_passes_the_shells_key_or_starts_open(repo_root, tmp_path, shell, key, said):
    env = {**fake_host(repo_root, tmp_path), **shell}
    r = subprocess.run(
        [str(repo_root / "scripts/serve-local"), str(tmp_path / "work")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert said in out
    seen = _env(tmp_path)
    assert seen["VLLM_API_KEY"] == key
    assert seen["EO_ALLOW_NO_API_KEY"] == shell.get("EO_ALLOW_NO_API_KEY", "0")


def test_serve_local_serves_the_2x32gb_command_line_with_a_local_model(repo_root, tmp_path):
    """compose/2x32GB.yml's arguments and environment, the model where this host has it, no
    cold file (a budget-only start whose state stays in WORKDIR), Compose's ${VAR:-default}
    from the shell, the extra arguments last."""
    env = fake_host(repo_root, tmp_path)
    model = tmp_path / "qwen4exp"
    model.mkdir()
    (model / "config.json").write_text("{}")
    work = tmp_path / "work"
    command = [
        str(repo_root / "scripts/serve-local"),
        "--compose",
        str(repo_root / "compose/2x32GB.yml"),
        "--model",
        str(model),
        str(work),
        "--max-model-len",
        "4096",
    ]
    shell = {**env, "ONE_TABLE": "0", "SERVED_MODEL_NAME": "q4"}  # the shell wins
    shell["VLLM_API_KEY"] = "the-shell-key"  # the server's key, which its checks send
    for _ in range(2):  # a second start in the same WORKDIR keeps the first one's log
        r = subprocess.run(command, env=shell, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
    assert (work / "server.log").is_file() and (work / "server.1.log").is_file()
    assert "serving" in out and "budget-only start" in out
    assert "serve-local: the healthcheck command succeeded" in out
    args = (tmp_path / "args").read_text().split("\n")
    assert args[0] == str(model)
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--served-model-name") + 1] == "q4"
    # the compose file's --max-model-len first, this host's last (argparse keeps the last)
    lens = [args[i + 1] for i, a in enumerate(args) if a == "--max-model-len"]
    assert lens == ["262144", "4096"]
    seen = _env(tmp_path)
    assert seen["EO_TOPOLOGY"] == "2x32GB"
    assert seen["VLLM_PLE_TABLE"] == "auto"  # compose: PLE_TABLE, default auto
    assert seen["VLLM_EXPERT_ONE_TABLE"] == "0"  # the file's default is 1
    assert seen["VLLM_EXPERT_PREFILL_STAGING"] == "1"
    assert seen["EO_HOST_BUDGET_GIB"] == "7.6"
    assert seen["VLLM_EXPERT_COLD_FILE"] == ""
    assert seen["EO_STATE_DIR"] == str(work / "state") and (work / "state").is_dir()
    assert seen["EO_ALLOW_NO_API_KEY"] == "0" and seen["VLLM_API_KEY"] == "the-shell-key"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compose", "compose/2x32GB.yml", "W"], "--compose needs --model DIR"),
        (["--compose", "compose/none.yml", "--model", ".", "W"], "no compose file"),
        (["--compose", "compose/2x32GB.yml", "--model", "scripts", "W"], "no config.json"),
        (["--model", "scripts", "W"], "--model and --cold go with --compose"),
        (["--frobnicate", "W"], "unknown option --frobnicate"),
    ],
)
def test_serve_local_usage_errors(repo_root, argv, message):
    r = subprocess.run(
        [str(repo_root / "scripts/serve-local"), *argv],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


def test_compose_service_replaces_the_mounts_and_reads_the_shell(repo_root, tmp_path):
    from eodev.compose_service import local_service

    svc = local_service(
        repo_root / "compose/3x24GB.yml",
        pathlib.Path("/m/q"),
        pathlib.Path("/c/cold.json"),
        tmp_path,
        {"HOST_BUDGET_GIB": "2.5"},
    )
    assert svc.args[0] == "/m/q" and "--pipeline-parallel-size" in svc.args
    assert svc.env["VLLM_EXPERT_COLD_FILE"] == "/c/cold.json"
    assert svc.env["EO_HOST_BUDGET_GIB"] == "2.5" and svc.env["EO_TOPOLOGY"] == "3x24GB"
    assert svc.served_model_name == "Qwen3.8-Flash-Next-INT4"
    bad = tmp_path / "two.yml"
    bad.write_text("services: {a: {command: [x]}, b: {command: [y]}}\n")
    with pytest.raises(ValueError, match="expected one service"):
        local_service(bad, pathlib.Path("/m"), None, tmp_path, {})
