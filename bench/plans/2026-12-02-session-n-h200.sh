#!/usr/bin/env bash
# Session n's run (2026-12-02; prepared after session m as next-h200.sh; step 3's end moved
# from 1500 to 1300 s to fit the session's device time; report:
# bench/results/2026-12-02-gpu-session-n-h200.md). Session m
# (report: bench/results/2026-12-02-gpu-session-m-h200.md) measured patch 0012 in three
# forms, all at 91.9-92.2% of the host bytes saved by the process's VRAM: the allocator
# snapshots showed the largest stranded segments, 20 MiB each, holding only a router gate,
# whose neighbour in the unsplit engine (the layer's down-projection scales) 0012 had moved
# into its block. 0012
# now moves only the tensors of 20 MiB or more (whose blocks are whole segments while vLLM
# loads). This run:
#   1. unpatched, offload-02 (0012 as in patches/) and offload-02 with every tensor moved
#      (session l's 0012: bench/plans/2026-12-02-m-one-block-every-tensor.diff on a copy
#      of the patched tree), side by side at 10% host on the 16-layer model: VRAM saved by
#      the driver's, torch's allocated and reserved counts, and the stranded free bytes
#      (session m: three engines on a cold compile cache took 480 s);
#   2. the kernel-level tests (split vs full outputs, VRAM at 1 and 16 layers);
#   3. offload-02's live-engine correctness and memory at 8 layers.
# Start it as its predecessors were ("models" first while the bundle installs):
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/<this> [models] &
#
# Move bench/results/raw out of the working tree for the session's calls (the bundle's parts
# and the checkout must fit 64 MiB), and keep the machine with back-to-back calls.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
K=tests/gpu/test_expert_map_kernels.py
B=/tmp/eo-tree-every-tensor
rm -rf "$B" && cp -a /tmp/vllm-patched "$B" &&
  patch -p1 -d "$B" < bench/plans/2026-12-02-m-one-block-every-tensor.diff > "$R/00-variant.log" 2>&1
scripts/gpu-suite --budget-s 560 --out "$R/p1" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02,offload-02@$B --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/memory.json"
scripts/gpu-suite --budget-s 240 --out "$R/p2" "tests:$K -rA -s"
scripts/gpu-suite --budget-s $((1300 - SECONDS)) --out "$R/p3" \
  "tests:$T::test_int4_split_experts_match_unpatched $T::test_memory_moves_from_vram_to_host -rA -s"
date -u +%FT%TZ > "$R/done"
