#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01 after session e, not yet run), in priority
# order, each phase alone on the GPU. Session e's report: bench/results/2026-12-01-gpu-session-e-h200.md.
# Started as before (from a copy of the checkout, in the background, "models" first while the
# bundle installs); results under R, R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# Expected (30 min of device time, about 3 of them for installs and models): phase 1 at most
# 9.5 min (the first engine compiles, about 4 min; then about 70 s per engine); phase 2 at most
# 15.7 min (host read up to 2 min, two pairs of 16-layer engines at about 3.5 min each, then
# one profiled pair; gpu-suite keeps 35 s of each budget in reserve). About 28 min in all.
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
# The five unpatched INT4 runs of session d, whose differences are the correctness tests'
# noise, are reused (the harness caches runs by configuration; the series does not enter an
# unpatched run's key): the one-table test then starts two engines, not seven. Reusing them
# can only make the tests stricter (a machine-to-machine difference adds to offload-vs-
# unpatched, not to the noise); the reports say that they were reused.
seed=bench/results/raw/2026-12-01-int4-8l-unpatched-noise-h200
mkdir -p /tmp/eo-gpu/runs
for f in "$seed"/*.json.gz; do
  b=$(basename "$f" .json.gz)
  gunzip -c "$f" > "/tmp/eo-gpu/runs/$b.json"
  cp "$seed/$b.config.json" "$seed/$b.log" /tmp/eo-gpu/runs/
done
# phase 1, alone: one table in a live engine since each tensor's VRAM part is rounded up
# (every GPU row's scales in VRAM), judged by eotools.logprob_noise (reordered sums: twice the
# noise); the swap kernels first, as a quick check of the device
scripts/gpu-suite --budget-s 560 --out "$R/p1" \
  'tests:tests/gpu/test_swap_kernels_gpu.py -rA -s' \
  "tests:$T::test_int4_one_table_matches_unpatched -rA -s"
# phase 2, alone: the host-read cost; issue 4's speed target and the missing time of session
# d (offload-03-swap was 0.18 ms/token slower than unpatched on repeated prompts with 0.02 host
# reads/token): with swap, and with swap counting and deciding but never swapping (+hold),
# each beside an unpatched engine of its own taking turns request by request (two pairs,
# about 7 min; offload-03 without swap was paired in session e). Then, apart, so that a
# profiler failure cannot cost those pairs: one more offload-03-swap pair with --profile (GPU
# busy vs wall time per token, kernel by kernel against its partner), which says whether the
# missing time is the GPU's or the host's step loop. A step cut off leaves its engine runs;
# the report is rebuilt from them (--from-runs).
mkdir -p "$R/p2" "$R/p3"
PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site timeout 120 python3 scripts/bench-host-read \
  --out "$R/p2/host_read.json" > "$R/p2/host_read.log" 2>&1
scripts/gpu-suite --budget-s 520 --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-03-swap,offload-03-swap+hold --paired --decode-tokens 256 --repeats 3 --host-read-us 55.5 --out OUT/reference.json"
scripts/gpu-suite --budget-s 300 --out "$R/p3" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-03-swap --paired --profile --decode-tokens 256 --repeats 1 --host-read-us 55.5 --out OUT/profile.json"
date -u +%FT%TZ > "$R/done"
