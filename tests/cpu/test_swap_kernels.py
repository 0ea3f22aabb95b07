# SPDX-License-Identifier: Apache-2.0
"""The runtime-swap kernels on the CPU, through Triton's interpreter
(tests/cpu/swap_interpreted_checks.py, in a process of its own: Triton fixes the interpreter
mode when it is first imported, and this process has imported it compiled).

    scripts/test tests/cpu/test_swap_kernels.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_swap_kernels_in_the_triton_interpreter(repo_root):
    checks = repo_root / "tests/cpu/swap_interpreted_checks.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    # every check ran: none skipped or deselected
    assert re.fullmatch(r"=* ?\d+ passed(, \d+ warnings?)? in .*", summary), summary
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 15, summary
