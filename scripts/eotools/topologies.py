# SPDX-License-Identifier: Apache-2.0
"""The hardware each per-topology image and compose file is made for (compose/README.md).

The preflight checks the GPUs it finds against the topology named by EO_TOPOLOGY (the image's
TOPOLOGY build argument); the serving settings themselves live in compose/<name>.yml (with
compose/base.yml, which the Qwen3.8 files extend), and tests/cpu/test_compose.py checks that
each compose file asks for the GPUs listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .selection import GiB

# A card sold as "32 GB" reports a little less (RTX 5090: 31.8 GiB, RTX 3090: 23.7 GiB).
VRAM_TOLERANCE = 0.95


@dataclass(frozen=True)
class Topology:
    name: str
    gpus: int
    pipeline_parallel_size: int
    vram_gib: float | None  # nominal memory of each card; None: any GPU will do
    summary: str

    @property
    def min_vram_bytes(self) -> int | None:
        """The least total memory a card may report and still count as this topology's."""
        return None if self.vram_gib is None else int(self.vram_gib * VRAM_TOLERANCE * GiB)


TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        Topology("2x32GB", 2, 2, 32, "two 32 GB cards (RTX 5090), PP=2, 7.6 GiB/card on host"),
        Topology("3x24GB", 3, 3, 24, "three 24 GB cards (RTX 3090/4090), PP=3, 4.0 GiB/card"),
        Topology("2x24GB", 2, 2, 24, "two 24 GB cards (RTX 3090/4090), PP=2, 14 GiB/card"),
        Topology("tiny", 1, 1, None, "one GPU of any size, a synthetic model made at start"),
    )
}


def get_topology(name: str | None) -> Topology | None:
    """The topology called `name` (None or "" or "any": none); unknown names raise KeyError
    with the known ones in the message."""
    if not name or name == "any":
        return None
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise KeyError(
            f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)} (or 'any')"
        ) from None
