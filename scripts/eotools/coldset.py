# SPDX-License-Identifier: Apache-2.0
"""Cold files: which experts of each layer live in host memory (format: cold/README.md and
cold_contract.py, whose rules vLLM's loader applies at start-up)."""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any

import numpy as np

from .cold_contract import FORMAT, VERSION
from .state_dir import write_atomic


def model_identity(model_dir: pathlib.Path) -> dict[str, Any]:
    """What a cold file records about the model it was made for, from its config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    revision = cfg.get("_commit_hash")
    synthetic = model_dir / "synthetic_model.json"
    if revision is None and synthetic.exists():  # regenerable: name how it was made
        desc = json.loads(synthetic.read_text())
        revision = (
            f"make-test-model seed {desc['planting']['seed']}, "
            f"{desc['quantization']}, {desc['geometry']['num_layers']} layers"
        )
    return {
        "name": model_dir.name,
        "revision": revision,
        "architecture": (cfg.get("architectures") or [None])[0],
        "num_layers": text["num_hidden_layers"],
        "num_experts": text.get("num_experts") or text.get("n_routed_experts"),
    }


def least_used(counts: np.ndarray, per_layer: int) -> dict[int, list[int]]:
    """Per layer, the `per_layer` experts with the fewest picks (ties: lower id first)."""
    return {
        layer: sorted(int(e) for e in np.argsort(row, kind="stable")[:per_layer])
        for layer, row in enumerate(counts)
    }


def write_cold_file(
    path: pathlib.Path,
    layers: dict[int, list[int]],
    model: dict[str, Any],
    provenance: dict[str, Any],
    budget: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a cold file, atomically and durably (a kill leaves the old file or the new
    one); refuses one without any host expert, which vLLM refuses at start-up (it would
    offload nothing)."""
    if not any(layers.values()):
        from .selection import SelectionError

        raise SelectionError(
            "no layer has a host expert (every budget is 0 or holds no expert): the cold "
            "file would offload nothing; give a larger budget, or serve without a cold file"
        )
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "budget": budget,
        "provenance": {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **provenance,
        },
        "layers": {str(k): v for k, v in sorted(layers.items()) if v},
    }
    write_atomic(path, json.dumps(doc, indent=1) + "\n", "cold")
    return doc
