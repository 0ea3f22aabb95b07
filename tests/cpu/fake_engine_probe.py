# SPDX-License-Identifier: Apache-2.0
"""Stands in for eodev.engine_probe in tests/cpu/test_paired_engines.py: starts (sleeps),
then runs CONFIG["requests"] "requests" of 20 ms, each in a turn of engine_probe.Baton, and
writes when each ran, then "shuts down" for CONFIG["shutdown_s"]; with
CONFIG["fail_at_start"], exits 3 during start-up instead.
    python3 fake_engine_probe.py CONFIG.json RESULT.json"""

import json
import os
import sys
import time

from eodev.engine_probe import Baton

launched = time.time()

with open(sys.argv[1]) as f:
    config = json.load(f)
baton = Baton(os.environ.get("EO_BATON"))
time.sleep(config["startup_s"])
if config.get("fail_at_start"):
    print("fake engine: start-up failed", flush=True)
    sys.exit(3)
started = time.time()
baton.ready()
spans = []
for _ in range(config["requests"]):
    with baton.turn():
        t0 = time.time()
        time.sleep(config.get("request_s", 0.02))
        spans.append((t0, time.time()))
baton.hold_to_exit()
finished = time.time()
with open(sys.argv[2], "w") as f:
    json.dump(
        {
            "launched": launched,
            "started": started,
            "spans": spans,
            "finished": finished,
            "waited_s": baton.waited_s,
        },
        f,
    )
time.sleep(config.get("shutdown_s", 0.0))  # an engine freeing its GPU memory
