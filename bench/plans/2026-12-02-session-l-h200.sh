#!/usr/bin/env bash
# Session l's first run (2026-12-02; prepared after session k as next-h200.sh). Results:
# bench/results/2026-12-02-gpu-session-l-h200.md. Session k
# (report: bench/results/2026-12-01-gpu-session-k-h200.md) found offload-02's missing VRAM
# in the allocator blocks of its GPU experts: 91,170,304 B larger than the tensors in them,
# against 22,675,456 B unpatched, so the 16-layer engine saved 96.7% of its host bytes by
# torch's count (issue 3 asks for within 2%). Patch 0012 now copies each split layer's GPU
# table into one allocation after its repack; its GPU run was lost with session k's second
# machine. This run, the one-block copy first:
#   1. unpatched and offload-02 on the 16-layer model at 10% host, side by side: VRAM saved
#      by torch's and the driver's counts, the experts' block slack (one block per layer:
#      at most 1 MiB each), greedy tokens against unpatched. Two engines on a cold compile
#      cache took more than 245 s in session k: 480 s;
#   2. the kernel-level split tests through the copy: outputs against the unsplit layer
#      (INT4 Marlin, BF16 Triton) and the VRAM test at 1 and 16 layers;
#   3. offload-02's live-engine correctness and memory tests (8 layers; the five reference
#      engines side by side took 381 s in session k).
# Started as before (from a copy of the checkout, in the background, "models" first while
# the bundle installs); results under R, R/done at the end:
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The bundle's four parts (a 57 MB, b 59 MB, c 58 MB, d 22 MB) each fit one device call
# (64 MiB) beside the checkout when bench/results/raw is moved out of the working tree for
# the session's calls; put it back before committing. Keep the machine with back-to-back
# polling calls (it goes back 30 s after a call returns; session k lost one that way).
#
# Expected (30 min of device time; machine start and installs about 1.5 min): 1 up to 8 min,
# 2 about 3 min, 3 about 8 min.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
K=tests/gpu/test_expert_map_kernels.py
scripts/gpu-suite --budget-s 480 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02 --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
scripts/gpu-suite --budget-s 240 --out "$R/p2" \
  "tests:$K::test_split_layer_equals_full_layer $K::test_split_layer_saves_the_vram_it_places_on_host -rA -s"
scripts/gpu-suite --budget-s $((1500 - SECONDS)) --out "$R/p3" \
  "tests:$T::test_int4_split_experts_match_unpatched $T::test_memory_moves_from_vram_to_host -rA -s"
date -u +%FT%TZ > "$R/done"
