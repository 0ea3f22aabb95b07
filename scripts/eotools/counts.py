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

Optional keys, written by the vLLM counting hook (VLLM_EXPERT_COUNT_FILE), one file per
pipeline-parallel (and data-parallel) rank: "layers" (the absolute layer numbers this file
counted), "rank" ({"pp_rank", "pp_size", "dp_rank", "dp_size"}) and "snapshot" ({"seq",
"time", "started", "pid", "request"}). `merge_ranks` unions one snapshot's rank files into
one set of counts; `subtract` turns two snapshots of one server into the counts between them.
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
    return counts_from_doc(doc, path)


def _matrix(value: Any, what: str) -> np.ndarray:
    try:
        m = np.asarray(value)
    except ValueError as e:  # ragged rows
        raise CountsError(f"{what} is not a layers x experts table ({e})") from None
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0 or m.dtype.kind not in "iu":
        raise CountsError(f"{what} is not a layers x experts table of whole numbers")
    return m.astype(np.int64)


def counts_from_doc(doc: Any, path: pathlib.Path | str) -> Counts:
    """The counts a parsed counts file holds; CountsError names what is missing or wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CountsError(f"{path}: not an expert-counts file (format is not {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CountsError(
            f"{path}: counts format version {doc.get('version')!r}, this tool reads {VERSION}"
        )
    for key in ("prefill", "decode", "model", "data", "top_k"):
        if key not in doc:
            raise CountsError(f"{path}: incomplete counts file (no {key!r})")
    model, data, top_k = doc["model"], doc["data"], doc["top_k"]
    if not isinstance(model, dict) or not isinstance(data, dict):
        raise CountsError(f"{path}: 'model' and 'data' must be objects")
    tokens = data.get("tokens", {})
    if not isinstance(tokens, dict) or not all(
        type(tokens.get(p, 0)) is int and tokens.get(p, 0) >= 0 for p in ("prefill", "decode")
    ):
        raise CountsError(f"{path}: data.tokens must hold whole numbers >= 0")
    if type(top_k) is not int or top_k <= 0:
        raise CountsError(f"{path}: top_k must be a whole number > 0")
    prefill = _matrix(doc["prefill"], f"{path}: prefill")
    decode = _matrix(doc["decode"], f"{path}: decode")
    if prefill.shape != decode.shape:
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
    return Counts(model, data, prefill, decode, top_k, str(doc.get("tool", "")), extra)


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


MODEL_KEYS = ("name", "revision", "architecture", "num_layers", "num_experts")


def _rank(c: Counts) -> dict[str, int]:
    r = c.extra.get("rank") or {}
    return {
        k: int(r.get(k, d))
        for k, d in (("pp_rank", 0), ("pp_size", 1), ("dp_rank", 0), ("dp_size", 1))
    }


def _layers(c: Counts) -> list[int]:
    if "layers" in c.extra:
        return sorted(int(x) for x in c.extra["layers"])
    return [i for i, row in enumerate(c.total) if row.any()]  # older files: counted rows


def _check_one_model(parts: list[Counts], what: str) -> None:
    ref = parts[0]
    for c in parts[1:]:
        for k in MODEL_KEYS:
            a, b = ref.model.get(k), c.model.get(k)
            if a is not None and b is not None and a != b:
                raise CountsError(
                    f"{what} come from different models ({k} {a!r} and {b!r}): use the "
                    "files of one server run"
                )
        if c.prefill.shape != ref.prefill.shape or c.top_k != ref.top_k:
            raise CountsError(
                f"{what} disagree on shape: {ref.prefill.shape} top-{ref.top_k} and "
                f"{c.prefill.shape} top-{c.top_k}"
            )


def merge_ranks(parts: list[Counts]) -> Counts:
    """Union the per-rank files of one server (the hook's `.ppN`/`.dpN` files): each
    pipeline rank contributes its own layers, data-parallel ranks add up. Raises
    CountsError on files of different models, a layer counted by two pipeline ranks of
    one data-parallel rank, or a missing or mismatched rank."""
    if not parts:
        raise CountsError("no counts files to merge")
    _check_one_model(parts, "the rank files")
    ranks = [_rank(c) for c in parts]
    pp_size, dp_size = ranks[0]["pp_size"], ranks[0]["dp_size"]
    if any(r["pp_size"] != pp_size or r["dp_size"] != dp_size for r in ranks):
        raise CountsError("the rank files come from runs with different parallel sizes")
    by_dp: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        by_dp.setdefault(r["dp_rank"], []).append(i)
    if sorted(by_dp) != list(range(dp_size)):
        raise CountsError(f"data-parallel rank files {sorted(by_dp)} of {dp_size}: missing")
    prefill = np.zeros_like(parts[0].prefill)
    decode = np.zeros_like(prefill)
    tokens = {"prefill": 0, "decode": 0}
    layers: set[int] = set()
    for dp, members in sorted(by_dp.items()):
        pps = sorted(ranks[i]["pp_rank"] for i in members)
        if pps != list(range(pp_size)):
            raise CountsError(
                f"data-parallel rank {dp}: pipeline rank files {pps}, expected "
                f"0..{pp_size - 1} once each (a file is missing or given twice)"
            )
        seen: dict[int, int] = {}
        for i in members:
            for layer in _layers(parts[i]):
                if layer in seen:
                    raise CountsError(
                        f"layer {layer} is counted by pipeline ranks {seen[layer]} and "
                        f"{ranks[i]['pp_rank']}: these files are not one server's ranks"
                    )
                seen[layer] = ranks[i]["pp_rank"]
            prefill += parts[i].prefill
            decode += parts[i].decode
        layers |= set(seen)
        for phase in tokens:  # every pipeline rank sees every token of its batch
            tokens[phase] += max(parts[i].tokens(phase) for i in members)
    first = parts[0]
    extra = {k: v for k, v in first.extra.items() if k not in ("layers", "rank", "snapshot")}
    extra["layers"] = sorted(layers)
    extra["ranks"] = [
        {**ranks[i], "snapshot": parts[i].extra.get("snapshot")} for i in range(len(parts))
    ]
    data = {**first.data, "tokens": tokens}
    return Counts(first.model, data, prefill, decode, first.top_k, first.tool, extra)


def subtract(after: Counts, before: Counts) -> Counts:
    """The counts between two snapshots of one server (merged or single-rank)."""
    _check_one_model([after, before], "the two snapshots")
    if _layers(after) != _layers(before) and "layers" in after.extra:
        raise CountsError("the two snapshots count different layers: not one server run")
    prefill, decode = after.prefill - before.prefill, after.decode - before.decode
    tokens = {p: after.tokens(p) - before.tokens(p) for p in ("prefill", "decode")}
    if (prefill < 0).any() or (decode < 0).any() or min(tokens.values()) < 0:
        raise CountsError(
            "counts went down between the two snapshots: the server restarted in between; "
            "count again"
        )
    return Counts(
        after.model,
        {**after.data, "tokens": tokens},
        prefill,
        decode,
        after.top_k,
        after.tool,
        dict(after.extra),
    )
