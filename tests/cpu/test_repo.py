# SPDX-License-Identifier: Apache-2.0
"""Repository invariants: the vLLM pin lives in vllm.pin and everything else agrees with it."""

from __future__ import annotations

import re
import subprocess

import pytest
from eotools.pin import PIN, read_pin


def test_pin_file_is_complete_and_consistent(repo_root):
    pin = read_pin(repo_root / "vllm.pin")
    assert pin == PIN
    assert pin.vllm_wheel.startswith(f"vllm-{pin.vllm_version}-")
    assert pin.vllm_image.endswith(f":v{pin.vllm_version}")
    assert re.fullmatch(r"[0-9a-f]{64}", pin.vllm_wheel_sha256)


def test_shell_and_python_read_the_same_pin(repo_root):
    out = subprocess.run(
        [
            "bash",
            "-c",
            f". {repo_root}/scripts/lib/pin.sh && echo $PIN_VLLM_VERSION "
            "$PIN_VLLM_IMAGE $PIN_TORCH_VERSION",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [PIN.vllm_version, PIN.vllm_image, PIN.torch_version]


def test_dockerfile_default_base_image_is_the_pin(repo_root):
    text = (repo_root / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=(\S+)$", text, re.M).group(1) == PIN.vllm_image
    assert "FROM ${VLLM_IMAGE}" in text


def test_the_version_is_written_nowhere_else(repo_root):
    """Only vllm.pin (and the Dockerfile's mirrored default, checked above) may name the
    pinned release; tools read it from there."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=repo_root, capture_output=True, text=True, check=True
    ).stdout.split()
    allowed = {"vllm.pin", "Dockerfile", "CHANGELOG.md", "README.md"}
    needle = f"vllm-{PIN.vllm_version}-"
    offenders = [
        f
        for f in tracked
        if f not in allowed
        and not f.startswith(("patches/", "bench/", "tests/README"))
        and (repo_root / f).is_file()
        and needle in (repo_root / f).read_text(errors="ignore")
    ]
    assert offenders == []


def test_patches_are_exactly_what_a_workspace_exports(repo_root, tmp_path):
    """The committed series round-trips: applied to the pinned tree with git am and exported
    again, it changes no byte (so patches/ was generated, not edited by hand)."""
    ws = tmp_path / "ws"
    subprocess.run([str(repo_root / "scripts/vllm-tree"), str(ws)], check=True, capture_output=True)
    r = subprocess.run(
        [str(repo_root / "scripts/export-patches"), "--workspace", str(ws), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_tool_in_scripts_answers_help(repo_root):
    """Every executable in scripts/ prints its usage and exits 0 on --help (but the image's
    entrypoint and its start program, whose arguments are `vllm serve`'s, as in the upstream
    image, and whose --help runs vLLM's: test_start_program.py checks it with a fake vllm)."""
    import os
    import subprocess
    import sys

    tools = sorted(
        p
        for p in (repo_root / "scripts").iterdir()
        if p.is_file() and os.access(p, os.X_OK) and p.name not in ("entrypoint.sh", "start")
    )
    assert len(tools) >= 20
    python = os.path.dirname(sys.executable)  # the tools' `env python3` is the test environment's
    env = {**os.environ, "PATH": f"{python}{os.pathsep}{os.environ['PATH']}"}
    for tool in tools:
        r = subprocess.run(
            [str(tool), "--help"], capture_output=True, text=True, env=env, timeout=120
        )
        assert r.returncode == 0, f"{tool.name} --help: rc {r.returncode}\n{r.stderr[-2000:]}"
        assert len(r.stdout.strip().splitlines()) >= 2, f"{tool.name} --help printed no usage"


TOOLS_WITH_PACKAGES = (
    "bench",
    "bench-vllm",
    "compare-logprobs",
    "make-test-model",
    "bench-host-read",
    "bench-ple-read",
    "bench-ple-file",
    "bench-cpu-experts",
    "prepare-tiny-model",
)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python without third-party packages, as a system python3 often is."""
    import subprocess
    import sys

    venv = tmp_path_factory.mktemp("bare") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.mark.parametrize("tool", TOOLS_WITH_PACKAGES)
def test_tools_started_with_another_python_use_the_project_env(repo_root, bare_python, tool):
    """`scripts/bench --help` with a python3 that lacks aiohttp (or torch) re-runs itself in
    the project's environment (EO_VENV; here the test environment), not a traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EO_VENV": sys.prefix}
    r = subprocess.run(
        [str(bare_python), str(repo_root / "scripts" / tool), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


@pytest.mark.parametrize("tool", TOOLS_WITH_PACKAGES)
def test_tools_without_the_project_env_say_how_to_make_it(repo_root, bare_python, tool, tmp_path):
    import os
    import subprocess

    env = {**os.environ, "EO_VENV": str(tmp_path / "no-venv")}
    r = subprocess.run(
        [str(bare_python), str(repo_root / "scripts" / tool), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "scripts/dev-env" in r.stderr, r.stderr
    assert f"there is no {tmp_path / 'no-venv'}/bin/python" in r.stderr


def test_test_file_names_are_unique_across_cpu_and_gpu(repo_root):
    """tests/ has no packages: pytest imports each test file by its base name, and a second
    file of the same name stops the whole collection (the GPU tests are collected in CI too,
    then deselected)."""
    names = [p.name for p in (repo_root / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
