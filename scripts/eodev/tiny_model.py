# SPDX-License-Identifier: Apache-2.0
"""The model compose/tiny.yml serves: a make-test-model checkpoint (preset tiny, INT4, so the
Marlin MoE path runs) and a cold file for it, made at the container's first start into the
models volume and reused afterwards. No download: the image and the CI smoke test need no
network and no real checkpoint."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Sequence

DONE = ".complete"
HOST_EXPERTS_PER_LAYER = 64  # 12.5% of 512, as the GPU tests use


def prepare(model_dir: pathlib.Path, cold_file: pathlib.Path, per_layer: int) -> int:
    """Make what is missing; an interrupted first start is redone, a finished one is kept."""
    from .synthetic_cold import synthetic_cold_file
    from .testmodel.cli import main as make_test_model

    if (model_dir / DONE).exists():
        print(f"prepare-tiny-model: {model_dir} is there", flush=True)
    else:
        print(f"prepare-tiny-model: making {model_dir} (make-test-model --preset tiny)", flush=True)
        rc = make_test_model([str(model_dir), "--preset", "tiny", "--quant", "int4", "--force"])
        if rc:
            return rc
        (model_dir / DONE).write_text("ok\n")
    if cold_file.exists() and cold_file.stat().st_mtime >= (model_dir / DONE).stat().st_mtime:
        print(f"prepare-tiny-model: {cold_file} is there", flush=True)
        return 0
    cold_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cold_file.with_name(cold_file.name + ".partial")
    synthetic_cold_file(model_dir, partial, per_layer)
    os.replace(partial, cold_file)
    print(f"prepare-tiny-model: wrote {cold_file} ({per_layer} host experts per layer)", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="prepare-tiny-model",
        description="Make the synthetic model that compose/tiny.yml serves and its cold file, "
        "if they are not there yet.",
        epilog="exit codes: 0 ready; otherwise make-test-model's (1 bad geometry, 3 output "
        "not empty, 4 writing failed) or 2 usage.",
    )
    ap.add_argument("model_dir", type=pathlib.Path)
    ap.add_argument("cold_file", type=pathlib.Path)
    ap.add_argument(
        "--host-experts-per-layer",
        type=int,
        default=HOST_EXPERTS_PER_LAYER,
        help=f"experts of each layer kept in host memory (default {HOST_EXPERTS_PER_LAYER})",
    )
    args = ap.parse_args(argv)
    return prepare(args.model_dir, args.cold_file, args.host_experts_per_layer)


if __name__ == "__main__":
    sys.exit(main())
