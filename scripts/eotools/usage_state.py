# SPDX-License-Identifier: Apache-2.0
"""The usage history of a budget-only start's state folder, and folding each server run's
counts into it exactly once, whatever is killed when.

Each start gets a run id and points the counting hook at ``run/<run id>/counts.json`` (its
rank files, ``counts.ppN.json`` ..., sit beside it). The next start, holding the folder's
lock (state_dir) so that no server writes there, adds every earlier run's counts to
``usage.json`` and records those runs' ids in it (``folded_runs``) in the same durable
write, then removes the runs' folders. A kill before that write leaves the runs to be added
again; a kill after it leaves folders whose ids ``usage.json`` names, which the next start
only removes. Files of the layout before run ids (``run/*.json``) are one run whose id is a
hash of their content.

What cannot be used is set aside (state_dir.set_aside) with one warning line and the start
goes on: an unreadable, truncated or malformed ``usage.json`` or counts file, anything that
is not a regular file, counts of another model (name, revision, architecture or shape
differ from what the cold file records, coldset.model_identity).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cold_contract import ContractError, parse_json, read_text
from .counts import Counts, CountsError, counts_from_doc, merge_ranks
from .state_dir import Log, crash_point, fsync_dir, set_aside, write_atomic

USAGE_NAME = "usage.json"
RUN_DIR = "run"
COUNT_NAME = "counts.json"
FOLDED_KEPT = 256  # ids of folded runs kept in usage.json (at least all of the last fold)
MAX_COUNTS_BYTES = 64 << 20
RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}\Z")
PHASES = ("prefill", "decode")


def new_run_id() -> str:
    """A run id: the start's UTC time (so run folders sort by age) and 32 random bits."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(4)}"


def begin_run(state: pathlib.Path, run_id: str) -> pathlib.Path:
    """Create this run's folder; return the path for VLLM_EXPERT_COUNT_FILE."""
    runs = state / RUN_DIR
    runs.mkdir(exist_ok=True)
    (runs / run_id).mkdir()
    crash_point("run.created")
    fsync_dir(runs)
    return runs / run_id / COUNT_NAME


def _base(name: Any) -> str:
    return os.path.basename(str(name).rstrip("/"))


def model_mismatch(found: dict[str, Any], want: dict[str, Any], revision: bool) -> str | None:
    """Why counts recorded for model ``found`` are not counts of ``want`` (None: they are).
    Names compare by their last path component, as vLLM compares a cold file's; the
    revision only where both sides know it."""
    for key in ("num_layers", "num_experts", "architecture"):
        if found.get(key) != want.get(key):
            return f"counts a model with {key} {found.get(key)!r}, this start serves {want[key]!r}"
    if found.get("name") is None or _base(found["name"]) != _base(want["name"]):
        return f"counts model {found.get('name')!r}, this start serves {want['name']!r}"
    a, b = found.get("revision"), want.get("revision")
    if revision and a is not None and b is not None and a != b:
        return f"counts revision {a!r} of the model, this start serves revision {b!r}"
    return None


def _read(path: pathlib.Path) -> tuple[bytes, Counts]:
    """A counts file's bytes and counts, read under the cold-file contract's rules."""
    try:
        text = read_text(path, MAX_COUNTS_BYTES)
        doc = parse_json(text)
    except ContractError as e:
        raise CountsError(f"cannot be read ({e})") from None
    return text.encode(), counts_from_doc(doc, path.name)


def _check_shape(c: Counts, identity: dict[str, Any], history: Counts | None) -> str | None:
    if history is not None and c.prefill.shape != history.prefill.shape:
        return f"has counts of shape {c.prefill.shape}, {USAGE_NAME} {history.prefill.shape}"
    layers, experts = c.prefill.shape
    if experts != identity["num_experts"] or layers < identity["num_layers"]:
        return (
            f"has counts of shape {c.prefill.shape}, the model has {identity['num_layers']} "
            f"layers of {identity['num_experts']} experts"
        )
    return None


def load_history(state: pathlib.Path, identity: dict[str, Any], log: Log) -> Counts | None:
    """usage.json, or None (none yet, or set aside because it cannot be used)."""
    path = state / USAGE_NAME
    if not os.path.lexists(path):
        return None
    try:
        _, history = _read(path)
        why = model_mismatch(history.model, identity, revision=True) or _check_shape(
            history, identity, None
        )
        runs, folded = history.extra.get("runs", 0), history.extra.get("folded_runs", [])
        if type(runs) is not int or runs < 0:
            why = why or f"has 'runs' {runs!r}, not a whole number >= 0"
        if not isinstance(folded, list) or not all(isinstance(x, str) for x in folded):
            why = why or "has 'folded_runs' that is not a list of run ids"
    except CountsError as e:
        why = f"is not usable ({e})"
    if why:
        set_aside(state, path, why, log)
        return None
    return history


@dataclass
class _Run:
    id: str
    remove: list[pathlib.Path]  # what removing the run removes: its folder, or legacy files
    files: list[pathlib.Path] = field(default_factory=list)


