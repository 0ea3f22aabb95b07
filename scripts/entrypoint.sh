#!/usr/bin/env bash
# The image's entrypoint: what the upstream vllm/vllm-openai image runs (`vllm serve` with the
# container's arguments), after the start-up preflight (scripts/preflight --help), which stops
# the container, with a message that names the fix, when the GPUs, host memory, host mapping,
# cold file or patched vLLM are not what serving with expert offload needs.
#
#   EO_SKIP_PREFLIGHT=1     start vLLM without the preflight
#   EO_PREFLIGHT_SKIP=a,b   skip some of its checks
#   EO_TOPOLOGY             the hardware to check against (the image's TOPOLOGY build argument)
#   VLLM_EXPERT_COLD_FILE   the cold file, a path inside the container (compose: COLD_FILE,
#                           in the folder mounted at /cold); when set, it must exist, or the
#                           container stops (exit 6) with what to change
#   EO_HOST_BUDGET_GIB      budget-only start, when VLLM_EXPERT_COLD_FILE is unset or empty:
#                           write a cold file for this many GiB of routed experts per card and
#                           count usage so the next start learns from it (budget-start --help)
#   EO_STATE_DIR            where a budget-only start keeps what it learned (default /state)
#
# `--help` (or -h) prints this, then `vllm serve --help`, without the preflight.
set -euo pipefail
home=${EO_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
for arg in "$@"; do
  case $arg in
    -h | --help | --help=*)
      awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
      if command -v vllm >/dev/null; then
        echo
        # vLLM's help needs a platform it can use: where it has none (a CPU-only test
        # environment), say so instead of passing its traceback on
        help=$(vllm serve "$@" 2>&1) && { printf '%s\n' "$help"; exit 0; }
        echo "(vllm serve --help did not run here: vLLM found no platform it can serve on;"
        echo " run it where vLLM serves, e.g. inside the image)"
      fi
      exit 0
      ;;
  esac
done
cold=${VLLM_EXPERT_COLD_FILE:-}
if [[ -z $cold ]]; then
  unset VLLM_EXPERT_COLD_FILE # empty (compose: COLD_FILE unset) means no cold file
  if [[ -n ${EO_HOST_BUDGET_GIB:-} ]]; then
    exports=$(python3 "$home/scripts/budget-start" --budget-gib "$EO_HOST_BUDGET_GIB" \
      --state-dir "${EO_STATE_DIR:-/state}" -- "$@") || exit
    eval "$exports"
  fi
elif [[ ! -f $cold ]]; then
  # A cold file that was asked for and is not there is a mistake (a typo, a host path), not
  # a reason to start with another placement: stop with the preflight's cold-file code.
  what="no such file"
  [[ -d $cold ]] && what="a directory, not a cold file"
  {
    echo "entrypoint: error: VLLM_EXPERT_COLD_FILE=$cold: $what in the container"
    echo "entrypoint:   fix: the path is read inside the container: put the file in the host" \
      "folder mounted at /cold (compose: COLD_DIR, default ../cold) and set" \
      "COLD_FILE=/cold/<its name>"
    case $cold in
      /cold/* | /models/* | /state/*) ;;
      *) echo "entrypoint:   $cold looks like a path on the host, not in the container" ;;
    esac
    dir=$(dirname "$cold")
    if [[ -d $dir ]]; then
      found=$(cd "$dir" && find . -maxdepth 1 -name '*.json' -printf '%f ' | head -c 400)
      [[ -n $found ]] && echo "entrypoint:   $dir has: $found"
    fi
    if [[ -n ${EO_HOST_BUDGET_GIB:-} ]]; then
      echo "entrypoint:   for a budget-only start ($EO_HOST_BUDGET_GIB GiB per card) leave" \
        "COLD_FILE unset instead (VLLM_EXPERT_COLD_FILE empty)"
    fi
  } >&2
  exit 6
fi
if [[ ${EO_SKIP_PREFLIGHT:-0} != 1 ]]; then
  python3 "$home/scripts/preflight" -- "$@" || exit # with the preflight's exit code
fi
exec vllm serve "$@"
