#!/usr/bin/env bash
# Session m's second machine (2026-12-02), with the 9.5 minutes of device time left after
# its first run (2026-12-02-session-m1-h200.sh). That run found the process's VRAM saved
# at 91.9% / 92.0% of the host bytes with 0012's blocks from a pool of their own or from the default pool
# alike, and in both split engines the six largest stranded segments (20 MiB each) holding
# only 2,621,440 B (a router gate, [512, 2560] bf16) each. 0012 now moves only a table's tensors of 10 MiB or
# more into the block, leaving the qzeros (5.9 and 2.9 MB) beside the gates. This run:
# unpatched and offload-02 side by side on the 16-layer model at 10% host, for the memory
# numbers only (32 decode tokens, one repeat). Start it as that plan ("models" first).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
if [[ ${1:-} == models ]]; then
  touch "$R/p0.started"
  scripts/gpu-suite --budget-s 120 --out "$R/p0-models" 'model:target-int4-16l:--layers 16'
  touch "$R/p0.done"
  exit 0
fi
while [[ ! -f $R/p0.done ]]; do sleep 2; done
scripts/test-gpu --collect-only -q tests/gpu/test_smoke.py > "$R/00-patch.log" 2>&1
scripts/gpu-suite --budget-s 380 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02 --group 4 --decode-tokens 32 --repeats 1 --host-read-us 55.5 --out OUT/memory.json"
date -u +%FT%TZ > "$R/done"
