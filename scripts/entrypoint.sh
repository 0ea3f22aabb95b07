#!/usr/bin/env bash
# The image's entrypoint: what the upstream vllm/vllm-openai image runs (`vllm serve` with the
# container's arguments), after the start-up preflight (scripts/preflight --help), which stops
# the container, with a message that names the fix, when the GPUs, host memory, host mapping,
# cold file or patched vLLM are not what serving with expert offload needs.
#
#   EO_SKIP_PREFLIGHT=1     start vLLM without the preflight
#   EO_PREFLIGHT_SKIP=a,b   skip some of its checks
#   EO_TOPOLOGY             the hardware to check against (the image's TOPOLOGY build argument)
set -euo pipefail
home=${EO_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
if [[ ${EO_SKIP_PREFLIGHT:-0} != 1 ]]; then
  python3 "$home/scripts/preflight" -- "$@" || exit # with the preflight's exit code
fi
exec vllm serve "$@"
