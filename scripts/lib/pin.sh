# shellcheck shell=bash
# Shared shell helpers: the vLLM pin (read from vllm.pin), the download cache, and errors.
# Source it; it defines functions and exports PIN_* and EO_* variables, and runs nothing else.

EO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
EO_CACHE=${EO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-expert-offload}
export EO_ROOT EO_CACHE

die() {
  # die CODE MESSAGE...: print "error: MESSAGE" to stderr and exit with CODE
  local code=$1; shift
  printf 'error: %s\n' "$*" >&2
  exit "$code"
}

load_pin() {
  # Export every PIN_* assignment of vllm.pin; refuse anything else in the file.
  local line key value
  while IFS= read -r line || [[ -n $line ]]; do
    [[ -z ${line//[[:space:]]/} || $line == \#* ]] && continue
    [[ $line =~ ^(PIN_[A-Z0-9_]+)=([^[:space:]]*)$ ]] ||
      die 2 "vllm.pin: cannot read line '$line' (expected PIN_NAME=value)"
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    export "$key=$value"
  done < "$EO_ROOT/vllm.pin"
}

fetch_pinned_wheel() {
  # Print the path of the pinned vLLM wheel, downloading it into the cache if needed and
  # verifying its sha256 against vllm.pin either way (a corrupt cached file is replaced).
  local dir="$EO_CACHE/wheels" whl
  whl="$dir/$PIN_VLLM_WHEEL"
  mkdir -p "$dir"
  if [[ -f $whl ]] && ! echo "$PIN_VLLM_WHEEL_SHA256  $whl" | sha256sum -c --status -; then
    echo "cached $PIN_VLLM_WHEEL does not match vllm.pin's sha256; downloading it again" >&2
    rm -f "$whl"
  fi
  if [[ ! -f $whl ]]; then
    echo "downloading $PIN_VLLM_WHEEL (about 320 MB) into $dir" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      -d "$dir" "vllm==$PIN_VLLM_VERSION" >&2 ||
      die 3 "could not download vllm==$PIN_VLLM_VERSION (network or index problem)"
    [[ -f $whl ]] || die 3 "pip did not produce $PIN_VLLM_WHEEL; is the wheel name in vllm.pin right?"
  fi
  echo "$PIN_VLLM_WHEEL_SHA256  $whl" | sha256sum -c --status - ||
    die 3 "$whl does not match the sha256 in vllm.pin ($PIN_VLLM_WHEEL_SHA256); refusing to use it"
  printf '%s\n' "$whl"
}

load_pin
