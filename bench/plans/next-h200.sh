#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01 after session i, not yet run). Session i
# ran this plan's predecessor (report: bench/results/2026-12-01-gpu-session-i-h200.md): the
# whole reference table again, complete, but the correctness test ran out of its budget
# (its five unpatched reference engines took 388 s on a cold compile cache) and the census
# of non-weight GPU memory came back empty (vLLM freezes the garbage collector; fixed).
# This run:
#   1. the one-table correctness test with a swap in every layer at every step (0007's
#      boundary: 3 more host experts per layer at 10%), with the budget a cold cache needs;
#   2. the swap kernels' timings, with the new one: a swap of one target expert across
#      PCIe (session i: with swap, fresh prompts decoded 0.13 +- 0.08 ms per token slower
#      than one table without swap while reading 5x fewer host rows; the swap's own cost
#      has only been measured between VRAM rows);
#   3. group 1 of the suite (unpatched, offload-02, one table, swap, --cpu-offload-gb at
#      10%) with EO_ALLOC_HISTORY=1: the census and the allocation sites name offload-02's
#      72 MB beside its weights (issue 3), and a third run of group 1 against session i.
# Started as before (from a copy of the checkout, in the background, "models" first while
# the bundle installs); results under R, R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The checkout (19.1 MB after session i) does not fit beside the bundle's part a (57 MB) in
# one device call (64 MiB): send part a in two halves (.gpu/a1 and .gpu/a2), join them on the
# host, check the sha256 and install the joined folder. Session i's call 1 (a1 + c2) had
# 1.2 MB to spare with this checkout, so the parts are regrouped into five calls of at most
# 44.4 MB of parts each (3.6 MB to spare):
#   1. a1 + e (.gpu/e: pycountry, apache_tvm_ffi), with the background "models" start
#   2. a2 + d (joins part a)
#   3. c
#   4. b2 + c2 (flashinfer)
#   5. b (the MoE kernels' library), then start the plan and poll
# Sum the sizes first: `git ls-files -z | xargs -0 du -cb | tail -1` plus each call's parts.
#
# Expected (30 min of device time; session i: 74 s for the four install calls, then the
# fifth starting the plan and sleeping 540 s, and polls of 555 and 525 s, 51 s left): step 1 about 8 min on a
# cold compile cache (session i: 388 s for the five unpatched reference engines alone);
# step 2 under a minute; step 3 as session i's group 1 (373 s) or session h's on a cold
# cache (557 s), plus the slower start-up of recording engines.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
scripts/gpu-suite --budget-s 720 --out "$R/p1" \
  "tests:$T::test_int4_one_table_matches_unpatched[every-step] -rA -s"
scripts/gpu-suite --budget-s 150 --out "$R/p2" \
  "tests:tests/gpu/test_swap_kernels_gpu.py -k timing -rA -s"
# group 1 of session i's suite, with every engine recording where it allocates (start-up
# slows; the decode timings come after the recording stops)
EO_ALLOC_HISTORY=1 scripts/gpu-suite --budget-s $((1640 - SECONDS)) --out "$R/p3" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --compare-with bench/results/2026-12-01-reference-d-16l-h200.json --out OUT/group1.json"
date -u +%FT%TZ > "$R/done"
