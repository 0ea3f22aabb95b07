# SPDX-License-Identifier: Apache-2.0
"""Engine results a run left in a folder (gpu_harness names them LABEL-KEY.json, with their
LABEL-KEY.config.json), found again by label: --from-runs assembles a report from them, and
the committed runs of tests/cpu/data are read the same way. Raw runs may be gzip-compressed."""

from __future__ import annotations

import gzip
import json
import pathlib
import re


def engine_run(folder: pathlib.Path, label: str) -> dict | None:
    """The engine run `label` of a suite run in `folder` (None: not there), with the model it
    really ran as "ran_model" where its config says."""
    # bench-<slug>-<16 hex>.json exactly: offload-03's must not match offload-03-swap's
    pattern = re.compile(rf"({re.escape(label)}-[0-9a-f]{{16}})\.json(\.gz)?")
    found = [f for f in sorted(folder.iterdir()) if pattern.fullmatch(f.name)]
    if len(found) > 1:
        raise SystemExit(
            f"{folder} holds {len(found)} engine runs of {label}: keep the one of this "
            "suite run only"
        )
    if not found:
        return None
    res = json.loads(read_maybe_gzip(found[0]))
    stem = pattern.fullmatch(found[0].name).group(1)
    for c in (folder / f"{stem}.config.json", folder / f"{stem}.config.json.gz"):
        if c.exists():
            config = json.loads(read_maybe_gzip(c))
            res["ran_model"] = pathlib.Path(config["model"]).name
            res["engine_args"] = config.get("engine")
            break
    return res


def read_maybe_gzip(path: pathlib.Path) -> str:
    """The text of `path`, decompressed if its name ends in .gz."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode()
