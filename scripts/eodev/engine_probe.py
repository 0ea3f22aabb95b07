# SPDX-License-Identifier: Apache-2.0
"""Run one vLLM engine configuration in this process and record what it did.

    python3 -m eodev.engine_probe CONFIG.json RESULT.json

Each configuration runs in its own process (GPU tests and benchmarks start one per config), so
environment variables such as VLLM_EXPERT_COLD_FILE are set before vLLM is imported and every
engine starts clean. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so the probe can also look at the loaded model: where its expert bytes live, and VRAM use.
With pipeline parallelism ("pipeline_parallel_size" > 1 in "engine") the workers run in
processes of their own: placement and swap counters come from every rank, merged in rank
order (each rank's under "per_rank"), while the torch and VRAM figures are this process's.

CONFIG: {"model": path, "env": {...}, "engine": {LLM keyword arguments},
         "tasks": [{"kind": "greedy" | "decode_timing" | "ttft" | "decode_ab" | "streams",
                    ...}, ...]}
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

GiB = 1 << 30


class Baton:
    """Turns on the GPU with other engine processes (bench-offload --paired / --group): an
    unpatched engine and one or more offload engines side by side, each timing its requests
    only while the others wait, so that a change of the host's speed during the run hits all
    alike.

    EO_BATON="READ_FD:WRITE_FD", a pipe pair with the harness that started the engines
    (gpu_harness.run_engine_group), which hands the turn round. Once started, a process says
    so (writes a byte); then it takes a turn (reads a byte), runs one request or untimed
    task, and gives the turn back (writes a byte). A finished process takes a last turn and
    keeps it until it exits; its pipes then close and it leaves the round, as one that died
    does. If the harness is gone, this process runs alone."""

    def __init__(self, spec: str | None) -> None:
        self.active = bool(spec)
        self.rfd = self.wfd = -1
        if spec:
            fds = spec.split(":")
            if len(fds) != 2 or not all(x.isdigit() for x in fds):
                raise ValueError(f"EO_BATON={spec!r}: expected READ_FD:WRITE_FD")
            self.rfd, self.wfd = int(fds[0]), int(fds[1])
        self.waited_s = 0.0  # time spent waiting for turns (the others' work)

    def ready(self) -> None:
        """After start-up: tell the harness, which starts the round once all are ready."""
        self.give()

    def take(self) -> None:
        if self.rfd < 0:
            return
        t = time.perf_counter()
        if os.read(self.rfd, 1) == b"":  # the harness is gone: run alone
            os.close(self.rfd)
            self.rfd = -1
        self.waited_s += time.perf_counter() - t

    def give(self) -> None:
        if self.wfd < 0:
            return
        try:
            os.write(self.wfd, b"t")
        except BrokenPipeError:
            os.close(self.wfd)
            self.wfd = -1

    def hold_to_exit(self) -> None:
        """After the last task: take the turn, say "finished" ("x") and keep the turn. The
        harness moves on when this process's pipes close at exit (or after a grace time),
        so the engine's shutdown (freeing its GPU memory and CUDA context) overlaps no
        other engine's timed work."""
        self.take()
        if self.wfd >= 0:
            with contextlib.suppress(BrokenPipeError):
                os.write(self.wfd, b"x")

    @contextlib.contextmanager
    def turn(self):
        self.take()
        try:
            yield
        finally:
            self.give()


BATON = Baton(None)  # run() sets it from EO_BATON
# task kinds that take a turn per request themselves; others take one turn per task
_PER_REQUEST = ("decode_timing", "decode_ab", "streams")


