# SPDX-License-Identifier: Apache-2.0
"""Write the vllm/ package of a vLLM wheel as a `git fast-import` stream: one commit, one tag.

    python3 scripts/lib/wheel_tree.py WHEEL VERSION COMMIT_ID SHA256 BRANCH TAG | git fast-import

scripts/vllm-tree runs it. A fast-import stream rather than extract + `git add` + `git commit`
because the commit hash must be the same on every machine: fast-import stores the bytes and
modes from the wheel as they are, with no hooks, commit signing, global ignore files, end-of-line
or LFS filters, or other user configuration in between. The identity and date are fixed (the
date is the wheel's newest entry), so the same wheel always gives the same commit.

Kept: every file under vllm/ that a patch might change (Python, type stubs, JSON configs, Jinja
templates, docs, ...). Left out: compiled objects, and the C/C++/CUDA sources and headers that
vLLM vendors under vllm/third_party for its JIT kernels (thousands of files nobody patches here).
The dist-info is left out too: the version is in vllm/_version.py, which apply-patches.sh reads.
"""

from __future__ import annotations

import calendar
import re
import sys
import zipfile
from pathlib import PurePosixPath

IDENTITY = b"vllm-tree <vllm-tree@vllm-expert-offload.invalid>"
THIRD_PARTY_NATIVE = {".h", ".hpp", ".cuh", ".inl", ".cu"}
PROGRESS_EVERY = 500


def keep(name: str) -> bool:
    """Whether the wheel entry `name` belongs in the source tree."""
    path = PurePosixPath(name)
    if path.parts[0] != "vllm" or name.endswith("/"):
        return False
    if path.suffix == ".so" or name == "vllm/vllm-rs":
        return False
    if path.parts[:2] == ("vllm", "third_party"):
        return path.suffix not in THIRD_PARTY_NATIVE and path.name != "Makefile"
    return True


def wheel_version(wheel: zipfile.ZipFile) -> str:
    text = wheel.read("vllm/_version.py").decode()
    match = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if not match:
        raise SystemExit("error: vllm/_version.py in the wheel has no __version__")
    return match.group(1)


def data(payload: bytes) -> bytes:
    return b"data %d\n%s\n" % (len(payload), payload)


def main(argv: list[str]) -> int:
    if len(argv) != 7:
        print("usage:", __doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    wheel_path, version, commit_id, sha256, branch, tag = argv[1:]
    out = sys.stdout.buffer
    with zipfile.ZipFile(wheel_path) as wheel:
        found = wheel_version(wheel)
        if found != version:
            raise SystemExit(f"error: the wheel is vLLM {found}, vllm.pin says {version}")
        entries = sorted(
            (i for i in wheel.infolist() if keep(i.filename)), key=lambda i: i.filename
        )
        # The release date: the newest entry of the whole wheel (zip times carry no zone; UTC).
        when = calendar.timegm(max(i.date_time for i in wheel.infolist()) + (0, 0, 0))
        wheel_name = PurePosixPath(wheel_path).name
        message = (
            f"vLLM {version} ({commit_id}) as released in {wheel_name}\n\n"
            f"The vllm/ package of that wheel (sha256 {sha256}),\n"
            "less what no patch changes: compiled objects (*.so, vllm/vllm-rs) and the\n"
            "C/C++/CUDA sources and headers vendored under vllm/third_party.\n"
            "Made by scripts/vllm-tree; the same wheel always gives this same commit.\n"
        ).encode()

        out.write(b"feature done\n")
        out.write(b"commit refs/heads/%s\nmark :1\n" % branch.encode())
        out.write(b"author %s %d +0000\ncommitter %s %d +0000\n" % (IDENTITY, when, IDENTITY, when))
        out.write(data(message))
        for n, info in enumerate(entries, 1):
            payload = wheel.read(info)
            if payload.startswith(b"\x7fELF"):
                # A new kind of compiled file in a later wheel: teach keep() about it.
                raise SystemExit(f"error: {info.filename} is a compiled object; extend keep()")
            mode = b"100755" if (info.external_attr >> 16) & 0o111 else b"100644"
            out.write(b"M %s inline %s\n" % (mode, info.filename.encode()))
            out.write(data(payload))
            if n % PROGRESS_EVERY == 0 or n == len(entries):
                print(f"    {n}/{len(entries)} files", file=sys.stderr, flush=True)
        out.write(b"\nreset refs/tags/%s\nfrom :1\n\ndone\n" % tag.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
