#!/usr/bin/env bash
# The image's entrypoint: what the upstream vllm/vllm-openai image runs (`vllm serve` with the
# container's arguments), after the start-up preflight (scripts/preflight --help), which stops
# the container, with a message that names the fix, when the GPUs, host memory, host mapping,
# cold file or patched vLLM are not what serving with expert offload needs.
#
#   EO_SKIP_PREFLIGHT=1     start vLLM without the preflight
#   EO_PREFLIGHT_SKIP=a,b   skip some of its checks
#   EO_TOPOLOGY             the hardware to check against (the image's TOPOLOGY build argument)
#   EO_HOST_BUDGET_GIB      budget-only start: when VLLM_EXPERT_COLD_FILE names no file, write
#                           one for this many GiB of routed experts per card and count usage
#                           so the next start learns from it (scripts/budget-start --help)
#   EO_STATE_DIR            where a budget-only start keeps what it learned (default /state)
set -euo pipefail
home=${EO_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
if [[ -n ${EO_HOST_BUDGET_GIB:-} && ! -f ${VLLM_EXPERT_COLD_FILE:-} ]]; then
  if [[ -n ${VLLM_EXPERT_COLD_FILE:-} ]]; then
    echo "entrypoint: no cold file at $VLLM_EXPERT_COLD_FILE; budget-only start" \
      "($EO_HOST_BUDGET_GIB GiB per card)" >&2
  fi
  exports=$(python3 "$home/scripts/budget-start" --budget-gib "$EO_HOST_BUDGET_GIB" \
    --state-dir "${EO_STATE_DIR:-/state}" -- "$@") || exit
  eval "$exports"
fi
if [[ ${EO_SKIP_PREFLIGHT:-0} != 1 ]]; then
  python3 "$home/scripts/preflight" -- "$@" || exit # with the preflight's exit code
fi
exec vllm serve "$@"
