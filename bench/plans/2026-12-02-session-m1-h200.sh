#!/usr/bin/env bash
# Session m's first run (2026-12-02; prepared after session l as next-h200.sh). Session l
# (report: bench/results/2026-12-02-gpu-session-l-h200.md) measured patch 0012's one-block
# copy with the blocks cut from the default pool: 100.0% of the host bytes saved by torch's
# count, 91.9% of the process's VRAM (314 MB of free memory stranded, unpatched 147 MB).
# 0012 now takes the blocks from a pool of their own and empties the cache after each copy;
# session l's second run (bench/plans/2026-12-02-session-l2-h200.sh) started those engines
# and was cut off at 386 s by a 385 s budget, before any memory numbers. This run, the same
# with the time it needs:
#   1. unpatched, offload-02 (0012 as in patches/) and offload-02 with the blocks from the
#      default pool (bench/plans/2026-12-02-l-one-block-default-pool.diff on a copy of the
#      patched tree), side by side at 10% host on the 16-layer model: VRAM saved by the
#      driver's, torch's allocated and reserved counts, and the stranded free bytes. Three
#      engines on a cold compile cache were still starting at 230 s: 560 s;
#   2. the kernel-level tests: split vs full outputs (INT4 Marlin, BF16 Triton) and VRAM at
#      1 and 16 layers (layers freed between builds, reserved bytes logged);
#   3. if time is left, offload-02's live-engine correctness at 8 layers.
# Start it as next-h200.sh's predecessors were ("models" first while the bundle installs):
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# Move bench/results/raw out of the working tree for the session's calls (the bundle's parts
# and the checkout must fit 64 MiB), and keep the machine with back-to-back calls: session l
# lost its first machine between the first and second install call.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
K=tests/gpu/test_expert_map_kernels.py
B=/tmp/eo-tree-default-pool
rm -rf "$B" && cp -a /tmp/vllm-patched "$B" &&
  patch -p1 -d "$B" < bench/plans/2026-12-02-l-one-block-default-pool.diff > "$R/00-variant.log" 2>&1
scripts/gpu-suite --budget-s 560 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02,offload-02@$B --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
scripts/gpu-suite --budget-s 240 --out "$R/p2" "tests:$K -rA -s"
scripts/gpu-suite --budget-s $((1500 - SECONDS)) --out "$R/p3" \
  "tests:$T::test_int4_split_experts_match_unpatched $T::test_memory_moves_from_vram_to_host -rA -s"
date -u +%FT%TZ > "$R/done"
