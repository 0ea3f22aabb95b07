#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01 after session h, not yet run). Session h
# ran this plan's predecessor in full (report: bench/results/2026-12-01-gpu-session-h-h200.md):
# the whole reference table in three groups, every one-table engine on 16 of 16 layers.
# Since then: one table moves its last GPU experts into host rows so that its VRAM stays
# within offload-02's (0007: 2 of 461 per layer at 10%), each engine binds to its GPU's NUMA
# node (engine_probe, EO_PIN_CPUS), and the probe records a census of the CUDA tensors that
# are not weights (offload-02 held 72 MB more than unpatched in session h).
# This run:
#   1. the one-table correctness test with a swap in every layer at every step (0007
#      changed where the GPU/host boundary of each table lies): greedy tokens and logprobs
#      against the unpatched engine, after more than 10,000 swaps, live self-check on;
#   2. the same bench-offload suite as session h, same --configs and groups, compared with
#      session h's table (--compare-with): the reproduction, now with pinned engines. The
#      offload-03 rows without swap have 2 more host experts per layer than in session h
#      and may move; the others ran the same code.
# Started as before (from a copy of the checkout, in the background, "models" first while
# the bundle installs); results under R, R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The checkout (16.3 MB after session h) does not fit beside the bundle's part a (57 MB) in
# one device call (64 MiB): send part a in two halves (.gpu/a1 and .gpu/a2), join them on the
# host, check the sha256 and install the joined folder. After session h the parts were
# rebalanced into five calls, each with 4-24 MB to spare, because part b alone had 1 MB left:
#   1. a1 + c2 (flashinfer), with the background "models" start
#   2. a2 + b2 (joins part a)
#   3. c (anthropic moved here from c2)
#   4. d + e (.gpu/e: pycountry from b, apache_tvm_ffi from b2; install.py as any part's)
#   5. b (the MoE kernels' library), then start the plan and poll
# Sum the sizes first: `git ls-files -z | xargs -0 du -cb | tail -1` plus each call's parts.
#
# Expected (30 min of device time, about 1.5 of them for installs and models): step 1 5-7
# min (session f: 414 s for this test and its swap-off twin, the unpatched reference runs
# included); the suite as in session h (group 1 557 s on a cold compile cache, 406 s,
# 332 s). Correctness comes first: the suite's third group (5% and 20%) will likely be cut
# off (--budget-s), and the report is then rebuilt from the engine runs (--from-runs, same
# arguments).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
scripts/gpu-suite --budget-s 450 --out "$R/p1" \
  "tests:$T::test_int4_one_table_matches_unpatched[every-step] -rA -s"
# groups of four in --configs order: [offload-02, offload-03, offload-03-swap,
# cpu-offload-gb], [swap 40%, cpu 40%, offload-01, swap 5%], [cpu 5%, swap 20%, cpu 20%];
# 128 decode tokens, 3 repeats of every workload after a warm-up
scripts/gpu-suite --budget-s $((1640 - SECONDS)) --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb,offload-03-swap:205,cpu-offload-gb:205,offload-01,offload-03-swap:26,cpu-offload-gb:26,offload-03-swap:102,cpu-offload-gb:102 --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --compare-with bench/results/2026-12-01-reference-c-16l-h200.json --out OUT/reference.json"
date -u +%FT%TZ > "$R/done"
