# SPDX-License-Identifier: Apache-2.0
"""A compose file's one service as the container would get it: the command line,
environment, build arguments and healthcheck command, with ${VAR:-default} substituted from
a given environment (none: the defaults), as Compose does. The memory plan reads the
settings from it, and scripts/serve-local starts the service without a container engine."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from .envsubst import substitute


@dataclass
class Service:
    command: list[str]  # `vllm serve`'s arguments, the model folder first
    environment: dict[str, str]
    build_args: dict[str, str]
    healthcheck: list[str]  # the test command after "CMD"; [] when there is none


def read_service(path: pathlib.Path, environ: Mapping[str, str] | None = None) -> Service:
    """Raises OSError, yaml.YAMLError, or ValueError for a file without exactly one service."""
    import yaml

    env = dict(environ or {})
    doc = yaml.safe_load(path.read_text()) or {}
    services = doc.get("services") or {}
    if len(services) != 1:
        raise ValueError(f"{path}: expected one service, found {len(services)}")
    [svc] = services.values()
    test = list((svc.get("healthcheck") or {}).get("test") or [])
    return Service(
        command=[substitute(str(a), env) for a in svc.get("command") or []],
        environment={k: substitute(str(v), env) for k, v in (svc.get("environment") or {}).items()},
        build_args={k: str(v) for k, v in ((svc.get("build") or {}).get("args") or {}).items()},
        healthcheck=[str(a) for a in test[1:]] if test[:1] == ["CMD"] else [],
    )
