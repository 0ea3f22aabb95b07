#!/usr/bin/env bash
# One GPU session (2026-12-01, third): correctness, counting, the tiny service and the 16-layer
# reference table, run in the background on the GPU host so that it can outlast one device
# call. Started from a copy of the checkout after the offline bundle is installed:
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/<this> [models] &
#
# ("models": only make the test models, e.g. while the bundle is still being installed.)
#
# Results under R (default /tmp/eo-out); R/done when finished.
# As run on 2026-12-01 (results: bench/results/2026-12-01-{reference-16l,offload-correctness-c,
# serve-local-tiny}-h200.md) the host-read step lacked the patched copy on PYTHONPATH (fixed
# below), both test steps were cut off at 640 s, and the device time ran out in the sweep.
# Phase 1 shares the GPU (EO_GPU_MEMORY_UTILIZATION) between work whose timings are not
# compared: GPU tests, the tiny service, and one short engine run that fills the compile
# cache for the 16-layer model. Phase 2 runs alone: the host-read cost, then the table.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
date -u +%FT%TZ > "$R/started"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
plan_models "${1:-}" "$0"
date -u +%FT%TZ > "$R/phase1"
export EO_GPU_MEMORY_UTILIZATION=0.2
scripts/gpu-suite --budget-s 640 --out "$R/p1-onetable" \
  "tests:$T::test_int4_one_table_matches_unpatched -rA -s" &
scripts/gpu-suite --budget-s 640 --out "$R/p1-more" \
  "tests:$T::test_a_driver_that_refuses_the_host_mapping_falls_back_to_two_tables tests/gpu/test_counting_engine.py $T::test_bf16_split_experts_match_unpatched -rA -s" \
  "tests:$T::test_int4_split_experts_match_unpatched $T::test_int4_host_layer_matches_unpatched $T::test_memory_moves_from_vram_to_host -rA -s" &
scripts/gpu-suite --budget-s 450 --out "$R/p1-serve" \
  'serve:--attention-backend TRITON_ATTN --gpu-memory-utilization 0.1' &
scripts/gpu-suite --budget-s 450 --out "$R/p1-warm" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched --decode-tokens 8 --repeats 1 --out OUT/warm.json" &
wait
unset EO_GPU_MEMORY_UTILIZATION
date -u +%FT%TZ > "$R/phase2"
mkdir -p "$R/p2"
PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site timeout 120 python3 scripts/bench-host-read --out "$R/p2/host_read.json" \
  > "$R/p2/host_read.log" 2>&1
scripts/gpu-suite --budget-s 1000 --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-03-swap,offload-03,offload-02,cpu-offload-gb,offload-01,offload-03-swap+hold --sweep 0.05,0.1,0.2,0.4 --decode-tokens 128 --repeats 3 --host-read-us 55.7 --out OUT/reference.json"
date -u +%FT%TZ > "$R/done"
