# Sourced by the GPU session plans in this folder: where results go (R), the environment,
# and phase 0, the test models and the patched vLLM copy, made once before any parallel
# step (those would race to make them).
# shellcheck shell=bash
R=${R:-/tmp/eo-out}
mkdir -p "$R"
export EO_VLLM_SITE=/tmp/site PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# every request here is greedy (argmax, no top-k/top-p sampler); vLLM still warms FlashInfer's
# top-k/top-p sampler up after graph capture, which on a cold host is the likely part of the
# 2-minute silence after "Graph capturing finished" (session g: 135 s in each of the first
# two engines; session h, with this set: none, and 72 s in vLLM's first profiling run on a
# cold compile cache). The same for every engine, so ratios are unaffected.
export VLLM_USE_FLASHINFER_SAMPLER=0
# the models' folder and the correctness tests, for the plans' step arguments
# shellcheck disable=SC2034
M=/tmp/eo-gpu/models T=tests/gpu/test_offload_correctness.py

# plan_models ARG PLAN: with ARG "models", make the models and exit (a plan started early,
# while the bundle is still being installed); otherwise wait for that early run if there
# was one, else make the models now; then the patched copy.
plan_models() {
  if [[ $1 == models ]]; then
    touch "$R/p0.started"
    scripts/gpu-suite --budget-s 200 --out "$R/p0-models" 'model:target-int4-8l:--layers 8' \
      'model:target-int4-16l:--layers 16' 'model:target-bf16-2l:--layers 2 --quant bf16'
    touch "$R/p0.done"
    exit 0
  fi
  if [[ -f $R/p0.started ]]; then
    while [[ ! -f $R/p0.done ]]; do sleep 2; done
  else
    bash "$2" models
  fi
  scripts/test-gpu --collect-only -q tests/gpu/test_smoke.py > "$R/00-patch.log" 2>&1
}
