# shellcheck shell=bash
# Which pip arguments install the CPU build of vllm.pin's torch (scripts/dev-env,
# scripts/standin-base). Source it after pin.sh; it defines functions and runs nothing.
#
# PyPI's torch==X for Linux x86-64 is the CUDA build (about 2.5 GB with its nvidia packages);
# the CPU build comes from the PyTorch CPU index, or from a wheel file that pip finds locally
# (PIP_FIND_LINKS, pip.conf). Neither reachable is an error, not a silent CUDA install.

TORCH_CPU_INDEX=${EO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

torch_cpu_args() {
  # torch_cpu_args PYTHON: set the array TORCH_ARGS to pip install arguments for the CPU
  # build of torch PIN_TORCH_VERSION for PYTHON, or return 1 with the reason in TORCH_WHY.
  local py=$1 report
  TORCH_ARGS=() TORCH_WHY=
  if "$py" - "$TORCH_CPU_INDEX/torch/" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=10).read(1)
PY
    TORCH_ARGS=(--index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple
      "torch==$PIN_TORCH_VERSION")
    return 0
  fi
  # The CPU index is out of reach: what would plain pip install? A CUDA build pulls nvidia-*.
  report=$(mktemp)
  if ! "$py" -m pip install --quiet --dry-run --ignore-installed --report "$report" \
    "torch==$PIN_TORCH_VERSION" >/dev/null 2>&1; then
    TORCH_WHY="pip cannot resolve torch==$PIN_TORCH_VERSION at all (no index reachable?)"
    rm -f "$report"
    return 1
  fi
  if "$py" - "$report" <<'PY'; then
import json, sys
names = [i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]]
sys.exit(0 if not any(n.startswith("nvidia-") for n in names) else 1)
PY
    TORCH_ARGS=("torch==$PIN_TORCH_VERSION")
    rm -f "$report"
    return 0
  fi
  rm -f "$report"
  TORCH_WHY="the PyTorch CPU index ($TORCH_CPU_INDEX) is out of reach, and the torch==$PIN_TORCH_VERSION"
  TORCH_WHY+=" that pip finds is the CUDA build (about 2.5 GB with its nvidia packages). Make"
  TORCH_WHY+=" the CPU index reachable (or point EO_TORCH_INDEX at a mirror of it), or put the"
  TORCH_WHY+=" CPU wheel where pip finds it (PIP_FIND_LINKS=DIR), or set EO_TORCH_CUDA_OK=1 to"
  TORCH_WHY+=" install the CUDA build anyway (it runs on the CPU too)"
  if [[ ${EO_TORCH_CUDA_OK:-0} == 1 ]]; then
    TORCH_ARGS=("torch==$PIN_TORCH_VERSION")
    TORCH_WHY=
    return 0
  fi
  return 1
}
