#!/usr/bin/env bash
# The image's entrypoint: the start program (scripts/start, eotools/start.py), which reads
# the `vllm serve` arguments and every setting once, refuses what vLLM would misread, makes a
# budget-only start's cold file (EO_HOST_BUDGET_GIB), runs the preflight and then execs
# `vllm serve` with the container's arguments. `--help` prints its settings and exit codes,
# then `vllm serve --help`. EO_HOME: where the image keeps scripts/ (default: this file's).
set -euo pipefail
home=${EO_HOME:-$(cd "$(dirname "$0")/.." && pwd)}
exec python3 "$home/scripts/start" "$@"
