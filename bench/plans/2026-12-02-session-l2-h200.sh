#!/usr/bin/env bash
# Session l's second run (2026-12-02), cut off at 386 s (next-h200.sh runs it again). The
# first (bench/plans/2026-12-02-session-l-h200.sh, report:
# bench/results/2026-12-02-gpu-session-l-h200.md) saw patch 0012's one-block copy save
# 100.0% of the host bytes by torch's count but 91.9% of the process's VRAM: torch held
# 314 MB of cached free memory against the unpatched engine's 147 MB. 0012 now takes the
# blocks from a pool of their own and empties the cache after each copy. This run:
#   1. unpatched, offload-02 (0012 as in patches/) and offload-02 with the blocks cut from
#      the default pool (bench/plans/2026-12-02-l-one-block-default-pool.diff applied to a
#      copy of the patched tree), side by side at 10% host on the 16-layer model: VRAM
#      saved by both counts, and the free bytes stranded in partly used segments;
#   2. the kernel-level VRAM test at 1 and 16 layers (its layers now freed between builds
#      and built under vLLM's loading allocator setting) and the split-vs-full outputs.
# Started like next-h200.sh ("models" first while the bundle installs); results under R.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
K=tests/gpu/test_expert_map_kernels.py
B=/tmp/eo-tree-default-pool
rm -rf "$B" && cp -a /tmp/vllm-patched "$B" &&
  patch -p1 -d "$B" < bench/plans/2026-12-02-l-one-block-default-pool.diff > "$R/00-variant.log" 2>&1
scripts/gpu-suite --budget-s 420 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02,offload-02@$B --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
scripts/gpu-suite --budget-s $((720 - SECONDS)) --out "$R/p2" \
  "tests:$K -rA -s"
date -u +%FT%TZ > "$R/done"