def _vm_hwm_bytes() -> int:
    """Peak resident memory of this process (anonymous + file + shared, pinned included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def process_vram_bytes(pid: int | None = None) -> int | None:
    """VRAM this process holds (CUDA context, torch's pool, graphs and VMM mappings), from
    the driver's per-process accounting; None where the driver does not list the process
    (another PID namespace). The device-wide used memory is no substitute when two engines
    share the GPU (bench-offload --paired): it counts both."""
    from .nvsmi import query

    pid = os.getpid() if pid is None else pid
    for fields in query("--query-compute-apps=pid,used_memory") or []:
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * 1024 * 1024  # MiB
    return None


def _expert_placement(model) -> dict[str, Any]:
    """Bytes of routed-expert parameters on the GPU and in host memory (UVA arenas)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    gpu = host = short = 0
    layers = one_table_layers = 0
    host_by_layer: list[int] = []  # per MoE layer, in model order
    # one-table layers: the experts in host rows (the cold file's, plus GPU experts that
    # one table moved there to keep its VRAM within offload-02's), by layer number
    table_host: dict[str, list[int]] = {}
    bytes_by_layer: list[int] = []
    methods, kernels = set(), set()
    for m in model.modules():
        if not isinstance(m, RoutedExperts):
            continue
        layers += 1
        before = (gpu, host)
        methods.add(type(m.quant_method).__name__)
        kernel = getattr(m.quant_method, "moe_kernel", None)
        if kernel is not None:
            kernels.add(type(getattr(kernel, "fused_experts", kernel)).__name__)
        if "one_table" in m.__dict__:  # offload-03: the VMM ranges say where the rows are
            one_table_layers += 1
            table = m.__dict__["one_table"]
            number = re.search(r"layers\.(\d+)\.", getattr(m, "layer_name", ""))
            if number:
                table_host[number[1]] = sorted(table.row_to_expert[table.gpu_rows :])
            for owner in table.owners:
                gpu += getattr(owner, "gpu_bytes", 0)
                host += getattr(owner, "host_bytes", 0)
                # GPU rows whose bytes the range put in host memory (should be none)
                short += max(0, table.gpu_rows - getattr(owner, "gpu_rows", table.gpu_rows))
        else:
            tables = [m]
            if "host_experts" in m.__dict__:
                tables.append(m.__dict__["host_experts"])
            for t in tables:
                # offload-01/02 place a table whole (an arena); vLLM's --cpu-offload-gb
                # offloads parameter by parameter and may stop inside a layer
                arena = getattr(t, "_expert_offload_arena", None) is not None
                for p in t.parameters():
                    size = p.numel() * p.element_size()
                    if arena or getattr(p, "_vllm_is_uva_offloaded", False):
                        host += size
                    else:
                        gpu += size
        host_by_layer.append(host - before[1])
        bytes_by_layer.append(gpu - before[0] + host - before[1])
    return {
        "moe_layers": layers,
        "one_table_layers": one_table_layers,
        "one_table_gpu_rows_in_host_memory": short,
        "one_table_host_experts": table_host,
        "expert_gpu_bytes": gpu,
        "expert_host_bytes": host,
        "expert_host_bytes_by_layer": host_by_layer,
        "expert_bytes_by_layer": bytes_by_layer,
        "moe_methods": sorted(methods),
        "moe_kernels": sorted(kernels),
    }


def _model_storages(model) -> set[int]:
    """Storage addresses of everything the model holds as its weights: parameters and
    buffers, and the tensors that offload keeps outside the module tree (a split layer's
    host table, a one-table layer's ranges)."""
    import torch

    ptrs: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            ptrs.add(t.untyped_storage().data_ptr())

    for m in model.modules():
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            add(t)
        host = m.__dict__.get("host_experts")
        if host is not None:
            for t in host.parameters():
                add(t)
        table = m.__dict__.get("one_table")
        for owner in getattr(table, "owners", ()):
            add(getattr(owner, "table", None))
    return ptrs


# the census names the holders of its largest tensor groups only (``holders``)
HOLDER_LOOKUPS = 8


@contextlib.contextmanager
def _gc_unfrozen():
    """Objects frozen by ``gc.freeze()`` are left out of ``gc.get_objects()``, and vLLM's
    engine core freezes everything it made during start-up: the model, the KV cache, all
    of it. Unfreeze for the walk, freeze again after (vLLM froze to keep the collector off
    those objects)."""
    import gc

    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()


def tensor_census(
    model, device_type: str = "cuda", top: int = 12, holders: int = HOLDER_LOOKUPS
) -> dict[str, Any]:
    """The live tensors on ``device_type`` that are not the model's weights, grouped by
    shape and dtype, largest first, each with the kinds of objects that hold one of them.
    It names what an offload path allocates beside the weights (a copy that outlived its
    repack, a kernel workspace), which a difference of totals cannot."""
    with _gc_unfrozen():  # the walk and the referrer lookups both need every object
        return _tensor_census(model, device_type, top, holders)


def _tensor_census(model, device_type: str, top: int, holders: int) -> dict[str, Any]:
    import gc

    import torch

    weights = _model_storages(model)
    aliases = _alias_ranges()
    seen: set[int] = set()
    groups: dict[tuple[tuple[int, ...], str], dict[str, Any]] = {}
    other = aliased = 0
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): some objects answer __class__ with a warning
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
            # torch.compile leaves fake tensors behind, whose storage has no data pointer
            ptr = storage.data_ptr()
        except Exception:  # half-built, fake or other exotic tensors
            continue
        if not ptr or ptr in weights or ptr in seen:
            continue
        seen.add(ptr)
        if any(lo <= ptr < hi for lo, hi in aliases):
            aliased += storage.nbytes()  # a second address of memory counted elsewhere
            continue
        key = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
        g = groups.setdefault(key, {"count": 0, "bytes": 0, "sample": obj})
        g["count"] += 1
        g["bytes"] += storage.nbytes()
        other += storage.nbytes()
    obj = None
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    rows = []
    for n, ((shape, dtype), g) in enumerate(ranked):
        sample = g.pop("sample")
        # each holder lookup scans every object of the process (seconds in an engine)
        held_by = _holders(sample) if n < holders else []
        rows.append({"shape": list(shape), "dtype": dtype, **g, "held_by": held_by})
    return {
        "weight_storages": len(weights),
        "other_bytes": other,
        "alias_bytes": aliased,
        "top": rows,
    }


def _alias_ranges() -> list[tuple[int, int]]:
    """The address ranges of expert offload's alias ranges (prefill staging of one-table
    layers): second addresses of VRAM that the table and the staging slots own, whose
    tensors the census must not count again."""
    import gc

    return [
        (o.ptr, o.ptr + o.size)
        for o in gc.get_objects()
        if type(o).__name__ == "AliasRange" and getattr(o, "ptr", 0)
    ]


