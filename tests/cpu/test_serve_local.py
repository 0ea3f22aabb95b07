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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_local_runs_the_tiny_service_and_checks_it(repo_root, tmp_path):
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
    (patched / f".series-{stamp}").touch()  # an up-to-date patched copy: not patched again
    entry = tmp_path / "entrypoint"
    entry.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$@" > {tmp_path}/args\n'
        "while [[ $# -gt 0 && $1 != --port ]]; do shift; done\n"
        f'exec python3 {repo_root}/tests/cpu/fake_openai_server.py "$2"\n'
    )
    entry.chmod(0o755)
    port = _free_port()
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "EO_VLLM_SITE": str(site),
        "EO_VLLM_PATCHED": str(patched),
        "EO_ENTRYPOINT": str(entry),
        "PORT": str(port),
    }
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
    # this host's extra arguments come after the compose file's
    assert args.index("--attention-backend") > args.index("--kv-cache-memory-bytes")
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert (work / "tiny-cold.json").is_file()
    with socket.socket() as s:  # the server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0
