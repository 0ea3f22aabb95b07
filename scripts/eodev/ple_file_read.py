# SPDX-License-Identifier: Apache-2.0
"""What reading Qwen4Exp's PLE n-gram table from the checkpoint file costs (VLLM_PLE_TABLE=file)
against the table page-locked in host memory (host), at the level of one PLE layer's lookup.

It writes a safetensors file holding one table of --table-gib GiB (rows of 160 BF16 values, as
the real model's) under --dir, then, with the series' own code (qwen4_exp/common/ple_file.py):

  disk         4 KiB random reads of the file at queue depth 1 and 64 (its pages evicted first)
  decode       one step's gather (1, 4, 16 tokens x 16 rows): file cold, file warm, and the same
               rows through the pinned table's UVA view (F.embedding), as the GPU reads them
  prefill      a prompt's rows (2k, 8k, 32k tokens x 16 random rows) gathered in 2048-token
               chunks as prefill does: cold without prefetch, cold with the arrival prefetch
               started when the prompt arrives (prefill right behind it), warm, and pinned
  resident     the table's bytes in the page cache afterwards (mincore)

Cold means the file's pages dropped with POSIX_FADV_DONTNEED before the case (no global
drop_caches). Results: --out JSON and the same name with .md.

    scripts/bench-ple-file --dir /mnt/nvme/eo-ple --table-gib 16 \
        --out bench/results/ple-file-read.json
    (a GPU host, the patched vLLM importable, --dir on the drive to measure)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import pathlib
import platform
import statistics
import struct
import sys
import threading
import time

import numpy as np

GiB = 1 << 30
PAGE = 4096
HEADS = 16
WIDTH = 160  # BF16 values per row: the real model's 2560 / 16
NAME = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight"
PREFIX = "model.layers.0.ple.ple_embedding.ngram_embedding"


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-ple-file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default="/tmp/eo-ple-file", help="where the table file is written")
    p.add_argument("--table-gib", type=float, default=16.0, help="table size (default 16)")
    p.add_argument("--out", default="bench_ple_file.json", help="JSON result file")
    p.add_argument("--decode-tokens", default="1,4,16", help="tokens per decode step")
    p.add_argument("--prompts", default="2048,8192,32768", help="prompt lengths in tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--threads", type=int, default=8, help="prefetch threads")
    p.add_argument("--repeats", type=int, default=20, help="timed decode steps per case")
    p.add_argument("--no-pinned", action="store_true", help="skip the pinned comparison")
    p.add_argument("--keep", action="store_true", help="keep the table file afterwards")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- the table file -------------------------------------------------------------------------


def write_table(path: pathlib.Path, rows: int, seed: int) -> tuple[int, int]:
    """A safetensors file with one [rows, WIDTH] BF16 table of random values (finite:
    exponent bits kept small); (data offset, bytes). Skipped if it exists at that size."""
    nbytes = rows * WIDTH * 2
    header = json.dumps(
        {NAME: {"dtype": "BF16", "shape": [rows, WIDTH], "data_offsets": [0, nbytes]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    base = 8 + len(header)
    if path.exists() and path.stat().st_size == base + nbytes:
        return base, nbytes
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = nbytes // 2
        while left:
            n = min(left, 64 << 20)
            vals = rng.integers(0x3C00, 0x3F80, size=n, dtype=np.uint16)  # 2^-7 .. 1.0
            f.write(vals.tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return base, nbytes


def evict(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: pathlib.Path, begin: int, nbytes: int) -> int:
    """Bytes of [begin, begin + nbytes) of the file in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        head = np.frombuffer(mm, dtype=np.uint8, count=1)
        start = begin // PAGE * PAGE
        pages = (begin + nbytes - start + PAGE - 1) // PAGE
        vec = np.zeros(pages, dtype=np.uint8)
        rc = libc.mincore(head.ctypes.data + start, pages * PAGE, vec.ctypes.data)
        del head  # the mapping closes only without views
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    return int((vec & 1).sum()) * PAGE


# --- disk -----------------------------------------------------------------------------------