# EO_ALLOC_HISTORY=1: record where each CUDA allocation is made from engine start-up on
ALLOC_HISTORY_ENTRIES = 200_000


def allocation_sites(
    snapshot: dict, exclude: set[int], top: int = 12, package: str = "/vllm/"
) -> dict[str, Any]:
    """Live CUDA allocations that are not in ``exclude`` (the weights' storages), grouped
    by the innermost frame under ``package`` that made them, largest first. From the
    allocator's snapshot (``torch.cuda.memory._snapshot()``) with history recorded since
    before the engine started, it names the code behind memory that no Python object
    holds any more (a CUDA-graph pool, a C++ owner) as well as the rest. A block whose
    stack was not recorded counts under "(no stack recorded)". Sizes are the bytes asked
    for; ``other_block_bytes`` sums the blocks themselves, which torch's allocated bytes
    count."""
    groups: dict[str, dict[str, Any]] = {}
    total = blocks = 0
    for start, block in _live_blocks(snapshot):
        if start in exclude:
            continue
        blocks += block["size"]  # what torch's allocated bytes count
        size = _requested(block)
        site = _site(block.get("frames") or [], package)
        g = groups.setdefault(site, {"count": 0, "bytes": 0, "sizes": set()})
        g["count"] += 1
        g["bytes"] += size
        g["sizes"].add(size)
        total += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    rows = [
        {"site": site, "count": g["count"], "bytes": g["bytes"], "sizes": sorted(g["sizes"])[:4]}
        for site, g in ranked
    ]
    return {"other_bytes": total, "other_block_bytes": blocks, "top": rows}


def _segment_blocks(segment: dict) -> Iterator[tuple[int, dict]]:
    """(start address, block) of every block of a snapshot's segment. Blocks tile their
    segment in order; snapshots that give no block address of its own get it from the
    segment's start and the sizes before it."""
    address = segment.get("address", 0)
    for block in segment.get("blocks", []):
        start = block.get("address", address)
        address = start + block["size"]
        yield start, block


def _live_blocks(snapshot: dict) -> Iterator[tuple[int, dict]]:
    """(start address, block) of every allocated block of an allocator snapshot."""
    for segment in snapshot.get("segments", []):
        for start, block in _segment_blocks(segment):
            if block.get("state") == "active_allocated":
                yield start, block


def _requested(block: dict) -> int:
    """The bytes a block's tensor asked for (the block itself may be larger)."""
    return block.get("requested_size") or block["size"]


_BLOCK_FIELDS = ("blocks", "block_bytes", "requested_bytes")


def weight_blocks(snapshot: dict, weights: set[int], experts: set[int]) -> dict[str, int]:
    """The caching allocator's blocks that hold the model's weights (``weights``: their
    storages' addresses; ``experts``: those of the routed experts), against the bytes
    their tensors asked for. ``torch.cuda.memory_allocated`` counts whole blocks, and the
    allocator hands out a cached free block of its large pool whole when less than 1 MiB
    of it would be left over, so a weight can sit in a block larger than itself: VRAM
    that no census of tensors sees, and that a difference of parameter bytes does not
    explain."""
    out = {f"{kind}_{field}": 0 for kind in ("expert", "other") for field in _BLOCK_FIELDS}
    for start, block in _live_blocks(snapshot):
        if start not in weights:
            continue
        kind = "expert" if start in experts else "other"
        out[f"{kind}_blocks"] += 1
        out[f"{kind}_block_bytes"] += block["size"]
        out[f"{kind}_requested_bytes"] += _requested(block)
    return out


def expert_block_slack(blocks: dict[str, int]) -> int:
    """How many bytes the routed experts' blocks (``weight_blocks``) hold beyond what
    their tensors asked for."""
    return blocks["expert_block_bytes"] - blocks["expert_requested_bytes"]


def stranded_free(
    snapshot: dict, top: int = 8, names: dict[int, str] | None = None, live_top: int = 4
) -> dict[str, Any]:
    """The caching allocator's free bytes that it cannot give back to the driver: those in
    segments that also hold a live block (``torch.cuda.empty_cache`` releases only whole
    free segments), against the bytes of wholly free segments, with the segments that
    strand the most (their size, free bytes, largest live block, pool, and their largest
    live blocks, named where ``names`` maps a block's address to the weight that starts
    there). This is the process's VRAM that torch's allocated bytes do not count; the
    names say which weights keep such a segment alive."""
    names = names or {}
    stranded = whole = 0
    rows = []
    for segment in snapshot.get("segments", []):
        blocks = list(_segment_blocks(segment))
        live = [(start, b) for start, b in blocks if b.get("state") == "active_allocated"]
        free = sum(b["size"] for _, b in blocks if b.get("state") == "inactive")
        if not live:
            whole += free
            continue
        stranded += free
        if free:
            live.sort(key=lambda sb: -sb[1]["size"])
            rows.append(
                {
                    "segment_bytes": segment.get("total_size", sum(b["size"] for _, b in blocks)),
                    "free_bytes": free,
                    "largest_live_bytes": live[0][1]["size"],
                    "pool": str(segment.get("segment_pool_id", "")),
                    "live": [
                        {"bytes": b["size"], "name": names.get(start, "")}
                        for start, b in live[:live_top]
                    ],
                }
            )
    rows.sort(key=lambda r: -r["free_bytes"])
    return {
        "stranded_bytes": stranded,
        "stranded_segments": len(rows),
        "free_segment_bytes": whole,
        "top": rows[:top],
    }


