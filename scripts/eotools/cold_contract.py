# SPDX-License-Identifier: Apache-2.0
"""The rules for the files expert offload reads at start-up (cold files, usage counts), in
one module with no imports beyond the standard library, so that vLLM's loader and the
container's start-up checks apply the same ones.

Reading is strict where ``json.loads`` is lenient, because these files come from other
machines, other tools and half-finished writes: only regular files, at most ``max_bytes``,
nesting at most ``MAX_DEPTH`` deep, no duplicate keys (the second would silently win), no
NaN or Infinity, no integers of more than ``MAX_INT_DIGITS`` digits, no float that
overflows to infinity.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

MAX_DEPTH = 32
MAX_INT_DIGITS = 20


class ContractError(ValueError):
    """A file or setting that breaks the contract; the message names the problem."""


def _check_depth(text: str, limit: int) -> None:
    """Refuse nesting deeper than ``limit`` before the parser recurses into it."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                raise ContractError(f"nested more than {limit} levels deep")
        elif ch in "]}":
            depth -= 1


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ContractError(f"key {key[:40]!r} appears twice in one object")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise ContractError(f"{name} is not a number this file may hold")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ContractError(f"an integer of {len(text)} digits ({text[:12]}...)")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ContractError(f"the number {text[:24]} overflows to infinity")
    return value


def parse_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` as JSON under the rules above; ContractError names what broke them."""
    _check_depth(text, max_depth)
    try:
        return json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_int=_int,
            parse_float=_float,
        )
    except json.JSONDecodeError as e:
        raise ContractError(f"not valid JSON ({e})") from None


def read_text(path: str | os.PathLike[str], max_bytes: int) -> str:
    """A regular file's UTF-8 text, refused if it is larger than ``max_bytes``. A FIFO,
    a device or a directory is refused without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise ContractError("a directory, not a file") from None
    except FileNotFoundError:
        raise ContractError("no such file") from None
    except OSError as e:
        raise ContractError(f"cannot be opened ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise ContractError("a directory, not a file")
            raise ContractError("not a regular file (a FIFO, device or socket)")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ContractError(f"larger than the {max_bytes:,} bytes such a file may take")
    except OSError as e:
        raise ContractError(f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ContractError(f"not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike[str], max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """A regular file of at most ``max_bytes`` read as strict JSON (module docstring)."""
    return parse_json(read_text(path, max_bytes), max_depth)


_LAYER_PART = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


def parse_layer_list(spec: str, variable: str, max_layer: int) -> frozenset[int]:
    """Layer numbers and ranges separated by commas ("0-5,40"), as the series reads
    VLLM_EXPERT_HOST_LAYERS; every number at most ``max_layer``, checked before a range is
    built (a range of billions of layers would take all memory)."""
    layers: set[int] = set()
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            continue
        m = _LAYER_PART.fullmatch(part) if part.isascii() else None
        if m is None:
            raise ContractError(
                f"{variable}={spec[:80]!r}: cannot read {part[:40]!r}; expected layer numbers "
                "and ranges separated by commas, such as 0-5,40"
            )
        first_text, last_text = m.group(1), m.group(2) or m.group(1)
        if max(len(first_text), len(last_text)) > MAX_INT_DIGITS:
            raise ContractError(f"{variable}={spec[:80]!r}: {part[:40]!r} is not a layer number")
        first, last = int(first_text), int(last_text)
        if last < first:
            raise ContractError(
                f"{variable}={spec[:80]!r}: range {part!r} runs backwards; write {last}-{first}"
            )
        if last > max_layer:
            raise ContractError(
                f"{variable}={spec[:80]!r}: layer {last} is beyond the last layer, {max_layer}"
            )
        layers.update(range(first, last + 1))
    return frozenset(layers)
