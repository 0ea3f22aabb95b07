#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How often the router's k-th and (k+1)-th logits tie in BF16 on a make-test-model checkpoint,
and how often such a tie mixes a host expert and a GPU expert of a cold file.

Why: the top-k kernel breaks ties by index. offload-03 used to permute the gate so that router
ids were table rows (GPU rows first, host rows last), so a tie between a host and a GPU expert
could pick another expert than the unpatched server, which breaks ties by original expert id.
This count is why offload-03 now leaves the gate alone and maps the router's ids to rows.

    .venv/bin/python bench/analysis/router_ties.py MODEL COLD_FILE
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
from eotools.testmodel import data  # noqa: E402
from eotools.testmodel.plant import load_plan  # noqa: E402


def main(model: str, cold_file: str) -> int:
    plan = load_plan(pathlib.Path(model))
    host_of = {
        int(k): set(v) for k, v in json.loads(pathlib.Path(cold_file).read_text())["layers"].items()
    }
    prompts = [
        list(next(data.conversations(plan, d, "heldout", 1, 256, seed=11)).token_ids)
        for d in plan.planting.domains
    ]
    k = plan.geometry.top_k
    pairs = ties = mixed = 0
    for layer in range(plan.geometry.num_layers):
        host = host_of.get(layer, set())
        for ids in prompts:
            logits = torch.tensor(plan.router_logits(layer, np.array(ids)), dtype=torch.float32)
            lg = logits.to(torch.bfloat16).float().numpy()
            ranked = -np.sort(-lg, axis=1)
            tie = ranked[:, k - 1] == ranked[:, k]
            pairs += len(lg)
            ties += int(tie.sum())
            for t in np.flatnonzero(tie):
                tied = set(np.flatnonzero(lg[t] == ranked[t, k - 1]).tolist())
                mixed += bool(tied & host) and bool(tied - host)
    print(
        f"(token, layer) pairs {pairs}: BF16 tie at the top-k boundary {ties} "
        f"({ties / pairs:.2%}), mixing host and GPU experts {mixed} ({mixed / pairs:.2%})"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