def _weight_names(model) -> dict[int, str]:
    """Storage address to the first name of the parameter or buffer stored there."""
    names: dict[int, str] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_cuda and t.numel():
            names.setdefault(t.untyped_storage().data_ptr(), name)
    return names


def _expert_storages(model) -> set[int]:
    """Storage addresses of the routed experts' parameters in VRAM (a split layer's host
    table and one table's ranges are not the allocator's)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return {
        p.untyped_storage().data_ptr()
        for m in model.modules()
        if isinstance(m, RoutedExperts)
        for p in m.parameters(recurse=False)
        if p.is_cuda and p.numel()
    }


def _allocator_view(model, sites: bool) -> dict[str, Any]:
    """For ``llm.apply_model``: from one allocator snapshot, the weights' blocks and, with
    ``sites`` (EO_ALLOC_HISTORY=1), the allocation sites beside the weights, after which
    history recording stops (it slows every allocation)."""
    import torch

    memory = torch.cuda.memory
    try:
        snapshot = memory._snapshot()
    finally:
        if sites:
            memory._record_memory_history(enabled=None)
    weights = _model_storages(model)
    out: dict[str, Any] = {
        "weight_blocks": weight_blocks(snapshot, weights, _expert_storages(model)),
        "stranded_free": stranded_free(snapshot, names=_weight_names(model)),
    }
    if sites:
        out["alloc_sites"] = allocation_sites(snapshot, weights)
    return out


def _site(frames: list[dict], package: str) -> str:
    """The innermost frame (snapshots list the innermost first) whose file is under
    ``package``, as ``path/from/package.py:line function``; else the innermost frame."""
    if not frames:
        return "(no stack recorded)"
    frame = next((f for f in frames if package in f.get("filename", "")), frames[0])
    filename = frame.get("filename", "?")
    if package in filename:
        filename = package.strip("/") + "/" + filename.rsplit(package, 1)[1]
    return f"{filename}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _holders(t: Any, limit: int = 6) -> list[str]:
    """Who refers to ``t``: ``Type.attribute`` for an object's attribute, else the
    referrer's type name."""
    import gc

    names: set[str] = set()
    dicts = 0
    for r in gc.get_referrers(t):
        if type(r) is dict and dicts < 3:  # each owner lookup scans every object
            dicts += 1
            keys = [k for k, v in r.items() if v is t]
            owners = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
            if owners and keys:
                names.update(f"{type(o).__name__}.{keys[0]}" for o in owners)
                continue
            names.add(f"dict[{keys[0]!r}]" if keys else "dict")
        elif type(r).__name__ not in ("frame", "list", "cell"):
            attrs = [k for k, v in getattr(r, "__dict__", {}).items() if v is t]
            names.add(f"{type(r).__name__}.{attrs[0]}" if attrs else type(r).__name__)
    return sorted(names)[:limit]


