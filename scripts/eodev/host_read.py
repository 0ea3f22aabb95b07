# SPDX-License-Identifier: Apache-2.0
"""What one host-resident expert read costs: SM loads through the one-table VMM range
against SM loads of plain pinned memory (UVA) and a copy-engine copy, VRAM for
reference.

For K = 1, 10, 40 random rows of one expert's bytes (the target model's INT4 expert:
2,534,400 B), one launch reads the K rows:

  vmm_host     Triton kernel, host rows of a vmm.SplitTable (the offload-03 path)
  uva_pinned   the same kernel over torch pinned memory through its device pointer
  copy_engine  K x gpu_row.copy_(pinned_row, non_blocking=True)
  vram         the same kernel over a plain VRAM tensor
  vmm_gpu      the same kernel, GPU rows of the SplitTable

Each launch is timed with CUDA events after an L2 flush and a GPU sleep (so the
launch's CPU cost is hidden); rows change every repeat. Reported: median and p90 per
launch, per row, GB/s, and the ratio vmm_host / uva_pinned (target <= 1.10).

    scripts/bench-host-read --out host_read.json   (a GPU host, the patched vLLM importable)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.expert_offload import vmm

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# one expert's tensors: w13 1280x2560 INT4, w2 2560x640 INT4, BF16 group-128 scales of both
EXPERT_PARTS = (1_638_400, 819_200, 51_200, 25_600)
EXPERT_BYTES = sum(EXPERT_PARTS)
TARGET_RATIO = 1.10

if triton is not None:

    @triton.jit
    def _read_rows_kernel(
        src_ptr,
        idx_ptr,
        out_ptr,
        row_words,
        n_chunks,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out[k, c] = wrapping int32 sum of words [c*CHUNK, (c+1)*CHUNK) of row
        idx[k]: every byte is loaded and used."""
        k = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(idx_ptr + k).to(tl.int64)
        base = src_ptr + row * row_words
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + i + tl.arange(0, BLOCK)
            acc += tl.load(base + offs, mask=offs < row_words, other=0)
        tl.store(out_ptr + k * n_chunks + c, tl.sum(acc, axis=0))