def iops(path: pathlib.Path, begin: int, nbytes: int, depth: int, reads: int, seed: int) -> float:
    """Random 4 KiB preads per second with `depth` threads in flight, cold pages."""
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    pages = nbytes // PAGE
    offsets = begin // PAGE * PAGE + np.random.default_rng(seed).integers(0, pages, reads) * PAGE
    parts = np.array_split(offsets, depth)

    def work(part: np.ndarray) -> None:
        for off in part:
            os.pread(fd, PAGE, int(off))

    threads = [threading.Thread(target=work, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return reads / dt


# --- lookups --------------------------------------------------------------------------------


def _median_p90(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))]}


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from vllm.models.qwen4_exp.common import ple_file as pf

    out_dir = pathlib.Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ple-table.safetensors"
    rows = int(args.table_gib * GiB) // (WIDTH * 2)
    t0 = time.perf_counter()
    begin, nbytes = write_table(path, rows, args.seed)
    result: dict = {
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0),
        "table": {"file": str(path), "rows": rows, "width": WIDTH, "gib": nbytes / GiB},
        "write_s": time.perf_counter() - t0,
    }
    result["disk"] = {
        "iops_qd1": iops(path, begin, nbytes, 1, 4000, args.seed),
        "iops_qd64": iops(path, begin, nbytes, 64, 64000, args.seed + 1),
    }
    segments = pf.plan_segments(
        pf.table_tensors([str(path)], PREFIX),
        rows=rows,
        width=WIDTH,
        dtype=torch.bfloat16,
        split_parts=1,
        what="(benchmark)",
    )
    table = pf.PLEFileTable(segments, width=WIDTH, dtype=torch.bfloat16, what="(benchmark)")
    lookup = pf.PLEFileLookup(table)
    dev = torch.device("cuda", 0)
    rng = np.random.default_rng(args.seed)

    pinned = None
    if not args.no_pinned:
        from eodev.host_read import _pinned_device_view

        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with open(path, "rb") as f:
            f.seek(begin)
            f.readinto(memoryview(host.numpy()))
        view = _pinned_device_view(host, 0)
        pinned = view.view(torch.bfloat16).view(rows, WIDTH)

    def file_step(ids: np.ndarray) -> float:
        t_ids = torch.from_numpy(ids).to(dev)
        out = torch.empty(ids.shape[0], HEADS, WIDTH, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        lookup(t_ids, out)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def pinned_step(ids: np.ndarray) -> float:
        t_ids = torch.from_numpy(ids).to(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.embedding(t_ids, pinned)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    # decode: fresh random ids per step; cold after an eviction, warm on the same ids again
    decode = {}
    for n in (int(x) for x in args.decode_tokens.split(",")):
        steps = [rng.integers(0, rows, (n, HEADS)) for _ in range(args.repeats)]
        evict(path)
        cold = [file_step(s) for s in steps]
        warm = [file_step(s) for s in steps]
        case = {"file_cold_ms": _median_p90(cold), "file_warm_ms": _median_p90(warm)}
        if pinned is not None:
            case["pinned_ms"] = _median_p90([pinned_step(s) for s in steps])
        decode[str(n)] = case
    result["decode"] = decode

    # prefill: a prompt's rows in chunks, as prefill gathers them
    prefill = {}
    for n in (int(x) for x in args.prompts.split(",")):
        ids = rng.integers(0, rows, (n, HEADS))
        chunks = [ids[i : i + args.chunk] for i in range(0, n, args.chunk)]

        def gather_all(step, chunks=chunks) -> float:
            t = time.perf_counter()
            for c in chunks:
                step(c)
            return (time.perf_counter() - t) * 1e3

        evict(path)
        cold = gather_all(file_step)
        evict(path)
        prefetcher = pf.PLEPrefetcher(
            [(table, lambda toks, ctx, ids=ids: ids[np.asarray(toks)].reshape(-1))],
            threads=args.threads,
            context_tokens=0,
        )
        t = time.perf_counter()
        prefetcher.submit("bench", list(range(n)))
        with_prefetch = gather_all(file_step)
        while prefetcher.pending_tokens:
            time.sleep(0.001)
        prefetch_done = (time.perf_counter() - t) * 1e3
        prefetcher.close()
        warm = gather_all(file_step)
        case = {
            "file_cold_ms": cold,
            "file_cold_prefetch_ms": with_prefetch,
            "prefetch_all_pages_ms": prefetch_done,
            "prefetch_pages_read": prefetcher.counters.pages_read,
            "file_warm_ms": warm,
        }
        if pinned is not None:
            case["pinned_ms"] = gather_all(pinned_step)
        prefill[str(n)] = case
    result["prefill"] = prefill
    result["resident_bytes_after"] = resident_bytes(path, begin, nbytes)
    if pinned is not None:
        result["gather_vs_pinned_decode_16"] = decode.get("16", {}).get("pinned_ms", {}).get(
            "median", 0
        ) / max(decode.get("16", {}).get("file_warm_ms", {}).get("median", 1e-9), 1e-9)
    table.close()
    if not args.keep:
        path.unlink()
    return result


def markdown(r: dict) -> str:
    lines = [
        f"# PLE table read from file: {r['table']['gib']:.1f} GiB table, {r['gpu']}",
        "",
        f"Disk: {r['disk']['iops_qd1']:.0f} random 4 KiB reads/s at queue depth 1, "
        f"{r['disk']['iops_qd64']:.0f} at 64.",
        "",
        "| decode step (tokens) | file cold ms | file warm ms | pinned ms |",
        "|---:|---:|---:|---:|",
    ]
    for n, c in r["decode"].items():
        pinned = c.get("pinned_ms", {}).get("median")
        lines.append(
            f"| {n} | {c['file_cold_ms']['median']:.3f} | {c['file_warm_ms']['median']:.3f} | "
            f"{'-' if pinned is None else f'{pinned:.3f}'} |"
        )
    lines += [
        "",
        "| prompt (tokens) | cold ms | cold + arrival prefetch ms | warm ms | pinned ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, c in r["prefill"].items():
        pinned = c.get("pinned_ms")
        lines.append(
            f"| {n} | {c['file_cold_ms']:.1f} | {c['file_cold_prefetch_ms']:.1f} | "
            f"{c['file_warm_ms']:.1f} | {'-' if pinned is None else f'{pinned:.1f}'} |"
        )
    lines += ["", f"Resident after the run: {r['resident_bytes_after'] / GiB:.2f} GiB.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        import torch

        if not torch.cuda.is_available():
            print("bench-ple-file: no CUDA GPU; run it on a GPU host", file=sys.stderr)
            return 2
        result = run(args)
    except ImportError as e:
        print(
            f"bench-ple-file: {e}; put the patched vLLM on PYTHONPATH "
            "(e.g. scripts:/tmp/vllm-patched:/tmp/site)",
            file=sys.stderr,
        )
        return 2
    except OSError as e:
        print(f"bench-ple-file: {e}", file=sys.stderr)
        return 1
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0
