# SPDX-License-Identifier: Apache-2.0
"""Cold files of make-test-model checkpoints without an engine: their routing is planted, so
counting the planted routers over the calibration data gives the exact least-used experts."""

from __future__ import annotations

import pathlib

from eotools.coldset import least_used, model_identity, write_cold_file


def synthetic_cold_file(model_dir: pathlib.Path, out: pathlib.Path, per_layer: int) -> dict:
    """The least-used `per_layer` experts of every layer of a make-test-model checkpoint, from
    counts of its planted routers over every domain's calibration split (normalised per data
    set, then added: docs/cold-sets.md). Exact for these models: their routing is planted."""
    from .testmodel.data import conversations
    from .testmodel.plant import load_plan
    from .testmodel.stats import count_picks, normalised_mix, streams

    plan = load_plan(model_dir)
    per_set = []
    for domain in plan.planting.domains:
        convs = conversations(plan, domain, "calibration", 16, 256)
        per_set.append(count_picks(plan, streams(plan, convs, 128)))
    mixed = normalised_mix(per_set)
    return write_cold_file(
        out,
        least_used(mixed, per_layer),
        model_identity(model_dir),
        {
            "tool": "eodev.synthetic_cold.synthetic_cold_file",
            "data": [
                f"{d}.calibration (16 x 256 words + 128 decoded)" for d in plan.planting.domains
            ],
            "counts": "planted-router simulation (the model's routing is planted)",
            "selection": f"least-used {per_layer} per layer by normalised mixed counts",
        },
    )
