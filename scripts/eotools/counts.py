# SPDX-License-Identifier: Apache-2.0
"""Expert usage counts: how often each (layer, expert) was among a token's top-k, per data set,
split by prefill and decode, with where the numbers came from.

File format (JSON, written atomically)::

    {"format": "vllm-expert-offload/expert-counts", "version": 1,
     "model": {"name", "architecture", "num_layers", "num_experts", ...},
     "data": {"name": "code", "kind": "code", "source": "...", "sequences": 16,
              "tokens": {"prefill": 4096, "decode": 2048}},
     "tool": "...", "top_k": 10,
     "prefill": [[...E counts...] x layers], "decode": [[...] x layers]}

Rows are absolute layer numbers 0..num_layers-1; layers without routed experts (or not
counted) hold zeros.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT = "vllm-expert-offload/expert-counts"
VERSION = 1


class CountsError(ValueError):
    """A counts file that cannot be used; the message says why and what to do."""


@dataclass
class Counts:
    model: dict[str, Any]
    data: dict[str, Any]
    prefill: np.ndarray  # (layers, experts) int64
    decode: np.ndarray
    top_k: int
    tool: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> np.ndarray:
        return self.prefill + self.decode

    def tokens(self, phase: str = "all") -> int:
        t = self.data.get("tokens", {})
        if phase == "all":
            return int(t.get("prefill", 0)) + int(t.get("decode", 0))
        return int(t.get(phase, 0))

    def picks(self, phase: str = "all") -> np.ndarray:
        return {"all": self.total, "prefill": self.prefill, "decode": self.decode}[phase]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "data": self.data,
            "tool": self.tool,
            "top_k": self.top_k,
            **self.extra,
            "prefill": self.prefill.tolist(),
            "decode": self.decode.tolist(),
        }

    def save(self, path: pathlib.Path) -> None:
        """Write atomically: a reader never sees half a file."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; counts are ordinary data
        os.replace(tmp, path)


def load_counts(path: pathlib.Path) -> Counts:
    path = pathlib.Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CountsError(f"{path}: not a readable counts file ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CountsError(f"{path}: not an expert-counts file (format is not {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CountsError(
            f"{path}: counts format version {doc.get('version')!r}, this tool reads {VERSION}"
        )
    try:
        prefill = np.asarray(doc["prefill"], dtype=np.int64)
        decode = np.asarray(doc["decode"], dtype=np.int64)
        model, data, top_k = doc["model"], doc["data"], int(doc["top_k"])
    except (KeyError, TypeError, ValueError) as e:
        raise CountsError(f"{path}: incomplete counts file ({e})") from e
    if prefill.ndim != 2 or prefill.shape != decode.shape:
        raise CountsError(f"{path}: prefill and decode counts must both be layers x experts")
    if (prefill < 0).any() or (decode < 0).any():
        raise CountsError(f"{path}: negative counts")
    if model.get("num_experts") not in (None, prefill.shape[1]):
        raise CountsError(
            f"{path}: counts have {prefill.shape[1]} experts per layer but "
            f"the file says the model has {model['num_experts']}"
        )
    extra = {
        k: v
        for k, v in doc.items()
        if k not in {"format", "version", "model", "data", "tool", "top_k", "prefill", "decode"}
    }
    return Counts(model, data, prefill, decode, top_k, doc.get("tool", ""), extra)


def check_same_model(sets: list[Counts], model: dict[str, Any] | None = None) -> None:
    """Every counts set must come from the same model (and from `model`, if given)."""
    ref = model or sets[0].model
    keys = ("architecture", "num_layers", "num_experts")
    for c in sets:
        for k in keys:
            if ref.get(k) is not None and c.model.get(k) is not None and ref[k] != c.model[k]:
                raise CountsError(
                    f"counts for data set {c.data.get('name')!r} come from a model with "
                    f"{k}={c.model[k]!r}, not {ref[k]!r}: count again on the model the cold "
                    "set is for"
                )
        if c.tokens() == 0 or int(c.total.sum()) == 0:
            raise CountsError(
                f"data set {c.data.get('name')!r} has no counted tokens: "
                "check that the data file is not empty"
            )
