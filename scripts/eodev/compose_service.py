# SPDX-License-Identifier: Apache-2.0
"""A compose file's service as scripts/serve-local starts it without a container engine: the
command line and environment the container would get, with the paths it mounts (/models,
/cold, /state) replaced by this host's, and ${VAR:-default} taken from this shell as Compose
takes it."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml
from eotools.compose import read_service


@dataclass
class LocalService:
    args: list[str]  # `vllm serve`'s arguments, the model folder first
    env: dict[str, str]  # the container's environment, for the entrypoint
    served_model_name: str


def local_service(
    compose: pathlib.Path,
    model: pathlib.Path,
    cold: pathlib.Path | None,
    state: pathlib.Path,
    environ: Mapping[str, str],
) -> LocalService:
    svc = read_service(compose, environ)
    args = svc.command
    if not args or not args[0].startswith("/models/"):
        raise ValueError(f"{compose}: the command does not start with a /models/... folder")
    env = dict(svc.environment)
    env["VLLM_EXPERT_COLD_FILE"] = str(cold) if cold else ""
    if "EO_STATE_DIR" in env:
        env["EO_STATE_DIR"] = str(state)
    env["EO_TOPOLOGY"] = svc.build_args.get("TOPOLOGY", "any")
    served = str(model)
    if "--served-model-name" in args:
        served = args[args.index("--served-model-name") + 1]
    return LocalService([str(model), *args[1:]], env, served)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Print a compose service's arguments (one per line), then a line '--', "
        "then its environment as KEY=VALUE lines, then the served model name.",
        epilog="exit codes: 0 printed; 1 a compose file this cannot read.",
    )
    ap.add_argument("compose", type=pathlib.Path)
    ap.add_argument("--model", type=pathlib.Path, required=True)
    ap.add_argument("--cold", type=pathlib.Path)
    ap.add_argument("--state", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)

    try:
        svc = local_service(args.compose, args.model, args.cold, args.state, os.environ)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lines = [*svc.args, "--", *(f"{k}={v}" for k, v in svc.env.items()), svc.served_model_name]
    if any("\n" in line for line in lines):
        print("error: a value holds a line break", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
