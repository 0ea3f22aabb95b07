#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01 after session g, not yet run). Session g
# ran this plan's predecessor (report: bench/results/2026-12-01-gpu-session-g-h200.md):
# its first group (offload-02, offload-03, offload-03-swap, cpu-offload-gb beside one
# unpatched engine) merged only 11 of 16 layers of its one-table engines, because each
# merge's VMM range came from the driver while the replaced tables sat free in torch's
# pool; patch 0007 now empties the pool before each merge. Its 40% group was cut off.
# This run: that first group again (issues 3, 4 and 6 at 10% host), the 40% group with
# offload-01, then session g's 5% and 20% points again (issue 6's reproduction, against
# session g's report with --compare-with), in groups of four beside one unpatched engine.
# Then the VMM and swap-kernel GPU tests if time is left. Started as before (from a copy
# of the checkout, in the background, "models" first while the bundle installs); results
# under R, R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The checkout (about 14 MB) no longer fits beside the bundle's part a (57 MB) in one
# device call (64 MiB): send part a in two halves (.gpu/a1 and .gpu/a2), join them on the
# host, check the sha256 and install the joined folder. Calls: a1 with c2, a2 with b2, c
# with d, and b alone; pycountry moved from c2 to b, anthropic and apache_tvm_ffi from d to
# b2, so that each call fits beside the checkout (1-6 MB to spare after session g: sum the
# sizes first; a fifth call when one no longer fits).
#
# Expected (30 min of device time, about 1.5 of them for installs and models; see common.sh
# on VLLM_USE_FLASHINFER_SAMPLER=0, new here: check the engine logs for the gap after graph
# capture): the host read, 30 s; the first group 11-12 min (cold compile cache: one
# unpatched and one patched engine start first), the second and third about 7 min each.
# About 26 min in all: the third group is the first to be cut off (--budget-s), and the
# report is then rebuilt from the engine runs (--from-runs, same arguments).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
mkdir -p "$R/p1" "$R/p2"
PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site timeout 120 python3 scripts/bench-host-read \
  --out "$R/p1/host_read.json" > "$R/p1/host_read.log" 2>&1
# groups of four in --configs order: [offload-02, offload-03, offload-03-swap,
# cpu-offload-gb], [swap 40%, cpu 40%, offload-01, swap 5%], [cpu 5%, swap 20%, cpu 20%]
# (the main table's 10% point is the sweep's 10% point); 128 decode tokens, 3 repeats of
# every workload after a warm-up; each group cut off alone after 900 s (--unit-timeout-s)
scripts/gpu-suite --budget-s $((1620 - SECONDS)) --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb,offload-03-swap:205,cpu-offload-gb:205,offload-01,offload-03-swap:26,cpu-offload-gb:26,offload-03-swap:102,cpu-offload-gb:102 --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --compare-with bench/results/2026-12-01-reference-b-16l-h200.json --out OUT/reference.json"
left=$((1620 - SECONDS))
if ((left > 150)); then
  scripts/gpu-suite --budget-s "$left" --out "$R/p3" \
    "tests:tests/gpu/test_vmm_gpu.py tests/gpu/test_swap_kernels_gpu.py -rA"
else
  echo "GPU unit tests not run: ${left} s left" > "$R/p3-not-run"
fi
date -u +%FT%TZ > "$R/done"
