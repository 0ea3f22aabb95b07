#!/usr/bin/env bash
# The next GPU session's run (prepared 2026-12-01 after session f, not yet run): issue 6's
# reference table in one run, with the host-fraction sweep, every configuration beside an
# unpatched engine of its own group (bench-offload --group 4: four configurations and one
# unpatched engine resident at once, taking turns request by request). Session f's report:
# bench/results/2026-12-01-gpu-session-f-h200.md. Started as before (from a copy of the
# checkout, in the background, "models" first while the bundle installs); results under R,
# R/done at the end.
#
#   cp -a . /tmp/eo-repo && cd /tmp/eo-repo && setsid nohup bash bench/plans/next-h200.sh [models] &
#
# The checkout (about 12 MB) no longer fits beside the bundle's part a (57 MB) in one device
# call (64 MiB): send part a in two halves (head -c / tail -c into .gpu/a1 and .gpu/a2, with
# other parts beside each), join them on the host into a folder with install.py, check the
# sha256, and install that folder, as session f did.
#
# Expected (30 min of device time, about 2 of them for installs and models): the host read
# at most 2 min; then three groups of engines (12 configurations: the main table at 10% and
# the sweep at 5, 20 and 40%), each started together and measured in turns, about 6-9 min a
# group (the first starts one unpatched and one patched engine before the others, to fill a
# cold compile cache; about 121 GiB of VRAM for five 16-layer engines). About 25 min in all;
# an offload-02 profile after it if at least 4 minutes are left.
# Cut short, the report is rebuilt from the engine runs (--from-runs, same arguments).
set -u
# shellcheck source=bench/plans/common.sh
source "$(dirname "$0")/common.sh"
plan_models "${1:-}" "$0"
mkdir -p "$R/p1" "$R/p2"
PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site timeout 120 python3 scripts/bench-host-read \
  --out "$R/p1/host_read.json" > "$R/p1/host_read.log" 2>&1
# the sweep's points listed in --configs (the same as --sweep 0.05,0.1,0.2,0.4, whose 10%
# point is the main table's) so that each fraction's two configurations share a group:
# [offload-02, offload-03, offload-03-swap, cpu-offload-gb] (issues 3 and 4 in one group),
# [swap 5%, cpu 5%, swap 20%, cpu 20%], [swap 40%, cpu 40%, offload-01]. 128 decode tokens
# per request (three repeats of every workload after a warm-up) keep all of it in the session
# (budgets from the plan's clock: it starts about a minute into the session, whose device
# time ends at 30 minutes; each group is cut off alone after 900 s, --unit-timeout-s)
scripts/gpu-suite --budget-s $((1620 - SECONDS)) --out "$R/p2" \
  "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --host-layers 0,1 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb,offload-03-swap:26,cpu-offload-gb:26,offload-03-swap:102,cpu-offload-gb:102,offload-03-swap:205,cpu-offload-gb:205,offload-01 --group 4 --decode-tokens 128 --repeats 3 --host-read-us 55.5 --out OUT/reference.json"
# if the table left time: offload-02 profiled beside its own unpatched engine, for the time its second
# table's kernel calls add per layer (issue 3: 1.19x its physical bound on fresh prompts
# in session e, target 1.15x)
left=$((1620 - SECONDS))
if ((left > 240)); then
  scripts/gpu-suite --budget-s "$left" --out "$R/p3" \
    "bench:--model $M/target-int4-16l --host-experts-per-layer 51 --configs unpatched,offload-02 --paired --profile --decode-tokens 128 --repeats 1 --host-read-us 55.5 --out OUT/profile-offload-02.json"
else
  echo "offload-02 profile not run: ${left} s left" > "$R/p3-not-run"
fi
date -u +%FT%TZ > "$R/done"