def _earlier_runs(state: pathlib.Path, log: Log) -> list[_Run]:
    runs = state / RUN_DIR
    if not os.path.lexists(runs):
        return []
    if runs.is_symlink() or not runs.is_dir():
        set_aside(state, runs, "is not a folder", log)
        return []
    found: list[_Run] = []
    legacy: list[pathlib.Path] = []
    for entry in sorted(runs.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            if not RUN_ID.match(entry.name):
                set_aside(state, entry, "is not a run folder (run/<run id>/)", log)
                continue
            files = sorted(
                p for p in entry.iterdir() if p.name.endswith(".json") and p.name[0] != "."
            )
            found.append(_Run(entry.name, [entry], files))
        elif entry.name.endswith(".json"):
            legacy.append(entry)  # the counting hook's files before run ids
    if legacy:
        found.append(_Run("legacy", legacy, legacy))
    return found


def _remove(run: _Run, runs: pathlib.Path) -> None:
    for path in run.remove:
        if path.is_dir() and not path.is_symlink():
            for p in sorted(path.iterdir()):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
                crash_point("run.file-removed")
            path.rmdir()
            crash_point("run.folder-removed")
        else:
            path.unlink(missing_ok=True)
            crash_point("run.file-removed")
    fsync_dir(runs)


def _run_counts(
    run: _Run, identity: dict[str, Any], history: Counts | None
) -> tuple[str, Counts | None]:
    """The run's id (legacy runs: a hash of their files) and merged counts (None: it
    counted nothing). Raises CountsError naming why the run cannot be used."""
    digest = hashlib.sha256()
    parts: list[Counts] = []
    for path in run.files:
        try:
            data, counts = _read(path)
        except CountsError as e:
            raise CountsError(f"{path.name} {e}") from None
        digest.update(path.name.encode() + b"\0" + data + b"\0")
        parts.append(counts)
    run_id = run.id if run.id != "legacy" else f"legacy-{digest.hexdigest()[:16]}"
    if not parts:
        return run_id, None
    counts = merge_ranks(parts)
    why = model_mismatch(counts.model, identity, revision=False) or _check_shape(
        counts, identity, history
    )
    if why:
        raise CountsError(why)
    if counts.tokens() == 0 and not counts.total.any():
        return run_id, None
    return run_id, counts


def fold_runs(state: pathlib.Path, identity: dict[str, Any], log: Log) -> Counts | None:
    """Add every earlier run's counts to usage.json once (module docstring); return the
    usage history (None: there is none)."""
    history = load_history(state, identity, log)
    folded: list[str] = list(history.extra.get("folded_runs", [])) if history else []
    runs_dir = state / RUN_DIR
    pending: list[tuple[_Run, str, Counts]] = []
    for run in _earlier_runs(state, log):
        if run.id in folded:  # a kill came after usage.json was saved, before the removal
            _remove(run, runs_dir)
            log(f"budget-start: run {run.id} was added to {USAGE_NAME} already; removed")
            continue
        try:
            run_id, counts = _run_counts(run, identity, history or _first(pending))
        except CountsError as e:
            for path in run.remove:
                set_aside(state, path, f"(run {run.id}) cannot be used: {e}", log)
            continue
        if run_id in folded:
            _remove(run, runs_dir)
            log(f"budget-start: run {run_id} was added to {USAGE_NAME} already; removed")
        elif counts is None:
            _remove(run, runs_dir)  # the server counted nothing
        else:
            pending.append((run, run_id, counts))
    if not pending:
        return history
    merged = _merge(
        history, [c for _, _, c in pending], [i for _, i, _ in pending], state, identity
    )
    write_atomic(state / USAGE_NAME, _json(merged), "usage")
    for run, _, _ in pending:
        _remove(run, runs_dir)
    tokens = sum(c.tokens() for _, _, c in pending)
    log(
        f"budget-start: added the counts of {len(pending)} earlier run(s) ({tokens} tokens) "
        f"to {state / USAGE_NAME} ({merged.extra['runs']} runs)"
    )
    return merged


def _first(pending: Sequence[tuple[_Run, str, Counts]]) -> Counts | None:
    return pending[0][2] if pending else None


def _merge(
    history: Counts | None,
    runs: list[Counts],
    ids: list[str],
    state: pathlib.Path,
    identity: dict[str, Any],
) -> Counts:
    parts = ([history] if history is not None else []) + runs
    tokens = {p: sum(c.tokens(p) for c in parts) for p in PHASES}
    before = list(history.extra.get("folded_runs", [])) if history is not None else []
    folded = (list(reversed(ids)) + before)[: max(FOLDED_KEPT, len(ids))]
    return Counts(
        identity,
        {"name": "served traffic", "kind": "mixed", "source": str(state), "tokens": tokens},
        np.sum([c.prefill for c in parts], axis=0),
        np.sum([c.decode for c in parts], axis=0),
        runs[0].top_k,
        "scripts/budget-start (counting hook, summed over runs)",
        {
            "runs": (int(history.extra.get("runs", 0)) if history else 0) + len(runs),
            "folded_runs": folded,
        },
    )


def _json(c: Counts) -> str:
    return json.dumps(c.to_json()) + "\n"
