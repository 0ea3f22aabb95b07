# SPDX-License-Identifier: Apache-2.0
"""scripts/dev-env: the CPU build of torch or a clear stop (never a silent CUDA install), and
no re-install of the patched vLLM when nothing it is made from changed."""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
import subprocess
import sys
import time
import zipfile

import pytest
from eotools.pin import PIN


def fake_wheel(folder: pathlib.Path, name: str, version: str, requires: list[str]) -> None:
    """A minimal pure-Python wheel that pip installs (METADATA, WHEEL, RECORD)."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    files = {
        f"{info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text)}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def offline_pip_env(wheels: pathlib.Path) -> dict[str, str]:
    """pip sees only `wheels`; the PyTorch CPU index is out of reach (a closed port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheels),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        EO_TORCH_INDEX="http://127.0.0.1:9/whl/cpu",
    )
    return env


def test_dev_env_refuses_a_cuda_torch_when_the_cpu_build_is_out_of_reach(repo_root, tmp_path):
    """Where pip would resolve torch==PIN to the CUDA build (it pulls nvidia-* packages),
    dev-env stops before installing anything, and says what to do."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "torch", PIN.torch_version, ["nvidia-cublas-cu12"])
    fake_wheel(wheels, "nvidia-cublas-cu12", "12.0", [])
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run(
        [str(repo_root / "scripts/dev-env"), "--venv", str(venv)],
        capture_output=True,
        text=True,
        env=offline_pip_env(wheels),
        timeout=600,
    )
    assert r.returncode == 4, r.stderr[-3000:]
    assert "is the CUDA build" in r.stderr and "EO_TORCH_CUDA_OK=1" in r.stderr, r.stderr
    assert not list(venv.glob("lib/python*/site-packages/torch*")), "torch was installed"


def test_torch_from_a_local_cpu_wheel_is_taken(repo_root, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "torch", PIN.torch_version, ["filelock"])
    fake_wheel(wheels, "filelock", "3.0", [])
    script = (
        f". {repo_root}/scripts/lib/pin.sh && . {repo_root}/scripts/lib/torch.sh && "
        f'torch_cpu_args {sys.executable} && echo "${{TORCH_ARGS[*]}}"'
    )
    r = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=offline_pip_env(wheels)
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"torch=={PIN.torch_version}"


def test_a_second_run_does_not_reinstall_the_patched_vllm(repo_root):
    """The test environment made by scripts/dev-env (scripts/test, CI) is ready as it is."""
    venv = pathlib.Path(sys.prefix)
    if not (venv / ".eo-patched-vllm").is_file():
        pytest.skip(f"{venv} was not made by scripts/dev-env (run the tests with scripts/test)")
    start = time.monotonic()
    r = subprocess.run(
        [str(repo_root / "scripts/dev-env"), "--venv", str(venv)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unchanged since the last run" in r.stderr and "installing" not in r.stderr, r.stderr
    assert time.monotonic() - start < 60
