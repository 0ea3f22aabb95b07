#!/usr/bin/env bash
# Session j's second GPU run (2026-12-01), as it ran (report:
# bench/results/2026-12-01-gpu-session-j-h200.md). The first (same checkout, this file's previous
# version) ran step A, the layer-level VRAM test at the reference geometry: PASSED, a split
# layer saves 1.0055x the bytes it places on host, so offload-02's 72 MB beside the
# weights in session i's engines are not made by the split layer itself. Every engine of
# its other steps then stopped in the probe's census: after the collector is unfrozen, the
# walk meets torch.compile's fake tensors, whose storage has no data pointer (fixed since:
# the census skips them). This run, on a fresh machine:
#   1. the one-table correctness test with a swap in every layer at every step (0007's
#      boundary; session i's budget problem: 388 s for the five unpatched reference
#      engines on a cold compile cache);
#   3. beside it, one unpatched and one offload-02 engine of the 16-layer model (51 host
#      experts per layer) with EO_ALLOC_HISTORY=1: VRAM saved against the host bytes, the
#      census and the allocation sites of what offload-02 holds beside its weights. Its
#      timings share the GPU and the CPUs with step 1 and are not compared.
# Started from a copy of the checkout, in the background ("models" first while the bundle
# installs); results under R, R/done at the end:
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/2026-12-01-session-j-h200.sh [models] &
#
# The bundle's four parts (a 57 MB, b 59 MB, c 58 MB, d 22 MB) each fit one device call
# (64 MiB) beside the checkout when bench/results/raw (16 MB of earlier runs' logs) is
# moved out of the working tree for the session's calls; put it back before committing.
#
# Expected (18 min of device time left): the machine's start and installs 2.5 min; steps 1
# and 3 together about 10 min.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
EO_GPU_MEMORY_UTILIZATION=0.2 scripts/gpu-suite --budget-s 660 --out "$R/p1" \
  "tests:$T::test_int4_one_table_matches_unpatched[every-step] -rA -s" &
sleep 20 # staggered: the two steps' first engines do not compile at the same moment
EO_ALLOC_HISTORY=1 scripts/gpu-suite --budget-s 540 --out "$R/p3" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02 --paired --decode-tokens 32 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
wait
date -u +%FT%TZ > "$R/done"
