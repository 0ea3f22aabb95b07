#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01, not yet run): what the third session of
# 2026-12-01 could not finish, in priority order, each phase alone on the GPU. Started as
# bench/plans/2026-12-01-reference-h200.sh was (from a copy of the checkout, in the
# background, "models" first while the bundle installs); results under R, R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# Expected (30 min of device time, about 3 of them for start-up and installs): phase 1 at
# most 12 min (first engine about 3 min, then about 45 s per engine, 13 engines); phase 2 at
# most 10 min (a pair of 16-layer engines about 3 min).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
# phase 1, alone: the GPU tests not yet passed, and the swap kernels again (they now route
# expert ids to rows, 0008); the one-table correctness first (the router is no longer
# permuted: its picks must now be the unpatched ones)
scripts/gpu-suite --budget-s 720 --out "$R/p1" \
  'tests:tests/gpu/test_swap_kernels_gpu.py -rA -s' \
  "tests:$T::test_int4_one_table_matches_unpatched -rA -s" \
  'tests:tests/gpu/test_counting_engine.py -rA -s' \
  "tests:$T::test_int4_split_experts_match_unpatched $T::test_int4_host_layer_matches_unpatched $T::test_memory_moves_from_vram_to_host -rA -s" \
  "tests:$T::test_bf16_split_experts_match_unpatched -rA -s"
# phase 2, alone: the host-read cost, then issues 3 and 4's speed targets, each
# configuration beside an unpatched engine of its own, the two taking turns request by
# request (--paired; ratios within the pair): 3 pairs, about 10 min. The rest of the table
# (cpu-offload-gb, offload-01, the 20%/40% sweep) needs a session of its own.
mkdir -p "$R/p2"
PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site timeout 120 python3 scripts/bench-host-read \
  --out "$R/p2/host_read.json" > "$R/p2/host_read.log" 2>&1
scripts/gpu-suite --budget-s 600 --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-03-swap,offload-03,offload-02 --paired --decide-ab --decode-tokens 256 --repeats 3 --host-read-us 55.7 --out OUT/reference.json"
date -u +%FT%TZ > "$R/done"
