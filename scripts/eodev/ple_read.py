# SPDX-License-Identifier: Apache-2.0
"""What reading Qwen4Exp's PLE n-gram table from host memory costs per token, against the
table in VRAM (VLLM_PLE_TABLE=host against gpu).

A PLE layer looks up one row per n-gram head for every token (16 heads at the defaults;
rows of ple_embed_dim / 16 values, 320 B in BF16 for the real model), spread over a table of
95.4 GiB: random rows, never in the GPU's L2 cache. The series keeps the table in
page-locked host memory and the embedding's gather reads it through a UVA view, so every
row is a PCIe read. This times that gather, one launch of ``F.embedding`` over
(tokens, heads) ids, on a table of --table-gib GiB far past L2, in two places:

  vram       the table in VRAM (upstream)
  host_uva   the same bytes in pinned host memory, read through their device address

for decode-sized (1-16 tokens) and prefill-sized launches (256-8192 tokens), each after an
L2 flush and a GPU sleep, fresh ids every repeat. Reported per launch (median, p90) and the
added time per token of one PLE layer: (host_uva - vram) / tokens. Both gathers must return
the same rows.

    scripts/bench-ple-read --out ple_read.json   (a GPU host, the patched vLLM importable)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from eodev.host_read import _pinned_device_view, _stats, _Timer

GiB = 1 << 30
# the real model: ple_embed_dim 2560 over (ngram_size 3 - 1) x heads_per_ngram 8 heads
HEADS = 16
WIDTH = 160


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench-ple-read",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench_ple_read.json", help="JSON result file")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument(
        "--table-gib", type=float, default=8.0, help="table size (default 8; the real one 95.4)"
    )
    p.add_argument("--heads", type=int, default=HEADS, help="n-gram heads: rows per token")
    p.add_argument("--width", type=int, default=WIDTH, help="BF16 values per row")
    p.add_argument(
        "--tokens", default="1,4,16,256,2048,8192", help="tokens per launch, comma separated"
    )
    p.add_argument("--repeats", type=int, default=50, help="timed launches per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed launches per case")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def head_ranges(rows: int, heads: int) -> list[tuple[int, int]]:
    """Each head's [first, end) rows: the table split into equal parts, as vLLM lays out
    one vocabulary per head one after the other (their sizes differ by a few primes)."""
    per = rows // heads
    return [(h * per, (h + 1) * per) for h in range(heads)]


def draw_ids(
    tokens: int, ranges: list[tuple[int, int]], gen: torch.Generator, device: int
) -> torch.Tensor:
    """(tokens, heads) int64 row ids, head h's uniform in its own range (a hashed n-gram)."""
    cols = [
        torch.randint(first, end, (tokens,), generator=gen, dtype=torch.int64)
        for first, end in ranges
    ]
    return torch.stack(cols, dim=1).to(device)


def added_per_token(tokens: int, vram: dict, host: dict) -> dict:
    """What the host table adds per token of one PLE layer, from the two cases' stats."""
    return {
        "added_us_per_token_median": (host["median_ms"] - vram["median_ms"]) * 1e3 / tokens,
        "added_us_per_token_p90": (host["p90_ms"] - vram["p90_ms"]) * 1e3 / tokens,
        "ratio_median": host["median_ms"] / vram["median_ms"],
    }


def _bench(tokens: int, tables: dict[str, torch.Tensor], args, ranges, timer) -> dict:
    gen = torch.Generator().manual_seed(args.seed + tokens)
    draws = [draw_ids(tokens, ranges, gen, args.device) for _ in range(args.warmup + args.repeats)]
    row_bytes = args.width * 2
    res: dict = {"tokens": tokens, "rows_per_launch": tokens * args.heads}
    outs = {}
    for name, table in tables.items():
        holder = {}

        def gather(i: int, table=table, holder=holder) -> None:
            holder["out"] = F.embedding(draws[i], table)

        times = timer.run(gather, args.repeats, args.warmup)
        res[name] = _stats(times, tokens * args.heads, row_bytes)
        outs[name] = holder["out"]
    res["data_ok"] = bool(torch.equal(outs["vram"], outs["host_uva"]))
    res.update(added_per_token(tokens, res["vram"], res["host_uva"]))
    return res


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    t0 = time.perf_counter()
    dev = args.device
    torch.cuda.set_device(dev)
    rows = int(args.table_gib * GiB) // (args.width * 2)
    if rows < args.heads:
        sys.exit(f"--table-gib {args.table_gib} holds fewer rows than --heads {args.heads}")
    vram = torch.empty((rows, args.width), dtype=torch.bfloat16, device=dev)
    vram.normal_(generator=torch.Generator(device=dev).manual_seed(args.seed))
    pinned = torch.empty((rows, args.width), dtype=torch.bfloat16, pin_memory=True)
    pinned.copy_(vram)
    flat = pinned.view(-1).view(torch.uint8)
    host = _pinned_device_view(flat, dev).view(torch.bfloat16).view(rows, args.width)
    ranges = head_ranges(rows, args.heads)
    timer = _Timer(dev)
    tables = {"vram": vram, "host_uva": host}
    results = {}
    for n in (int(t) for t in args.tokens.split(",")):
        results[f"tokens={n}"] = _bench(n, tables, args, ranges, timer)
    report = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "table_rows": rows,
        "table_bytes": rows * args.width * 2,
        "heads": args.heads,
        "row_bytes": args.width * 2,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "results": results,
        "all_data_ok": all(r["data_ok"] for r in results.values()),
        "elapsed_s": time.perf_counter() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"{report['device']}: a {report['table_bytes'] / GiB:.1f} GiB table, "
        f"{args.heads} rows of {args.width * 2} B per token, {args.repeats} repeats"
    )
    print(f"{'tokens':>6} {'vram ms':>9} {'host ms':>9} {'ratio':>6} {'added us/token':>15}  ok")
    for r in results.values():
        print(
            f"{r['tokens']:>6} {r['vram']['median_ms']:>9.4f} {r['host_uva']['median_ms']:>9.4f} "
            f"{r['ratio_median']:>6.2f} {r['added_us_per_token_median']:>15.3f}  {r['data_ok']}"
        )
    print(f"wrote {args.out} in {report['elapsed_s']:.1f} s (median over repeats; one PLE layer)")
    return 0 if report["all_data_ok"] else 1
