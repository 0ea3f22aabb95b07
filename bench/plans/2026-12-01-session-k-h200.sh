#!/usr/bin/env bash
# Session k's run (2026-12-01; prepared after session j as next-h200.sh, then reordered:
# step 1 first, since it was cut off in sessions i and j and issue 4 waits on it). Session j
# (report: bench/results/2026-12-01-gpu-session-j-h200.md) found that offload-02's engine
# holds the unpatched engine's live tensors beside its weights (census and allocation
# sites within 75 KB), so its 72 MB shortfall of VRAM saved (96.5% of the host bytes by
# torch's count; issue 3 asks for 98%) sits in the allocator blocks of its GPU tables;
# patch 0012 empties torch's pool before each split layer's repack, unverified. Its
# correctness step was cut off twice: the five unpatched reference engines took 574 s one
# after another; they now start side by side. This run:
#   A. the layer-level VRAM test at the reference geometry, 1 layer and 16 layers loaded
#      before any is repacked (as vLLM's loader does), with the series' patch 0012: does a
#      split model save at least 98% of its host bytes, and what do the experts' allocator
#      blocks hold beyond their bytes;
#   1. correctness: offload-02 at prefill chunk 2048 (logprobs against the unpatched
#      noise), one table with a swap in every layer at every step (0007's boundary, cut
#      off in sessions i and j), and the memory test (8 layers, 64 host experts per
#      layer: VRAM saved within 2% of the host bytes); the reference engines side by side;
#   3. group 1 of the suite (unpatched, offload-02, one table, swap, --cpu-offload-gb at
#      10%) against session i's table: VRAM saved with 0012 by the driver's and torch's
#      counts, the experts' block slack in every engine, and a third run of group 1.
# Started as before (from a copy of the checkout, in the background, "models" first while
# the bundle installs); results under R, R/done at the end:
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The bundle's four parts (a 57 MB, b 59 MB, c 58 MB, d 22 MB) each fit one device call
# (64 MiB) beside the checkout when bench/results/raw (17 MB of earlier runs' logs) is
# moved out of the working tree for the session's calls; put it back before committing.
# A helper that polls the plan with back-to-back calls keeps the machine (it goes back
# 30 s after a call returns) while the session works on the results that come in.
#
# Expected (30 min of device time; session j: machine start and installs 2.5 min): A up to
# 5 min (16 layers loaded twice; the one-layer test took 33 s in session j); 1 about
# 8 min (one cold compile, four warm reference engines side by side, two patched
# engines); 3 about 7 min (session i's group 1: 373 s).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
scripts/gpu-suite --budget-s 780 --out "$R/p1" \
  "tests:$T::test_int4_split_experts_match_unpatched[2048] $T::test_int4_one_table_matches_unpatched[every-step] $T::test_memory_moves_from_vram_to_host -rA -s"
scripts/gpu-suite --budget-s 300 --out "$R/pA" \
  "tests:tests/gpu/test_expert_map_kernels.py -k saves_the_vram -rA -s"
scripts/gpu-suite --budget-s $((1540 - SECONDS)) --out "$R/p3" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --compare-with bench/results/2026-12-01-reference-d-16l-h200.json --out OUT/group1.json"
date -u +%FT%TZ > "$R/done"
