# SPDX-License-Identifier: Apache-2.0
"""How much host memory a process can still take: MemAvailable, and the container's memory
limit less what the container already uses (cgroup v2 memory.max, else v1
memory.limit_in_bytes). The roots are parameters so that tests can use fake files."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass


def mem_available(meminfo: pathlib.Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


@dataclass(frozen=True)
class CgroupMemory:
    limit: int
    usage: int
    source: str

    @property
    def room(self) -> int:
        return max(self.limit - self.usage, 0)


def cgroup_memory(root: pathlib.Path) -> CgroupMemory | None:
    """The container's memory limit and current use (cgroup v2, else v1); None if unlimited."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(root / limit_file)
        if limit is None:
            continue
        if limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        usage = _read_int(root / usage_file) or 0
        return CgroupMemory(limit, usage, str(root / limit_file))
    return None