def _vmm():
    """The series' VMM wrapper; imported late so that --help needs no vLLM."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_offload import vmm
    except ImportError as e:
        raise SystemExit(
            f"error: bench-host-read needs vLLM with this project's series applied ({e}); "
            "put the patched copy first on PYTHONPATH, e.g. "
            "PYTHONPATH=scripts:/tmp/vllm-patched:/tmp/site (scripts/test-gpu makes it)"
        ) from e
    return vmm


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--out", default="bench_host_read.json", help="JSON result file")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--ks", default="1,10,40", help="rows per launch, comma separated")
    p.add_argument("--repeats", type=int, default=100, help="timed launches per case")
    p.add_argument("--warmup", type=int, default=10, help="untimed launches per case")
    p.add_argument(
        "--pool-rows",
        type=int,
        default=64,
        help="host rows to draw from (more than L2 holds; default 64 = 162 MB)",
    )
    p.add_argument("--row-bytes", type=int, default=EXPERT_BYTES, help="bytes of one expert")
    p.add_argument("--chunk-words", type=int, default=4096, help="int32 words per Triton program")
    p.add_argument("--block-words", type=int, default=1024, help="words per load step")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _pinned_device_view(pinned: torch.Tensor, device: int) -> torch.Tensor:
    """A CUDA uint8 tensor over pinned host memory, through cudaHostGetDevicePointer
    (the UVA device address of the same bytes)."""
    try:
        from cuda.bindings import runtime

        err, dptr = runtime.cudaHostGetDevicePointer(pinned.data_ptr(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        dptr = int(dptr)
    except ImportError:
        dptr = pinned.data_ptr()  # UVA: the host address is the device address
    nbytes = pinned.numel() * pinned.element_size()
    return _vmm().device_tensor(dptr, nbytes, device)


class _Timer:
    def __init__(self, device: int):
        self.device = device
        # larger than L2 (50-60 MB on H100/H200), zeroed before each launch
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def run(self, fn, repeats: int, warmup: int) -> list[float]:
        for i in range(warmup):
            fn(i)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            self.flush.zero_()
            if self.sleep is not None:
                self.sleep(1_000_000)  # ~0.5 ms of GPU time to queue the launch behind
            starts[i].record()
            fn(warmup + i)
            ends[i].record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def _stats(times_ms: list[float], k: int, row_bytes: int) -> dict:
    times = sorted(times_ms)
    med = statistics.median(times)
    p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
    nbytes = k * row_bytes
    return {
        "median_ms": med,
        "p90_ms": p90,
        "min_ms": times[0],
        "mean_ms": statistics.fmean(times),
        "per_row_median_us": med * 1e3 / k,
        "per_row_p90_us": p90 * 1e3 / k,
        "gbps_median": nbytes / (med * 1e-3) / 1e9,
        "gbps_p90": nbytes / (p90 * 1e-3) / 1e9,
    }


def _bench_k(k: int, ctx: SimpleNamespace) -> dict:
    """Time every case for K rows per launch."""
    args = ctx.args
    chunk, block = args.chunk_words, args.block_words
    n_chunks = triton.cdiv(ctx.row_words, chunk)
    n_draws = args.warmup + args.repeats
    last = n_draws - 1

    def draw(n: int) -> torch.Tensor:
        # rows for each launch, drawn fresh every repeat (no reuse from L2)
        return torch.stack([torch.randperm(n, generator=ctx.gen)[:k] for _ in range(n_draws)])

    draws = draw(ctx.pool)
    draws_dev = draws.to(ctx.dev)
    host_idx = draws_dev + ctx.first_host
    gpu_draws = draw(ctx.n_gpu) if ctx.n_gpu >= k else None
    out = torch.empty((k, n_chunks), dtype=torch.int32, device=ctx.dev)
    dst = torch.empty((k, ctx.row_bytes), dtype=torch.uint8, device=ctx.dev)

    def kernel(source: torch.Tensor, idx: torch.Tensor) -> None:
        _read_rows_kernel[(k, n_chunks)](
            source, idx, out, ctx.row_words, n_chunks,
            CHUNK=chunk, BLOCK=block, num_warps=args.num_warps,
        )  # fmt: skip

    def copies(i: int) -> None:
        for j, r in enumerate(draws[i].tolist()):
            dst[j].copy_(ctx.pinned[r], non_blocking=True)

    cases = {
        "vmm_host": lambda i: kernel(ctx.tab, host_idx[i]),
        "uva_pinned": lambda i: kernel(ctx.uva, draws_dev[i]),
        "copy_engine": copies,
        "vram": lambda i: kernel(ctx.vram, draws_dev[i]),
    }
    if gpu_draws is not None:
        gpu_draws_dev = gpu_draws.to(ctx.dev)
        cases["vmm_gpu"] = lambda i: kernel(ctx.tab, gpu_draws_dev[i])

    res: dict = {"k": k, "bytes": k * ctx.row_bytes}
    for name, fn in cases.items():
        times = ctx.timer.run(fn, args.repeats, args.warmup)
        res[name] = _stats(times, k, ctx.row_bytes)
        # the last launch read what it should have
        if name == "copy_engine":
            ok = torch.equal(dst.cpu(), ctx.pinned[draws[last]])
        else:
            rows = gpu_draws[last] if name == "vmm_gpu" else draws[last]
            got = out.to(torch.int64).sum(1).cpu() & 0xFFFFFFFF
            ok = torch.equal(got, ctx.row_sums[rows])
        res[name]["data_ok"] = bool(ok)
    host, uva = res["vmm_host"], res["uva_pinned"]
    ratio = host["median_ms"] / uva["median_ms"]
    res["ratio_vmm_host_over_uva_pinned"] = ratio
    res["ratio_vmm_host_over_uva_pinned_p90"] = host["p90_ms"] / uva["p90_ms"]
    res["ratio_vmm_host_over_copy_engine"] = host["median_ms"] / res["copy_engine"]["median_ms"]
    res["within_10pct_of_uva"] = ratio <= TARGET_RATIO
    return res


def _check_sizes(args: argparse.Namespace) -> list[int]:
    """The Ks to time, once the row and pool sizes are known to fit them (else exit)."""
    ks = [int(k) for k in args.ks.split(",")]
    kmax = max(ks)
    if args.row_bytes % 4:
        sys.exit("--row-bytes must be a multiple of 4")
    if args.pool_rows < kmax:
        sys.exit(f"--pool-rows ({args.pool_rows}) must be >= the largest K ({kmax})")
    return ks


def _pool_data(
    args: argparse.Namespace, dev: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool's random words in VRAM, the same bytes in pinned host memory, and that
    memory's UVA device view: the same bytes in every place read from."""
    pool, row_bytes = args.pool_rows, args.row_bytes
    row_words = row_bytes // 4
    g = torch.Generator(device=dev).manual_seed(args.seed)
    src = torch.randint(
        -(2**31), 2**31 - 1, (pool, row_words), dtype=torch.int32, device=dev,
        generator=g,
    )  # fmt: skip
    pinned = torch.empty((pool, row_bytes), dtype=torch.uint8, pin_memory=True)
    pinned.view(torch.int32).copy_(src)
    uva = _pinned_device_view(pinned, dev).view(torch.int32).view(pool, row_words)
    return src, pinned, uva


