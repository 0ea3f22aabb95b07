# SPDX-License-Identifier: Apache-2.0
"""A compose file's one service as the container would get it: the command line,
environment, build arguments and healthcheck command, with ${VAR:-default} substituted from
a given environment (none: the defaults), as Compose does. The memory plan reads the
settings from it, and scripts/serve-local starts the service without a container engine.

A service that `extends` another (the topology files extend compose/base.yml's) is read with
that service merged in, as Compose merges it: mappings key by key, the extending service's
`command`, `entrypoint`, `healthcheck.test` and other single values in place of the base's.
Compose merges sequences that both define by rules of their own (ports, volumes, secrets...),
and podman-compose by others; a file where both define one is refused here, so what this
reader sees is what both Compose implementations start."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .envsubst import substitute


@dataclass
class Service:
    command: list[str]  # `vllm serve`'s arguments, the model folder first
    environment: dict[str, str]
    build_args: dict[str, str]
    healthcheck: list[str]  # the test command after "CMD"; [] when there is none


# what a merged service takes whole from the extending service, as Compose does
REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}
# keys that tie a service to another one: Compose refuses them in a service that is extended
NOT_EXTENDABLE = {"depends_on", "links", "volumes_from"}


def _merge(base: Any, over: Any, where: tuple[str, ...], path: pathlib.Path) -> Any:
    """`over` (the extending service's value at `where`) merged onto `base`."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            sub = (*where, str(key))
            out[key] = _merge(base[key], value, sub, path) if key in base else value
        return out
    single = not isinstance(base, (dict, list)) and not isinstance(over, (dict, list))
    if single or where[2:] in REPLACED:
        return over
    raise ValueError(
        f"{path}: {'.'.join(where)} is set both here and in the service it extends; Compose "
        "implementations merge that differently: set it in one of the two files"
    )


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    """The file's YAML mapping; ValueError for text that is not YAML or not a mapping."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"not a YAML compose file ({e.__class__.__name__}{where})") from None
    if not isinstance(doc, dict):
        raise ValueError("not a compose file: its top level is not a mapping")
    return doc


def _resolve(
    path: pathlib.Path,
    name: str,
    seen: tuple[tuple[pathlib.Path, str], ...] = (),
    doc: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Service `name` of `path` with its `extends` merged in; `doc`: the file, if already read."""
    key = (path.resolve(), name)
    if key in seen:
        raise ValueError(f"{path}: services.{name} extends itself (through {len(seen)} files)")
    if doc is None:
        doc = _read_yaml(path)
    services = doc.get("services") or {}
    if name not in services:
        raise ValueError(f"{path}: no service {name!r}")
    svc = dict(services[name] or {})
    ext = svc.pop("extends", None)
    if ext is None:
        return svc
    if isinstance(ext, str):
        ext = {"service": ext}
    if not isinstance(ext, dict) or not ext.get("service"):
        raise ValueError(f"{path}: services.{name}.extends names no service")
    base_path = path.parent / ext["file"] if ext.get("file") else path
    if base_path.resolve().parent != path.resolve().parent:
        # Compose resolves the base's relative paths against its own folder, which this
        # reader (and the tests of the mounts) would not see
        raise ValueError(f"{path}: extends {base_path}, which is not in the same folder")
    base = _resolve(base_path, ext["service"], (*seen, key))
    tied = sorted(NOT_EXTENDABLE & base.keys())
    if tied:
        where = f"{base_path}: services.{ext['service']}"
        raise ValueError(f"{where} has {', '.join(tied)}: a service with them cannot be extended")
    return _merge(base, svc, ("services", name), path)


def load_document(path: pathlib.Path) -> dict[str, Any]:
    """The compose file's document with each service's `extends` merged in, its
    ${VAR:-default} as written. Raises OSError, or ValueError (also for text that is not
    YAML, or not a mapping)."""
    doc = _read_yaml(path)
    services = doc.get("services") or {}
    return {**doc, "services": {name: _resolve(path, name, doc=doc) for name in services}}


def load_service(path: pathlib.Path) -> dict[str, Any]:
    """The file's one service, `extends` merged in (load_document); ValueError for a file
    without exactly one service."""
    services = load_document(path)["services"]
    if len(services) != 1:
        raise ValueError(f"{path}: expected one service, found {len(services)}")
    [svc] = services.values()
    return svc


def read_service(path: pathlib.Path, environ: Mapping[str, str] | None = None) -> Service:
    """Raises OSError, or ValueError for a file that is not a compose file with exactly one
    service."""
    env = dict(environ or {})
    svc = load_service(path)
    test = list((svc.get("healthcheck") or {}).get("test") or [])
    return Service(
        command=[substitute(str(a), env) for a in svc.get("command") or []],
        environment={k: substitute(str(v), env) for k, v in (svc.get("environment") or {}).items()},
        build_args={k: str(v) for k, v in ((svc.get("build") or {}).get("args") or {}).items()},
        healthcheck=[str(a) for a in test[1:]] if test[:1] == ["CMD"] else [],
    )
