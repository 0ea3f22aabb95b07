# SPDX-License-Identifier: Apache-2.0
"""Read the Dockerfile's instructions, so that tests can run its patch step outside Docker from
the Dockerfile's own text (tests/cpu/test_image.py), not from a copy that could drift.

Covers what this repository's Dockerfile uses: line continuations, comments, parser
directives, JSON and shell forms, and ${VAR} / $VAR substitution in ENV and COPY.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
from dataclasses import dataclass

from eotools.envsubst import substitute

_DIRECTIVE = re.compile(r"#\s*\w+\s*=")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    value: str  # the rest, continuations joined
    line: int  # where it starts (1-based)


def parse(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    lines = text.splitlines()
    i, n = 0, len(lines)
    while i < n and _DIRECTIVE.match(lines[i]):  # parser directives (# syntax=...)
        i += 1
    while i < n:
        start, raw = i + 1, lines[i]
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [raw]
        while parts[-1].rstrip().endswith("\\") and i < n:
            parts[-1] = parts[-1].rstrip()[:-1]
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):  # comments inside a continuation are dropped
                parts.append("\\")
                continue
            parts.append(nxt)
        joined = "".join(p for p in parts if p != "\\")
        keyword, _, value = joined.strip().partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
    return out


def env_pairs(value: str, env: dict[str, str]) -> dict[str, str]:
    """The assignments of an ENV instruction (`K=V K2="V 2"` or the old `K V` form)."""
    words = shlex.split(value)
    if words and "=" not in words[0]:
        return {words[0]: substitute(" ".join(words[1:]), env)}
    return {k: substitute(v, env) for k, _, v in (w.partition("=") for w in words)}


def exec_form(value: str) -> list[str] | None:
    """The list of a JSON-form instruction (["a", "b"]), or None for shell form."""
    if value.startswith("["):
        try:
            words = json.loads(value)
        except json.JSONDecodeError:
            return None
        if isinstance(words, list) and all(isinstance(w, str) for w in words):
            return words
    return None


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str


def copy_args(value: str, env: dict[str, str]) -> Copy:
    words = exec_form(value) or shlex.split(value)
    words = [w for w in words if not w.startswith("--")]  # --chmod, --link, ...
    words = [substitute(w, env) for w in words]
    return Copy(words[:-1], words[-1])


@dataclass
class Stage:
    """The last stage's state up to one instruction: its shell, environment, build arguments
    (a RUN sees them as environment variables too) and COPYs."""

    shell: list[str]
    env: dict[str, str]
    args: dict[str, str]
    copies: list[Copy]


def stage_before(instructions: list[Instruction], index: int) -> Stage:
    """What is in effect in the stage holding instructions[index], before it runs."""
    first = max(
        (i for i, ins in enumerate(instructions[:index]) if ins.keyword == "FROM"), default=-1
    )
    stage = Stage(["/bin/sh", "-c"], {}, {}, [])
    for ins in instructions[first + 1 : index]:
        if ins.keyword == "SHELL":
            stage.shell = exec_form(ins.value) or stage.shell
        elif ins.keyword == "ENV":
            stage.env.update(env_pairs(ins.value, stage.env))
        elif ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            stage.args[name.strip()] = shlex.split(default)[0] if default.strip() else ""
        elif ins.keyword == "COPY":
            stage.copies.append(copy_args(ins.value, stage.env))
    return stage


def find_run(instructions: list[Instruction], needle: str) -> int:
    """The index of the one RUN instruction whose command contains `needle`."""
    found = [
        i for i, ins in enumerate(instructions) if ins.keyword == "RUN" and needle in ins.value
    ]
    if len(found) != 1:
        raise LookupError(f"{len(found)} RUN instructions contain {needle!r}; expected one")
    return found[0]


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `*` and `?` stay within one path element, `**`
    spans any number of them (Go's filepath.Match, as Docker extends it)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def context_files(repo: pathlib.Path) -> list[str]:
    """The files `docker build` sends from `repo` under its .dockerignore: the last pattern
    that matches a file, or a folder above it, decides (a `!` pattern lets it through)."""
    rules: list[tuple[bool, str, re.Pattern[str]]] = []
    for line in (repo / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pattern = line.removeprefix("!").strip("/")
            rules.append((line.startswith("!"), pattern, _ignore_regex(pattern)))

    def sent(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        decision = True
        for keep, _, rx in rules:
            if any(rx.fullmatch(p) for p in prefixes):
                decision = keep
        return decision

    def may_hold_sent(rel: str) -> bool:  # a `!` pattern could reach below this folder
        return any(keep and (p.startswith(rel + "/") or "*" in p) for keep, p, _ in rules)

    files = []
    for folder, dirs, names in os.walk(repo):
        here = pathlib.Path(folder).relative_to(repo).as_posix()
        base = "" if here == "." else here + "/"
        dirs[:] = sorted(
            d for d in dirs if d != ".git" and (sent(base + d) or may_hold_sent(base + d))
        )
        files += [base + n for n in sorted(names) if sent(base + n)]
    return sorted(files)
