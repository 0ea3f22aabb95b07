# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu-suite on the CPU: steps run in order with their logs, OUT in arguments is the
output folder, a step with no time left is reported as not run, and the exit code says so.

    scripts/test tests/cpu/test_gpu_suite.py
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys


def test_steps_logs_and_budget(repo_root, tmp_path):
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "EO_GPU_WORK": str(tmp_path / "work"),
    }
    raw = repo_root / "tests/cpu/data/h200-runs/offload-8l"
    model = tmp_path / "work/models/m8"
    steps = [
        "model:m8:--layers 8 --no-weights",
        f"bench:--model {model} --from-runs {raw} --configs unpatched,offload-02 --out OUT/b.json",
    ]
    out = tmp_path / "out"
    cmd = [str(repo_root / "scripts/gpu-suite"), "--out", str(out), *steps]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (model / ".complete").exists() and (out / "01-model.log").exists()
    doc = json.loads((out / "b.json").read_text())
    assert {x["config"] for x in doc["runs"]} == {"unpatched", "offload-02"}
    summary = (out / "summary.txt").read_text()
    assert "step 2 (bench) exit 0" in summary

    # no time left for a step: not run, and the exit code says the suite is incomplete
    cmd = [str(repo_root / "scripts/gpu-suite"), "--budget-s", "20", "--out", str(out)]
    r = subprocess.run([*cmd, "model:m8:", "serve"], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "step 2 (serve) not run: no time left" in r.stdout


def test_the_reference_script_names_its_parts_and_refuses_others(repo_root):
    """bench/gpu-reference.sh: every part its header documents is one it runs, and an
    unknown part stops it before anything starts (no models made, exit 2)."""
    script = repo_root / "bench/gpu-reference.sh"
    text = script.read_text()
    header = text.split("set -u", 1)[0]
    documented = re.findall(r"^#   ([a-z0-9-]+) ", header, flags=re.M)
    accepted = re.search(r"\n    (models \|[^)]*)\) ;;", text).group(1).split(" | ")
    assert documented == accepted
    r = subprocess.run([str(script), "decode", "nonsense"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part 'nonsense'" in r.stderr


def test_a_serve_step_passes_serve_locals_options_before_its_workdir(repo_root, tmp_path):
    """'serve:--compose FILE --model DIR ARGS': serve-local gets its own options first (here it
    stops at the missing checkpoint, before looking for vLLM), the rest after WORKDIR."""
    out = tmp_path / "out"
    step = (
        f"serve:--compose {repo_root}/compose/2x32GB.yml --model {tmp_path}/none --max-num-seqs 1"
    )
    r = subprocess.run(
        [str(repo_root / "scripts/gpu-suite"), "--out", str(out), step],
        env={**os.environ, "EO_GPU_WORK": str(tmp_path / "work")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    log = (out / "01-serve.log").read_text()
    assert f"--model {tmp_path}/none: no config.json there" in log, log
