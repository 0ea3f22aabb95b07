# shellcheck shell=bash
# The container engine the image tooling uses (scripts/standin-base, scripts/image-build).
# Source it after pin.sh; it defines functions and runs nothing.
#
# podman (Debian's 4.3 with runc) is preferred; docker is used when its daemon answers (with
# the classic builder: BuildKit would pull a frontend from Docker Hub). EO_ENGINE=podman or
# EO_ENGINE=docker picks one.

find_engine() {
  # Set ENGINE to "podman" or "docker", or return 1 (with the reason in ENGINE_MISSING).
  local want=${EO_ENGINE:-}
  ENGINE= ENGINE_MISSING=
  if [[ -z $want || $want == podman ]] && command -v podman >/dev/null; then
    ENGINE=podman
    podman_conf
    return 0
  fi
  if [[ -z $want || $want == docker ]] && command -v docker >/dev/null &&
    docker info >/dev/null 2>&1; then
    ENGINE=docker
    export DOCKER_BUILDKIT=0
    return 0
  fi
  case $want in
    podman) ENGINE_MISSING="EO_ENGINE=podman, but podman is not installed" ;;
    docker) ENGINE_MISSING="EO_ENGINE=docker, but no docker daemon answers" ;;
    *) ENGINE_MISSING="no container engine: podman is not installed and no docker daemon answers" ;;
  esac
  ENGINE_MISSING+=" (scripts/install-engine installs podman from Debian's packages)"
  return 1
}

podman_conf() {
  # podman 4.3 on these VMs needs runc (crun: "cgroups in hybrid mode not supported") and
  # ulimits below its default nofile (no CAP_SYS_RESOURCE: "error setting rlimit type 7").
  # These go into a file of the project's own (CONTAINERS_CONF), not /etc/containers; an
  # existing CONTAINERS_CONF is respected.
  [[ -n ${CONTAINERS_CONF:-} ]] && return 0
  local conf=$EO_CACHE/containers.conf
  mkdir -p "$EO_CACHE"
  cat > "$conf.tmp" <<'EOF'
# Written by scripts/lib/engine.sh (vllm-expert-offload) for its podman calls.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
  mv "$conf.tmp" "$conf"
  export CONTAINERS_CONF=$conf
}

engine_build() {
  # engine_build ARGS...: build an image; docker format, so that SHELL (pipefail) is honoured.
  if [[ $ENGINE == podman ]]; then
    podman build --format docker --pull=never "$@"
  else
    docker build "$@"
  fi
}

image_exists() {
  "$ENGINE" image inspect "$1" >/dev/null 2>&1
}