def _one_table(
    src: torch.Tensor, kmax: int, row_bytes: int, dev: int
) -> tuple[vmm.SplitTable, torch.Tensor, int, int]:
    """A one table of at least `kmax` GPU rows, the straddling row, then the host pool,
    filled from `src`; with its int32 view, its first host row and its GPU rows filled."""
    pool, row_words = src.shape
    gran = _vmm().granularity(dev)
    gpu_bytes = -(-kmax * row_bytes // gran) * gran
    table = _vmm().SplitTable(gpu_bytes // row_bytes + 1 + pool, row_bytes, gpu_bytes, device=dev)
    first_host = table.gpu_rows + (1 if table.gpu_bytes % row_bytes else 0)
    assert table.gpu_rows >= kmax and table.rows - first_host >= pool, table
    tab = table.view(torch.int32, (table.rows, row_words))
    tab[first_host : first_host + pool].copy_(src)
    n_gpu = min(table.gpu_rows, pool)
    tab[:n_gpu].copy_(src[:n_gpu])
    return table, tab, first_host, n_gpu


def _bench_context(
    args: argparse.Namespace, dev: int, kmax: int
) -> tuple[vmm.SplitTable, SimpleNamespace]:
    """The one table and what every K's cases read from and time with; the table outlives
    the context (close it once the context, which holds views of it, is gone)."""
    src, pinned, uva = _pool_data(args, dev)
    table, tab, first_host, n_gpu = _one_table(src, kmax, args.row_bytes, dev)
    ctx = SimpleNamespace(
        args=args,
        dev=dev,
        row_bytes=args.row_bytes,
        row_words=args.row_bytes // 4,
        pool=args.pool_rows,
        n_gpu=n_gpu,
        first_host=first_host,
        tab=tab,
        uva=uva,
        vram=src,  # plain VRAM rows
        pinned=pinned,
        # expected per-row sums (mod 2**32), to check what the kernel read
        row_sums=(src.to(torch.int64).sum(1) & 0xFFFFFFFF).cpu(),
        timer=_Timer(dev),
        gen=torch.Generator().manual_seed(args.seed + 1),
    )
    return table, ctx


def _report(
    args: argparse.Namespace,
    table: vmm.SplitTable,
    table_desc: str,
    results: dict,
    t_start: float,
) -> dict:
    """The JSON result: versions, the table, the settings and every K's results."""
    try:
        from cuda.bindings import __version__ as cb_version
    except ImportError:
        cb_version = None
    return {
        "device": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_bindings": cb_version,
        "python": platform.python_version(),
        "row_bytes": args.row_bytes,
        "granularity": table.granularity,
        "numa_node": table.numa_node,
        "table": table_desc,
        "pool_rows": args.pool_rows,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "chunk_words": args.chunk_words,
        "block_words": args.block_words,
        "num_warps": args.num_warps,
        "target_ratio": TARGET_RATIO,
        "results": results,
        "all_within_10pct_of_uva": all(r["within_10pct_of_uva"] for r in results.values()),
        "all_data_ok": all(
            v["data_ok"] for r in results.values() for v in r.values() if isinstance(v, dict)
        ),
        "elapsed_s": time.perf_counter() - t_start,
    }


def _print_report(report: dict, out: str) -> None:
    """The results as a table on stdout, a row per K and case, then the ratios."""
    print(f"{report['device']}, row {report['row_bytes']} B, {report['repeats']} repeats")
    head = f"{'K':>3} {'case':<12} {'median ms':>10} {'p90 ms':>9} {'us/row':>8}"
    print(f"{head} {'GB/s':>7}  ok")
    for res in report["results"].values():
        for name in ("vmm_host", "uva_pinned", "copy_engine", "vram", "vmm_gpu"):
            if name not in res:
                continue
            s = res[name]
            print(
                f"{res['k']:>3} {name:<12} {s['median_ms']:>10.4f} "
                f"{s['p90_ms']:>9.4f} {s['per_row_median_us']:>8.1f} "
                f"{s['gbps_median']:>7.1f}  {s['data_ok']}"
            )
        print(
            f"    vmm_host / uva_pinned = {res['ratio_vmm_host_over_uva_pinned']:.3f} "
            f"(target <= {TARGET_RATIO}), / copy_engine = "
            f"{res['ratio_vmm_host_over_copy_engine']:.3f}"
        )
    print(f"wrote {out} in {report['elapsed_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if triton is None:
        sys.exit("needs Triton")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    t_start = time.perf_counter()
    dev = args.device
    torch.cuda.set_device(dev)
    ks = _check_sizes(args)
    reason = _vmm().probe_host_mapping(dev)
    if reason is not None:
        sys.exit(f"host mapping refused: {reason}")

    table, ctx = _bench_context(args, dev, max(ks))
    results = {f"K={k}": _bench_k(k, ctx) for k in ks}
    del ctx  # its views of the table go before the table closes
    table_desc = repr(table)
    table.close()

    report = _report(args, table, table_desc, results, t_start)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    _print_report(report, args.out)
    return 0 if report["all_data_ok"] else 1
