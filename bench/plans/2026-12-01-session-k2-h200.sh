#!/usr/bin/env bash
# Executed 00:03-00:10 UTC; the machine was lost before its results came back (report:
# bench/results/2026-12-01-gpu-session-k-h200.md, "Run 2").
# Session k's second run (2026-12-01, 9.5 min of device time left after the first,
# bench/plans/2026-12-01-session-k-h200.sh). The first run's probe located offload-02's
# missing VRAM: the allocator blocks that hold its GPU experts were 91,170,304 B larger
# than the tensors in them (unpatched: 22,675,456 B). Patch 0012 now copies each split
# layer's GPU table into one allocation after repack. This run:
#   1. unpatched and offload-02 on the 16-layer model at 10% host, side by side: VRAM saved
#      against the host bytes by torch's and the driver's counts, the experts' block slack,
#      greedy tokens against unpatched;
#   2. the kernel-level tests of a split layer: outputs against the unsplit layer (INT4
#      Marlin and BF16 Triton, through the one-block copy) and the VRAM test at 1 and 16
#      layers (its build now collects earlier layers first).
# Only the 16-layer model is made ("models", while the bundle installs). Results under R.
set -u
R=${R:-/tmp/eo-out}
mkdir -p "$R"
export EO_VLLM_SITE=/tmp/site PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
M=/tmp/eo-gpu/models
if [[ ${1:-} == models ]]; then
  scripts/gpu-suite --budget-s 120 --out "$R/p0-models" 'model:target-int4-16l:--layers 16'
  touch "$R/p0.done"
  exit 0
fi
while [[ ! -f $R/p0.done ]]; do sleep 2; done
scripts/test-gpu --collect-only -q tests/gpu/test_smoke.py > "$R/00-patch.log" 2>&1
scripts/gpu-suite --budget-s 280 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02 --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
scripts/gpu-suite --budget-s $((420 - SECONDS)) --out "$R/p2" \
  "tests:tests/gpu/test_expert_map_kernels.py::test_split_layer_equals_full_layer tests/gpu/test_expert_map_kernels.py::test_split_layer_saves_the_vram_it_places_on_host -rA -s"
date -u +%FT%TZ > "$R/done"