def _greedy(llm, task: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=task["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
        prompt_logprobs=0 if task.get("prompt_logprobs", True) else None,
    )
    prompts = [{"prompt_token_ids": p} for p in task["prompts"]]
    conc = task.get("concurrency", 1)
    outs = []
    for i in range(0, len(prompts), conc):
        outs += llm.generate(prompts[i : i + conc], params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        lp = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
        plp = None
        if o.prompt_logprobs is not None:
            plp = [
                None if d is None else d[t].logprob
                for d, t in zip(o.prompt_logprobs, o.prompt_token_ids, strict=True)
            ]
        row = {"token_ids": list(c.token_ids), "logprobs": lp, "prompt_logprobs": plp}
        if task.get("routed_experts") and c.routed_experts is not None:
            row["routed_experts"] = c.routed_experts.astype("int32").tolist()
        results.append(row)
    return {"outputs": results}


def _stream_params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def _timed_batch(engine, rids: list[str], prompts: list[list[int]], params) -> list[list[float]]:
    """Requests added together and decoded by stepping the engine: when each of each
    request's tokens came out (the caller holds the baton)."""
    for rid, prompt in zip(rids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    stamps: dict[str, list[float]] = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = stamps[out.request_id]
            got += [time.perf_counter()] * (len(out.outputs[0].token_ids) - len(got))
    return [stamps[rid] for rid in rids]


def _timed_request(engine, rid: str, prompt: list[int], params) -> tuple[float, list[float]]:
    """One request alone, in a turn of the baton: when it was added and when each of its
    tokens came out."""
    with BATON.turn():
        t0 = time.perf_counter()
        [stamps] = _timed_batch(engine, [rid], [prompt], params)
    return t0, stamps


def _decode_timing(llm, task: dict) -> dict:
    """Per-token timestamps of one stream at a time, by stepping the engine (docs/benchmarks.md:
    TTFT = t1 - t0, TPOT = (tN - t1) / (N - 1), decode speed = (N - 1) / (tN - t1))."""

    engine = llm.llm_engine
    params = _stream_params(task["max_tokens"])
    runs = []
    decoded_all = 0  # tokens after each request's first, warm-up included (swap counters)
    for rep in range(task.get("warmup", 1) + task.get("repeats", 3)):
        for pi, prompt in enumerate(task["prompts"]):
            t0, stamps = _timed_request(engine, f"t{rep}-{pi}", prompt, params)
            decoded_all += max(0, len(stamps) - 1)
            if rep < task.get("warmup", 1):
                continue
            n = len(stamps)
            itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            runs.append(
                {
                    "repeat": rep,
                    "prompt": pi,
                    "tokens": n,
                    "ttft_ms": (stamps[0] - t0) * 1e3,
                    "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]),
                    "tpot_ms": (stamps[-1] - stamps[0]) / (n - 1) * 1e3,
                    "itl_ms": [x * 1e3 for x in itl],
                }
            )
    itl_all = sorted(x for r in runs for x in r["itl_ms"])

    def pct(p: float) -> float:
        return itl_all[min(len(itl_all) - 1, int(p * len(itl_all)))]

    per_repeat = {}
    for r in runs:
        per_repeat.setdefault(r["repeat"], []).append(r)
    decode_by_repeat = [
        sum(x["tokens"] - 1 for x in rs) / sum((x["tokens"] - 1) / x["decode_tok_s"] for x in rs)
        for _, rs in sorted(per_repeat.items())
    ]
    return {
        "runs": [{k: v for k, v in r.items() if k != "itl_ms"} for r in runs],
        "decode_tok_s": decode_by_repeat,
        "tpot_ms_p50": pct(0.5),
        "tpot_ms_p90": pct(0.9),
        "tpot_ms_p99": pct(0.99),
        "itl_samples": len(itl_all),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "decoded_all": decoded_all,
    }


def _streams(llm, task: dict) -> dict:
    """N concurrent streams for each N of task["streams"]: N requests of distinct prompts
    (task["prompts"], taken in turn) added at once and decoded together, warm-up then
    repeats. Per N: total decode tokens per second of each repeat (every request's tokens
    after its first, over the time from the first first token to the last token), the
    inter-token times' p50/p90 over all requests, and the runtime swap's host reads and swaps
    over the measured repeats (offload-03)."""
    engine = llm.llm_engine
    params = _stream_params(task["max_tokens"])
    prompts, warmup = task["prompts"], task.get("warmup", 1)
    out, used = [], 0
    for n in task["streams"]:
        tok_s, itl, reads, swaps, decoded, counted = [], [], 0, 0, 0, False
        steps, prefetch = 0, None
        for rep in range(warmup + task.get("repeats", 3)):
            batch = [prompts[(used + i) % len(prompts)] for i in range(n)]
            used += n
            with BATON.turn():
                before = merge_swap_counters(llm.apply_model(_swap_counters))
                pf_before = merge_prefetch_counters(llm.apply_model(_prefetch_counters))
                rids = [f"s{n}-{rep}-{i}" for i in range(n)]
                stamps = _timed_batch(engine, rids, batch, params)
                after = merge_swap_counters(llm.apply_model(_swap_counters))
                pf_after = merge_prefetch_counters(llm.apply_model(_prefetch_counters))
            if rep < warmup:
                continue
            if pf_after is not None:
                prefetch = prefetch or dict.fromkeys(pf_after, 0)
                for k, v in counter_delta(pf_after, pf_before).items():
                    prefetch[k] += v
            tokens = sum(len(s) - 1 for s in stamps)
            tok_s.append(tokens / (max(s[-1] for s in stamps) - min(s[0] for s in stamps)))
            itl += [(b - a) * 1e3 for s in stamps for a, b in zip(s, s[1:], strict=False)]
            decoded += tokens
            if after is not None:
                counted = True
                reads += sum(after["host_reads"]) - (sum(before["host_reads"]) if before else 0)
                swaps += sum(after["swaps"]) - (sum(before["swaps"]) if before else 0)
                steps += after["decode_steps"] - (before["decode_steps"] if before else 0)
        itl.sort()
        row = {
            "streams": n,
            "total_decode_tok_s": tok_s,
            "tpot_ms_p50": itl[len(itl) // 2],
            "tpot_ms_p90": itl[min(len(itl) - 1, int(0.9 * len(itl)))],
            "decoded": decoded,
        }
        if counted:  # the runtime swap's own counters over the measured repeats
            row["host_reads_per_token"] = reads / decoded
            row["swaps_per_token"] = swaps / decoded
        if prefetch is not None:
            row["prefetch"] = prefetch_summary(prefetch, decoded, steps if counted else 0)
        out.append(row)
    return {"by_streams": out}


def prefetch_summary(delta: dict[str, int], decoded: int, steps: int) -> dict[str, Any]:
    """Decode prefetch's counters over a measurement, with the shares a reader wants: the
    host picks whose row the guess had copied, and the bytes copied per token and per
    decode step (None without a count to divide by)."""
    picks = delta.get("host_picks", 0)
    return {
        **delta,
        "hit_share": delta.get("hit_picks", 0) / picks if picks else None,
        "bytes_copied_per_token": delta.get("bytes_copied", 0) / decoded if decoded else None,
        "bytes_copied_per_step": delta.get("bytes_copied", 0) / steps if steps else None,
    }


def _ttft(llm, task: dict) -> dict:
    from vllm import SamplingParams

    # the first token and its logprob (the sampled token is always among the returned ones,
    # as the greedy task reads them): what the prefill computed, compared across engines
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, logprobs=1)
    times, first = [], []
    for rep in range(1 + task.get("repeats", 3)):
        # a different first token each time defeats prefix caching
        prompt = [task["prompt"][(rep + 1) % len(task["prompt"])]] + task["prompt"][1:]
        t0 = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
        seq = out.outputs[0]
        token = seq.token_ids[0]
        first.append({"token_id": token, "logprob": seq.logprobs[0][token].logprob})
    return {"ttft_ms": times, "prompt_tokens": len(task["prompt"]), "first_tokens": first}


def _set_swap(overrides: dict[str, Any] | None):
    """A function for `llm.apply_model` that sets the runtime swap's settings to its
    start-up settings with `overrides` (None: the start-up settings), and returns whether
    there is a runtime swap. The decision schedule is read on the host at every step, so
    this takes effect at the next step; what the CUDA graphs count does not change."""

    def apply(model) -> bool:
        import dataclasses

        from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime

        runtime = swap_runtime.get_runtime()
        if runtime is None:
            return False
        base = getattr(runtime, "_probe_base_settings", None) or runtime.settings
        runtime._probe_base_settings = base
        runtime.settings = dataclasses.replace(base, **(overrides or {}))
        return True

    return apply


def _decode_ab(llm, task: dict) -> dict:
    """Two settings of the runtime swap in one engine, request by request: for every prompt
    and repeat, one request under each variant, the order alternating, so that a change of
    the host's speed over the run (seen on H200 hosts: 20% steps) hits both alike. Reports
    every request's TPOT and the per-pair ratio (second variant over first)."""

    engine = llm.llm_engine
    params = _stream_params(task["max_tokens"])
    variants: dict[str, dict[str, Any]] = task["variants"]  # name -> SwapSettings fields
    names = list(variants)
    if len(names) != 2:
        raise ValueError(f"decode_ab needs two variants, not {names}")
    tpot: dict[str, list[float]] = {n: [] for n in names}
    ratios = []
    for rep in range(task.get("warmup", 1) + task.get("repeats", 3)):
        for pi, prompt in enumerate(task["prompts"]):
            order = names if (rep + pi) % 2 == 0 else names[::-1]
            pair = {}
            for name in order:
                if not llm.apply_model(_set_swap(variants[name]))[0]:
                    raise RuntimeError("decode_ab: this engine runs no runtime swap")
                _, stamps = _timed_request(engine, f"ab{rep}-{pi}-{name}", prompt, params)
                pair[name] = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
            if rep < task.get("warmup", 1):
                continue
            for name in names:
                tpot[name].append(pair[name])
            ratios.append(pair[names[1]] / pair[names[0]])
    llm.apply_model(_set_swap(None))
    return {
        "variants": variants,
        "tpot_ms": tpot,
        "tpot_ms_p50": {n: statistics.median(v) for n, v in tpot.items()},
        "ratio": f"{names[1]} / {names[0]}",
        "pair_ratios": ratios,
        "pair_ratio_p50": statistics.median(ratios),
        "pair_ratio_range": [min(ratios), max(ratios)],
    }


def kernel_summary(intervals: list[tuple[str, float, float]], tokens: int) -> dict:
    """GPU time per decoded token from kernel intervals (name, start us, end us): busy time
    as the union of the intervals (kernels of two streams that overlap count once), and per
    kernel name its launches and time, largest first."""
    if tokens <= 0:
        raise ValueError(f"no decoded tokens to divide by ({tokens})")
    busy, end = 0.0, float("-inf")
    per_name: dict[str, list[float]] = {}
    for name, t0, t1 in sorted(intervals, key=lambda x: x[1]):
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
        acc = per_name.setdefault(name[:160], [0, 0.0])  # long template names, cut once
        acc[0] += 1
        acc[1] += t1 - t0
    kernels = [
        {"name": n, "launches_per_token": c / tokens, "us_per_token": t / tokens}
        for n, (c, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])
    ]
    return {"gpu_busy_us_per_token": busy / tokens, "kernels": kernels}


def _decode_profile(llm, task: dict) -> dict:
    """Where a decode step's time goes. Per prompt, one request whose decode (after its first
    token) runs under the torch profiler, CUDA activity only, alone on the GPU (this task
    holds the baton of a paired run throughout). Reports per decoded token the wall time,
    the GPU's busy time and each kernel's time; busy time well under the wall time means the
    host sets the pace, not the GPU. The profiler adds host time of its own: compare wall
    times only between engines profiled alike. An exception (a profiler that fails, or one
    that records no GPU activity for a request) is reported in the result and the request
    aborted, so the engine's other results are kept; a crash of the process is not caught."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    params = _stream_params(task["max_tokens"])
    intervals: list[tuple[str, float, float]] = []
    wall_s, tokens = 0.0, 0
    rid = None
    try:
        for pi, prompt in enumerate([task["prompts"][0], *task["prompts"]]):  # 1st: warm-up
            rid = f"prof-{pi}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            first = 0
            while first == 0 and engine.has_unfinished_requests():
                for out in engine.step():
                    first = len(out.outputs[0].token_ids)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0, last = time.perf_counter(), first
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        last = len(out.outputs[0].token_ids)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
            rid = None
            if pi == 0:
                continue
            kernels = [
                (e.name, e.time_range.start, e.time_range.end)
                for e in prof.events()
                if e.device_type == DeviceType.CUDA
            ]
            if not kernels:
                raise RuntimeError(
                    f"the profiler recorded no GPU activity for request {pi} (CUPTI unavailable?)"
                )
            # each profile has a clock of its own: lay them end to end
            shift = (max(x[2] for x in intervals) + 1 if intervals else 0) - min(
                x[1] for x in kernels
            )
            intervals += [(n, a + shift, b + shift) for n, a, b in kernels]
            wall_s += t1 - t0
            tokens += last - first
        out = kernel_summary(intervals, tokens)
    except Exception as e:  # noqa: BLE001 - reported in the result, see the docstring
        if rid is not None:
            with contextlib.suppress(Exception):
                engine.abort_request([rid])
        return {"error": f"{type(e).__name__}: {e}"}
    wall_us = wall_s / tokens * 1e6
    return {
        "tokens": tokens,
        "wall_us_per_token": wall_us,
        **out,
        "gpu_idle_fraction": max(0.0, 1 - out["gpu_busy_us_per_token"] / wall_us),
    }


TASKS = {
    "greedy": _greedy,
    "decode_timing": _decode_timing,
    "ttft": _ttft,
    "decode_ab": _decode_ab,
    "decode_profile": _decode_profile,
    "streams": _streams,
}


def machine() -> dict[str, Any]:
    """What makes one GPU host decode faster than another of the same GPU: the CPU (decode
    of small models is host-bound), the driver, the PCIe link and the clocks."""
    from .nvsmi import query

    out: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        out["cpu"] = names[0] if names else None
    except OSError:
        out["cpu"] = None
    fields = (
        "name,driver_version,pcie.link.gen.current,pcie.link.width.current,"
        "clocks.sm,clocks.max.sm,clocks.mem"
    )
    rows = query(f"--query-gpu={fields}")
    out["gpu"] = dict(zip(fields.split(","), rows[0], strict=False)) if rows else None
    return out


def parse_cpulist(text: str) -> set[int]:
    """A sysfs CPU list ("0-7,16-23") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(sysfs: str = "/sys/bus/pci/devices") -> set[int] | None:
    """The CPUs of the first visible GPU's NUMA node (its PCI device's local_cpulist);
    None where the driver or sysfs cannot say."""
    from .nvsmi import query

    rows = query("--query-gpu=pci.bus_id")
    if not rows:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = int(visible) if visible.isdigit() and int(visible) < len(rows) else 0
    bus = rows[index][0].lower()
    bus = bus[-12:] if len(bus) > 12 else bus  # 00000000:18:00.0 -> 0000:18:00.0
    try:
        with open(f"{sysfs}/{bus}/local_cpulist") as f:
            return parse_cpulist(f.read()) or None
    except (OSError, ValueError):
        return None


def pin_to_gpu_node() -> dict[str, Any]:
    """Run this engine on the CPUs of its GPU's NUMA node, before CUDA or vLLM start, so
    that every engine of a group has its threads and first-touched memory (pinned
    buffers included) on the same node. Engines that share a GPU and take turns otherwise
    differ by where the scheduler first put them: in one run three unpatched engines of one
    configuration decoded at 457, 594 and 594 tok/s. EO_PIN_CPUS=0 leaves it."""
    before = sorted(os.sched_getaffinity(0))
    local = gpu_local_cpus()
    out: dict[str, Any] = {"cpus_before": before, "gpu_local_cpus": sorted(local or [])}
    usable = (local or set()) & set(before)
    if os.environ.get("EO_PIN_CPUS", "1") != "0" and usable and usable != set(before):
        try:
            os.sched_setaffinity(0, usable)
        except OSError as e:  # a cpuset that forbids it: run where we are, and say so
            out["error"] = str(e)
    out["cpus"] = sorted(os.sched_getaffinity(0))
    return out


def run(config: dict) -> dict:
    global BATON
    BATON = Baton(os.environ.get("EO_BATON"))
    os.environ.update({k: str(v) for k, v in config.get("env", {}).items()})
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if config.get("engine", {}).get("pipeline_parallel_size", 1) > 1:
        # the workers run in their own processes: apply_model's functions travel pickled
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    affinity = pin_to_gpu_node()
    import torch
    from vllm import LLM

    alloc_history = os.environ.get("EO_ALLOC_HISTORY") == "1"
    if alloc_history:  # before any CUDA allocation, so every block has its stack
        torch.cuda.memory._record_memory_history(max_entries=ALLOC_HISTORY_ENTRIES, stacks="python")

    result: dict[str, Any] = {"config": config.get("name"), "tasks": {}}
    t0 = time.perf_counter()
    llm = LLM(model=config["model"], **config.get("engine", {}))
    result["startup_s"] = time.perf_counter() - t0
    result["machine"] = {**machine(), "affinity": affinity}
    placement = merge_placements(llm.apply_model(_expert_placement))
    free, total = torch.cuda.mem_get_info()
    result["memory"] = {
        **placement,
        "torch_allocated_bytes": torch.cuda.memory_allocated(),
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "device_used_bytes": total - free,
        "process_vram_bytes": process_vram_bytes(),
        "host_peak_rss_bytes_after_load": _vm_hwm_bytes(),
    }
    # what torch holds beside the weights (KV cache, graph pools, stray copies)
    result["memory"]["census"] = llm.apply_model(tensor_census)[0]
    view = functools.partial(_allocator_view, sites=alloc_history)
    result["memory"].update(llm.apply_model(view)[0])
    BATON.ready()
    for task in config.get("tasks", []):
        t = time.perf_counter()
        before = merge_swap_counters(llm.apply_model(_swap_counters))
        pf_before = merge_prefetch_counters(llm.apply_model(_prefetch_counters))
        whole = contextlib.nullcontext() if task["kind"] in _PER_REQUEST else BATON.turn()
        with whole:
            result["tasks"][task["name"]] = TASKS[task["kind"]](llm, task)
        result["tasks"][task["name"]]["wall_s"] = time.perf_counter() - t
        after = merge_swap_counters(llm.apply_model(_swap_counters))
        if after is not None:  # the runtime swap's counters over this task (offload-03)
            result["tasks"][task["name"]]["swap_delta"] = {
                k: sum(after[k]) - (sum(before[k]) if before else 0)
                for k in ("host_reads", "swaps")
            }
        pf_after = merge_prefetch_counters(llm.apply_model(_prefetch_counters))
        if pf_after is not None:  # decode prefetch's counters over this task
            result["tasks"][task["name"]]["prefetch_delta"] = counter_delta(pf_after, pf_before)
    result["memory"]["host_peak_rss_bytes"] = _vm_hwm_bytes()
    result["swap"] = merge_swap_counters(llm.apply_model(_swap_counters))
    if BATON.active:
        result["baton_waited_s"] = BATON.waited_s
    BATON.hold_to_exit()
    return result


def merge_placements(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's expert placement from its workers' (one per pipeline rank, in rank
    order, each holding its stage's layers): counts and bytes add up, per-layer lists join
    in rank order, layer-keyed maps merge, kernel and method names unite. One worker's is
    returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if key in ("moe_methods", "moe_kernels"):
            out[key] = sorted(set().union(*values))
        elif isinstance(first, bool) or first is None:
            out[key] = first
        elif isinstance(first, int | float):
            out[key] = sum(values)
        elif isinstance(first, list):
            out[key] = [x for v in values for x in v]
        elif isinstance(first, dict):
            out[key] = {k: x for v in values for k, x in v.items()}
        else:
            out[key] = first
    out["per_rank"] = parts
    return out


def merge_swap_counters(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The runtime swap's counters of every pipeline rank as one engine's: per-layer lists
    joined in rank order; the step and decision counts, which every rank shares, from the
    first rank. None where no rank runs the swap."""
    live = [p for p in parts if p is not None]
    if len(parts) == 1 or not live:
        return parts[0] if parts else None
    out = dict(live[0])
    for key in ("layers", "host_reads", "swaps"):
        out[key] = [x for p in live for x in p[key]]
    return out


def merge_prefetch_counters(parts: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Decode prefetch's counters of every pipeline rank summed; None where no rank runs it."""
    live = [p for p in parts if p is not None]
    if not live:
        return None
    return {k: sum(p.get(k, 0) for p in live) for k in live[0]}


def counter_delta(after: dict[str, int], before: dict[str, int] | None) -> dict[str, int]:
    """Counters' growth from ``before`` (None: from zero) to ``after``."""
    return {k: v - (before or {}).get(k, 0) for k, v in after.items()}


def _prefetch_counters(model) -> dict[str, int] | None:
    """Decode prefetch's counters since start (VLLM_EXPERT_DECODE_PREFETCH=1; waits for the
    GPU), None where it is off or the series lacks it."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_offload import decode_prefetch
    except ImportError:  # unpatched vLLM, or a series without decode prefetch
        return None
    prefetch = decode_prefetch.get_prefetch()
    return None if prefetch is None else prefetch.counters()


def _swap_counters(model) -> dict[str, Any] | None:
    """The runtime swap's counters since start (offload-03), None where it is not running."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime
    except ImportError:  # unpatched vLLM
        return None
    runtime = swap_runtime.get_runtime()
    if runtime is None or runtime.state is None:
        return None
    return {
        **runtime.counters(),
        "decisions": runtime.decisions,
        "decode_steps": runtime.decode_steps,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        config = json.load(f)
    result = run(config)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
