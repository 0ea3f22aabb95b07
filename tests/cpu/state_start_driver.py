# SPDX-License-Identifier: Apache-2.0
"""A budget-only start that then "serves" as the container would, for test_state_dir.py's
race: it runs budget-start in-process, writes this run's counts where
VLLM_EXPERT_COUNT_FILE points (as the counting hook does), and holds the state folder's lock
until its stdin closes.

    state_start_driver.py MODEL STATE BUDGET_GIB VALUE

Prints "ready" once imported, waits for one line on stdin (so that two drivers start
together), then either exits with budget-start's code (a refusal) or prints "serving".
Every decode count of the run is VALUE.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))

import numpy as np  # noqa: E402
from eotools import budget_start  # noqa: E402
from eotools.coldset import model_identity  # noqa: E402
from eotools.counts import Counts  # noqa: E402


def main() -> int:
    model, state, gib, value = sys.argv[1:5]
    print("ready", flush=True)
    sys.stdin.readline()
    out = io.StringIO()
    argv = ["--budget-gib", gib, "--state-dir", state, "--model", model, "--pp-size", "1"]
    with contextlib.redirect_stdout(out):
        rc = budget_start.main(argv)
    if rc:
        return rc
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.getvalue().splitlines())
    count_file = pathlib.Path(shlex.split(env["VLLM_EXPERT_COUNT_FILE"])[0])
    ident = model_identity(pathlib.Path(model))
    decode = np.full((ident["num_layers"], ident["num_experts"]), int(value), dtype=np.int64)
    Counts(
        {**ident, "name": str(model)},  # the hook records the path vLLM was given
        {"name": "served", "tokens": {"prefill": 0, "decode": int(value)}},
        np.zeros_like(decode),
        decode,
        8,
        "vllm counting hook",
        {"rank": {"pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1}},
    ).save(count_file)
    print("serving", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
