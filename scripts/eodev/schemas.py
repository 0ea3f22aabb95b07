# SPDX-License-Identifier: Apache-2.0
"""JSON schemas that CI validates the repository's YAML against: the Compose Specification
for compose/*.yml and GitHub's workflow schema for .github/workflows/*.yml.

Both come from one pinned, sha256-checked download: the copies that check-jsonschema vendors
in its wheel on PyPI (CI and developer machines reach PyPI, not GitHub). The wheel and the
extracted schemas are cached in the download cache that scripts/lib/pin.sh uses; every use
checks them against the hashes below again. To move to a newer schema, change the version and
the three hashes together (`sha256sum` of the wheel and of the two members).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from .cache import cache_dir

SOURCE_PROJECT = "check-jsonschema"
SOURCE_VERSION = "0.39.0"
SOURCE_WHEEL = "check_jsonschema-0.39.0-py3-none-any.whl"
SOURCE_WHEEL_SHA256 = "14ce5c94871c551268ea948ffe21e9f1464dc48fb20bf9a4c13deeaaf756cf9b"
_VENDOR = "check_jsonschema/builtin_schemas/vendor/"


@dataclass(frozen=True)
class Schema:
    kind: str
    member: str  # path inside the wheel
    sha256: str
    globs: tuple[str, ...]  # repository files it applies to


SCHEMAS = {
    s.kind: s
    for s in (
        Schema(
            "compose",
            _VENDOR + "compose-spec.json",
            "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64",
            ("compose/*.yml",),
        ),
        Schema(
            "github-workflow",
            _VENDOR + "github-workflows.json",
            "d10c9f4656e1bd5bc6727e9b35080e017dc167154726fca93da33c7a6bd1c4f3",
            (".github/workflows/*.yml",),
        ),
    )
}


class SchemaFetchError(RuntimeError):
    """The pinned schema could not be downloaded or did not match its hash."""


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(cache: pathlib.Path) -> pathlib.Path:
    wheels = cache / "wheels"
    whl = wheels / SOURCE_WHEEL
    if whl.exists() and _sha256(whl) != SOURCE_WHEEL_SHA256:
        whl.unlink()  # corrupt or replaced: download again
    if not whl.exists():
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"downloading {SOURCE_WHEEL} (schemas) into {wheels}", file=sys.stderr)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            + ["--only-binary=:all:", "-d", str(wheels), f"{SOURCE_PROJECT}=={SOURCE_VERSION}"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0 or not whl.exists():
            raise SchemaFetchError(
                f"could not download {SOURCE_PROJECT}=={SOURCE_VERSION}: "
                f"{(r.stderr or r.stdout).strip()[-800:]}"
            )
    if _sha256(whl) != SOURCE_WHEEL_SHA256:
        raise SchemaFetchError(f"{whl} does not match its pinned sha256; refusing to use it")
    return whl


def schema_path(kind: str) -> pathlib.Path:
    """The cached schema file of `kind`, fetched and checked if needed."""
    spec = SCHEMAS[kind]
    cache = cache_dir()
    out = cache / "schemas" / f"{kind}-{spec.sha256[:16]}.json"
    if out.exists() and _sha256(out) == spec.sha256:
        return out
    with zipfile.ZipFile(_wheel(cache)) as z:
        data = z.read(spec.member)
    if hashlib.sha256(data).hexdigest() != spec.sha256:
        raise SchemaFetchError(f"{spec.member} in {SOURCE_WHEEL} does not match its sha256")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + f".{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, out)
    return out


def load_schema(kind: str) -> dict[str, Any]:
    return json.loads(schema_path(kind).read_text())


def load_yaml(path: pathlib.Path) -> Any:
    doc = yaml.safe_load(path.read_text())
    # YAML 1.1 reads a workflow's `on:` key as the boolean true
    if isinstance(doc, dict) and True in doc and "on" not in doc:
        doc["on"] = doc.pop(True)
    return doc


def validate(doc: Any, schema: dict[str, Any]) -> list[str]:
    """Every schema violation of `doc`, as "where: what" lines (empty: valid)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    errors = sorted(cls(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]


def files_of(kind: str, root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for g in SCHEMAS[kind].globs for p in root.glob(g))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="validate-schemas",
        description="Validate compose/*.yml against the Compose Specification and "
        ".github/workflows/*.yml against GitHub's workflow schema (pinned copies from "
        f"{SOURCE_PROJECT} {SOURCE_VERSION} on PyPI, sha256-checked, cached).",
        epilog="exit codes: 0 all valid; 1 a file is invalid; 2 usage; 3 a schema could not "
        "be fetched.",
    )
    ap.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).parents[2])
    args = ap.parse_args(argv)
    bad = 0
    for kind in SCHEMAS:
        files = files_of(kind, args.root)
        if not files:
            continue
        try:
            schema = load_schema(kind)
        except SchemaFetchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        for f in files:
            problems = validate(load_yaml(f), schema)
            rel = f.relative_to(args.root)
            if problems:
                bad += 1
                print(f"{rel}: not valid ({kind} schema):", file=sys.stderr)
                for p in problems:
                    print(f"    {p}", file=sys.stderr)
            else:
                print(f"{rel}: valid ({kind} schema)")
    return 1 if bad else 0
