# SPDX-License-Identifier: Apache-2.0
"""Start-up preflight of the expert-offload image (scripts/preflight; the image's entrypoint
runs it before `vllm serve`).

A failed start of vLLM with offload costs minutes (weights load before the host budget is
known to be short) and its error is deep in a worker's log. The preflight checks, in seconds
and before anything is loaded, what a container most often gets wrong, and for each problem
says what to change:

- vllm:          the installed vLLM is vllm.pin's release and the series is applied to it;
- cold-file:     the cold file exists, is well formed and fits the model's config.json
                 (layers, experts, architecture, the budget it was made for);
- host-memory:   the host experts (and, with VLLM_PLE_TABLE=host, Qwen4Exp's n-gram tables)
                 fit in MemAvailable and the container's memory limit;
- gpus:          enough GPUs for PP x TP, each as large as the topology's cards;
- host-mapping:  the driver page-locks host memory for the GPU (cudaHostRegister) and, for
                 offload-03, maps host NUMA memory into a VA range (cuMemCreate).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import cuda_probe, serve_args, settings
from .coldcheck import (
    ColdFileError,
    ContractError,
    check_fits_model,
    check_host_layers,
    human_bytes,
    load_cold_file,
    name_mismatch,
    over_budget,
    parse_layer_list,
    pipeline_size_mismatch,
    plan_host_experts,
    read_model_config,
)
from .hostmem import cgroup_memory, mem_available
from .pin import PIN, ROOT
from .ple_table import choose_placement, ple_tables, table_file_problems
from .selection import GiB, SelectionError
from .topologies import TOPOLOGIES, Topology, get_topology

RESOLVED_ENV = "VLLM_PLE_TABLE_RESOLVED"  # vLLM's variable for VLLM_PLE_TABLE=auto's decision

# What vLLM's own processes take besides the host experts (API server, one worker per GPU:
# CUDA context, torch, pinned staging buffers): an estimate, used for a warning only.
RESERVE_GIB_BASE = 2.0
RESERVE_GIB_PER_GPU = 3.0

# Exit codes: the code of the first check that failed, in the order the checks run.
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_CODES = {"vllm": 7, "cold-file": 6, "host-memory": 4, "gpus": 3, "host-mapping": 5}
CHECKS = tuple(EXIT_CODES)


def make_cold_set(model: str | None, pp: int) -> str:
    """How to make a cold file for a real model: count its router picks on a running server
    (count-experts' default source, `synthetic`, reads only make-test-model checkpoints), then
    select; or let a budget-only start count while serving."""
    m = model or "/models/MODEL"
    return (
        "make one for this model (docs/cold-sets.md): serve it once with "
        "VLLM_EXPERT_COUNT_FILE=/state/counts.json and --no-enable-prefix-caching, send it your "
        "kind of prompts through scripts/count-experts --source server --url "
        "http://localhost:8000 --counts-file STATE_DIR/counts.json --data chat=chat.jsonl "
        f"--out-dir counts/, then scripts/select-cold-set select --model {m} --counts "
        f"counts/*.json --budget-gib 3 --pp-size {pp} --out COLD_DIR/3GiB-per-card.json; or "
        "leave COLD_FILE unset with EO_HOST_BUDGET_GIB set (compose: HOST_BUDGET_GIB) for a "
        "budget-only start, which counts while serving and uses the counts at the next start"
    )


def missing_cold_file_fix(path: pathlib.Path) -> str:
    """A missing cold file is most often a typo or a host path: the file is read at its path
    inside the container, where COLD_DIR is mounted at /cold."""
    here = sorted(p.name for p in path.parent.glob("*.json")) if path.parent.is_dir() else []
    fix = (
        f"{path} is read inside the container: put the file in the host folder mounted at "
        "/cold (compose: COLD_DIR, default ../cold) and set COLD_FILE=/cold/<its name>"
    )
    if here:
        fix += f"; {path.parent} has: {', '.join(here[:8])}" + (" ..." if len(here) > 8 else "")
    elif not str(path).startswith(("/cold/", "/models/", "/state/")):
        fix += f" ({path} looks like a path on the host, not in the container)"
    return fix + "; or unset VLLM_EXPERT_COLD_FILE (COLD_FILE) to start without a cold file"


@dataclass(frozen=True)
class Result:
    check: str
    status: str  # "ok", "warn", "fail" or "skip"
    message: str
    fix: str = ""


@dataclass
class Setup:
    """What the checks look at; every path can be pointed elsewhere (tests, other hosts)."""

    model: str | None = None
    pp: int = 1
    tp: int = 1
    topology: Topology | None = None
    cold_file: str | None = None
    host_layers: str = ""
    pp_partition: str = ""
    ple_table: str = "gpu"  # VLLM_PLE_TABLE: gpu, host (page-locked), file, auto
    one_table: bool = False  # VLLM_EXPERT_ONE_TABLE=1: offload-03 with the runtime swap
    prefill_staging: bool = False  # VLLM_EXPERT_PREFILL_STAGING=1
    vmm_fail_at: set[str] = field(default_factory=set)  # VLLM_EXPERT_VMM_FAIL_AT (tests)
    meminfo: pathlib.Path = pathlib.Path("/proc/meminfo")
    cgroup_root: pathlib.Path = pathlib.Path("/sys/fs/cgroup")
    site: pathlib.Path | None = None  # where the vllm package is installed; None: find it
    apply_patches: pathlib.Path = ROOT / "scripts" / "apply-patches.sh"
    reserve_gib: float | None = None
    # what the checks decided that vLLM is to be told: VLLM_PLE_TABLE=auto's placement
    # as VLLM_PLE_TABLE_RESOLVED (the start program puts these in vLLM's environment)
    exports: dict[str, str] = field(default_factory=dict)
    query_gpus: Callable[[], tuple[list[cuda_probe.Gpu], str]] = cuda_probe.query_gpus
    probes: Callable[[], list[cuda_probe.Probe]] = field(
        default=lambda: [cuda_probe.probe_host_register(), cuda_probe.probe_vmm_host_numa()]
    )

    @property
    def gpus_needed(self) -> int:
        return self.pp * self.tp

    @property
    def offload_configured(self) -> bool:
        return bool(self.cold_file or self.host_layers.strip())


# --- vLLM serve arguments -------------------------------------------------------------------


def parse_serve_args(args: Sequence[str]) -> tuple[str | None, int, int]:
    """The model, pipeline and tensor parallel sizes of a `vllm serve` command line
    (eotools/serve_args.py; ServeArgsError, a ValueError, where a size cannot be read)."""
    serve = serve_args.parse(args)
    return serve.model, serve.pp, serve.tp


# --- vllm: the pinned release with the series applied -----------------------------------------


def find_vllm_site() -> pathlib.Path | None:
    """The directory holding the importable vllm package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    return pathlib.Path(spec.origin).resolve().parents[1]


def installed_vllm_version(site: pathlib.Path) -> str | None:
    try:
        text = (site / "vllm" / "_version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def check_vllm(setup: Setup) -> list[Result]:
    site = setup.site or find_vllm_site()
    if site is None:
        return [
            Result(
                "vllm",
                "fail",
                "no vllm package can be imported by this Python",
                f"install vLLM {PIN.vllm_version} (vllm.pin) or use the image "
                "built from this repository's Dockerfile",
            )
        ]
    version = installed_vllm_version(site)
    if (version or "").split("+")[0] != PIN.vllm_version:
        return [
            Result(
                "vllm",
                "fail",
                f"vLLM in {site} is {version or 'of unknown version'}, the series is for "
                f"vLLM {PIN.vllm_version} (vllm.pin)",
                f"build the image FROM {PIN.vllm_image} (the Dockerfile's default), or "
                f"install vLLM {PIN.vllm_version}",
            )
        ]
    r = subprocess.run(
        ["bash", str(setup.apply_patches), "--check", str(site)], capture_output=True, text=True
    )
    said = (r.stdout + r.stderr).strip().replace("\n", " ")
    if r.returncode == 0 and "already patched" in r.stdout:
        return [Result("vllm", "ok", f"vLLM {version} in {site}, series applied")]
    if r.returncode == 0 and "nothing to apply" in r.stdout:
        return [Result("vllm", "ok", f"vLLM {version} in {site}; the series is empty")]
    if r.returncode == 0:
        problem = f"the patch series is not applied to vLLM {version} in {site}"
        fix = f"apply it: {setup.apply_patches} {site} (the image's build does this)"
    elif r.returncode == 4:
        problem = f"vLLM in {site} is partly patched ({said})"
        fix = f"reinstall vLLM {PIN.vllm_version}, then apply the series with apply-patches.sh"
    elif r.returncode == 1:
        problem = f"the series neither applies to nor is applied in {site} ({said})"
        fix = (
            "the installed vLLM was changed by something else: reinstall vLLM "
            f"{PIN.vllm_version} and apply the series, or rebuild the image"
        )
    else:
        problem = f"apply-patches.sh --check exited {r.returncode}: {said}"
        fix = "see the message above (GNU patch and bash must be installed)"
    return [Result("vllm", "fail", problem, fix)]


# --- cold-file: the cold file against the model ---------------------------------------------


def check_cold_file(setup: Setup) -> tuple[list[Result], dict[str, Any] | None]:
    """Results, and the parsed cold file for the host-memory check."""
    try:
        model = read_model_config(setup.model)
        host_layers = parse_layer_list(setup.host_layers)
        if model is not None:
            check_host_layers(host_layers, model)
    except (ColdFileError, ContractError) as e:
        problem, fix = (str(e), e.fix) if isinstance(e, ColdFileError) else (e.problem, e.fix)
        return [Result("cold-file", "fail", problem, fix)], None
    if not setup.cold_file:
        what = "no cold file (VLLM_EXPERT_COLD_FILE unset)"
        return [Result("cold-file", "skip", what)], None
    path = pathlib.Path(setup.cold_file)
    where = f"VLLM_EXPERT_COLD_FILE={path}"
    try:
        cold = load_cold_file(path)
    except ColdFileError as e:
        # missing: where the file is read from; broken: what to change in it, or a new one
        if not path.exists():
            fix = missing_cold_file_fix(path)
        else:
            fix = f"{e.fix}; or {make_cold_set(setup.model, setup.pp)}"
        return [Result("cold-file", "fail", f"{where}: {e}", fix)], None
    if model is None:
        return [
            Result(
                "cold-file",
                "warn",
                f"{where} is well formed, but the model {setup.model!r} is not a local "
                "directory with a config.json, so it is checked against the model only by "
                "vLLM at start-up",
            )
        ], cold
    remake = make_cold_set(setup.model, setup.pp)
    try:
        check_fits_model(cold, model, host_layers)
    except ColdFileError as e:
        return [Result("cold-file", "fail", f"{where}: {e}", f"{e.fix}; {remake}")], cold
    # the budget a cold file states is for its own experts, not VLLM_EXPERT_HOST_LAYERS'
    # whole layers (the series' budget check counts the same)
    try:
        own = plan_host_experts(cold, model, setup.pp, "", setup.pp_partition)
    except SelectionError as e:
        return [Result("cold-file", "fail", str(e), "fix --pipeline-parallel-size")], cold
    over = over_budget(cold, own, setup.pp)
    if over is not None:
        return [Result("cold-file", "fail", f"{where}: {over}", f"{over.fix}; {remake}")], cold
    n = sum(len(v) for v in cold["layers"].values())
    fits = (
        f"{path.name}: {n} host experts in {len(cold['layers'])} layers, fits "
        f"{model.path.name} ({model.num_layers} layers x {model.num_experts} experts)"
    )
    other_pp = pipeline_size_mismatch(cold, setup.pp)
    if other_pp:
        # accepted, as vLLM accepts it, with one line (its budget cannot be mapped to ranks)
        return [
            Result(
                "cold-file",
                "warn",
                f"{where}: {other_pp} ({fits})",
                make_cold_set(setup.model, setup.pp),
            )
        ], cold
    other_name = name_mismatch(cold, model)
    if other_name:
        # vLLM warns and uses it (cold/README.md): folders get renamed between machines
        return [
            Result(
                "cold-file",
                "warn",
                f"{where}: {other_name}; its shape fits, so vLLM uses it ({fits})",
                "check that it was counted on this checkpoint; if not, "
                + make_cold_set(setup.model, setup.pp),
            )
        ], cold
    return [Result("cold-file", "ok", fits)], cold


# --- host-memory: host experts against MemAvailable and the cgroup limit ----------------------


def ple_host_need(setup: Setup) -> tuple[int, str] | Result | None:
    """Bytes of the PLE n-gram tables VLLM_PLE_TABLE=host puts in page-locked host memory
    (every PLE layer's table, whichever pipeline rank builds it: the ranks share the host),
    with what to print; None when the tables stay in VRAM or the model has none."""
    if setup.ple_table != "host" or not setup.model:
        return None
    cfg_file = pathlib.Path(setup.model) / "config.json"
    if not cfg_file.is_file():
        return Result(
            "host-memory",
            "warn",
            "VLLM_PLE_TABLE=host: the n-gram tables' size is unknown (no local config.json); "
            "vLLM checks the host memory itself at start-up",
        )
    try:
        tables = ple_tables(json.loads(cfg_file.read_text()))
    except (ValueError, KeyError) as e:
        return Result("host-memory", "fail", f"VLLM_PLE_TABLE=host: {e}", "fix config.json")
    if not tables:
        return None
    need = sum(t.nbytes for t in tables)
    t = tables[0]
    return need, (
        f"PLE n-gram tables need {need / GiB:.2f} GiB ({len(tables)} x {t.rows} rows x "
        f"{t.width} x {t.element_bytes} B, VLLM_PLE_TABLE=host)"
    )


def expert_host_need(setup: Setup, cold: dict[str, Any] | None) -> tuple[int, str] | Result:
    """Bytes of the host experts and what to print, or the result that ends the check."""
    if setup.cold_file and cold is None:
        return Result("host-memory", "skip", "no usable cold file (see cold-file)")
    try:
        model = read_model_config(setup.model)
        plan = plan_host_experts(cold, model, setup.pp, setup.host_layers, setup.pp_partition)
    except (ValueError, SelectionError) as e:
        return Result("host-memory", "fail", str(e), "fix the layer list or the PP size")
    if plan.total_bytes is None:
        return Result(
            "host-memory",
            "skip",
            "the bytes of one expert are unknown (no local checkpoint, no budget in the "
            "cold file); vLLM checks the host budget itself at start-up",
        )
    return plan.total_bytes, (
        f"host experts need {human_bytes(plan.total_bytes)} ({sum(plan.experts_per_rank)} "
        f"experts x {plan.bytes_per_expert} bytes, per rank {plan.experts_per_rank})"
    )


def _host_room(setup: Setup) -> tuple[int, str] | None:
    """The smaller of MemAvailable and the container's room, and where it comes from."""
    avail = mem_available(setup.meminfo)
    cg = cgroup_memory(setup.cgroup_root)
    rooms = []
    if avail is not None:
        rooms.append((avail, f"MemAvailable ({setup.meminfo})"))
    if cg is not None:
        rooms.append(
            (
                cg.room,
                f"the container's memory limit {cg.limit / GiB:.1f} GiB less "
                f"{cg.usage / GiB:.1f} GiB in use ({cg.source})",
            )
        )
    return min(rooms) if rooms else None


def resolve_ple_table(setup: Setup, cold: dict[str, Any] | None) -> tuple[str, list[Result]]:
    """VLLM_PLE_TABLE=auto decided as vLLM decides it (ple_table.choose_placement), and for
    file (or auto choosing file) the tables' bytes checked in the checkpoint's files: where
    the tables will live, and what to print."""
    if setup.ple_table not in ("file", "auto") or not setup.model:
        return setup.ple_table, []
    model_dir = pathlib.Path(setup.model)
    cfg_file = model_dir / "config.json"
    label = f"VLLM_PLE_TABLE={setup.ple_table}"
    if not cfg_file.is_file():
        return "file", [
            Result(
                "host-memory",
                "warn",
                f"{label}: no local config.json, so the n-gram tables are not checked here; "
                "vLLM checks them at start-up",
            )
        ]
    try:
        cfg = json.loads(cfg_file.read_text())
        tables = ple_tables(cfg)
    except (ValueError, KeyError) as e:
        return "file", [Result("host-memory", "fail", f"{label}: {e}", "fix config.json")]
    if not tables:
        return "gpu", []
    nbytes = sum(t.nbytes for t in tables)
    out: list[Result] = []
    if setup.ple_table == "auto":
        experts = expert_host_need(setup, cold) if setup.offload_configured else None
        expert_bytes = experts[0] if isinstance(experts, tuple) else 0
        reserve_gib = setup.reserve_gib
        if reserve_gib is None:
            reserve_gib = RESERVE_GIB_BASE + RESERVE_GIB_PER_GPU * setup.gpus_needed
        room = _host_room(setup)
        placement, need = choose_placement(
            room[0] if room else 0, nbytes, expert_bytes, int(reserve_gib * GiB)
        )
        figures = (
            f"n-gram tables {nbytes / GiB:.2f} GiB + host experts {expert_bytes / GiB:.2f} "
            f"GiB + reserve {reserve_gib:.2f} GiB, +10% = {need / GiB:.2f} GiB"
        )
        free = f"{room[0] / GiB:.2f} GiB free ({room[1]})" if room else "free memory unknown"
        # vLLM honours this decision (qwen4_exp/common/ple_file.py resolve_placement)
        # instead of deciding again with its own view of the figures
        setup.exports[RESOLVED_ENV] = placement
        if placement == "host":
            out.append(
                Result("host-memory", "ok", f"{label}: page-locks the tables: {figures}; {free}")
            )
            return "host", out
        out.append(
            Result(
                "host-memory",
                "ok",
                f"{label}: reads the tables from the checkpoint file: {figures} exceeds {free}",
            )
        )
    problems = table_file_problems(model_dir, cfg)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        out.append(Result("host-memory", "fail", problems[0][0] + more, problems[0][1]))
    else:
        out.append(
            Result(
                "host-memory",
                "ok",
                f"PLE n-gram tables ({len(tables)} x {nbytes / len(tables) / GiB:.2f} GiB) read "
                "from the checkpoint's safetensors files through the page cache: nothing "
                "page-locked",
            )
        )
    return "file", out


def check_host_memory(setup: Setup, cold: dict[str, Any] | None) -> list[Result]:
    placement, ple_results = resolve_ple_table(setup, cold)
    if any(r.status == "fail" for r in ple_results):
        return ple_results
    return ple_results + _check_host_memory(replace(setup, ple_table=placement), cold)


def _check_host_memory(setup: Setup, cold: dict[str, Any] | None) -> list[Result]:
    ple = ple_host_need(setup)
    if not setup.offload_configured and not isinstance(ple, tuple):
        return (
            [ple] if ple is not None else [Result("host-memory", "skip", "no offload configured")]
        )
    out: list[Result] = []
    parts: list[tuple[int, str]] = []
    for part in (expert_host_need(setup, cold) if setup.offload_configured else None, ple):
        if isinstance(part, Result):
            out.append(part)
        elif part is not None:
            parts.append(part)
    if not parts:
        return out
    need = sum(n for n, _ in parts)
    what = "; ".join(w for _, w in parts)
    found = _host_room(setup)
    if found is None:
        return [*out, Result("host-memory", "warn", f"{what}; cannot read how much memory is free")]
    room, source = found
    fix = (
        "give the container more memory (compose: deploy.resources.limits.memory), stop "
        "what else uses host memory, or use a smaller cold set"
    )
    if ple is not None and not isinstance(ple, Result):
        fix += (
            ", or read the n-gram tables from the checkpoint file (VLLM_PLE_TABLE=file) or "
            "keep them in VRAM (VLLM_PLE_TABLE=gpu)"
        )
    if need > room:
        return [
            *out,
            Result(
                "host-memory",
                "fail",
                f"{what}, but only {room / GiB:.2f} GiB is free: {source}",
                fix,
            ),
        ]
    reserve_gib = setup.reserve_gib
    if reserve_gib is None:
        reserve_gib = RESERVE_GIB_BASE + RESERVE_GIB_PER_GPU * setup.gpus_needed
    if need + reserve_gib * GiB > room:
        out.append(
            Result(
                "host-memory",
                "warn",
                f"{what}; {room / GiB:.2f} GiB is free ({source}), which leaves less than "
                f"the ~{reserve_gib:.0f} GiB vLLM's own processes usually take",
                fix,
            )
        )
    else:
        out.append(Result("host-memory", "ok", f"{what}; {room / GiB:.2f} GiB free ({source})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < need:
        out.append(
            Result(
                "host-memory",
                "warn",
                f"the locked-memory limit is {soft >> 10} KiB, less than the "
                f"{need / GiB:.2f} GiB to page-lock; "
                "page-locking them may fail",
                "ulimit -l unlimited (compose: ulimits: memlock: -1)",
            )
        )
    return out


# --- gpus and host-mapping --------------------------------------------------------------------


def check_gpus(setup: Setup) -> list[Result]:
    gpus, how = setup.query_gpus()
    need = setup.gpus_needed
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if len(gpus) < need:
        found = f"{len(gpus)} visible{shown}" if gpus else f"none visible{shown}: {how}"
        return [
            Result(
                "gpus",
                "fail",
                f"{need} GPU(s) needed (pipeline parallel {setup.pp} x tensor parallel "
                f"{setup.tp}), {found}",
                "give the container the GPUs (docker run --gpus all; compose: "
                "deploy.resources.reservations.devices with count: "
                f"{need}) or lower --pipeline-parallel-size",
            )
        ]
    used = gpus[:need]
    out = []
    topo = setup.topology
    if topo is not None and topo.gpus != need:
        out.append(
            Result(
                "gpus",
                "warn",
                f"the image is for {topo.name} ({topo.gpus} GPUs), the serve arguments "
                f"ask for {need}",
            )
        )
    small = [
        g for g in used if topo and topo.min_vram_bytes and g.total_bytes < topo.min_vram_bytes
    ]
    if small:
        names = ", ".join(f"GPU {g.index} {g.name} {g.total_bytes / GiB:.1f} GiB" for g in small)
        return out + [
            Result(
                "gpus",
                "fail",
                f"{topo.name} needs cards of {topo.vram_gib:g} GB; {names}",
                "use the compose file of a topology that fits these cards (compose/README.md) "
                "or a larger cold set (more experts in host memory)",
            )
        ]
    busy = [g for g in used if g.free_bytes is not None and g.free_bytes < 0.9 * g.total_bytes]
    if busy:
        names = ", ".join(
            f"GPU {g.index} has {(g.total_bytes - g.free_bytes) / GiB:.1f} GiB in use" for g in busy
        )
        out.append(
            Result("gpus", "warn", f"{names} by other processes", "stop them, or expect less KV")
        )
    desc = ", ".join(f"{g.name} {g.total_bytes / GiB:.1f} GiB" for g in used)
    out.append(Result("gpus", "ok", f"{need} of {len(gpus)} GPU(s) used ({desc}; via {how})"))
    return out


def check_host_mapping(setup: Setup) -> list[Result]:
    if not setup.offload_configured and setup.ple_table not in ("host", "auto"):
        return [Result("host-mapping", "skip", "no offload configured")]
    probes = setup.probes()
    out = []
    for p in probes:
        if p.name == "cudaHostRegister":
            if p.works is False:
                out.append(
                    Result(
                        "host-mapping",
                        "fail",
                        f"{p.name}: {p.detail}; the GPU cannot read page-locked host memory, "
                        "so expert offload cannot run",
                        "raise the locked-memory limit (compose: ulimits: memlock: -1), check "
                        "that the NVIDIA driver supports unified addressing, or unset "
                        "VLLM_EXPERT_COLD_FILE and VLLM_EXPERT_HOST_LAYERS",
                    )
                )
            elif p.works is None:
                out.append(Result("host-mapping", "skip", f"{p.name}: {p.detail}"))
            else:
                out.append(Result("host-mapping", "ok", f"{p.name}: {p.detail}"))
        else:
            out.append(vmm_result(setup, p))
    out.extend(injected_results(setup))
    return out


def vmm_result(setup: Setup, p: cuda_probe.Probe) -> Result:
    """What the host-NUMA mapping probe means for the path vLLM will run."""
    status = "ok" if p.works else ("skip" if p.works is None else "warn")
    if not setup.one_table:
        note = "" if p.works else "; offload-03's one table falls back to split experts"
    elif p.works:
        note = "; VLLM_EXPERT_ONE_TABLE=1: split layers will run as one table (offload-03)"
    elif p.works is False:
        note = (
            "; VLLM_EXPERT_ONE_TABLE=1, but vLLM's own probe will be refused the same way: "
            "every split layer will keep two tables (offload-02, correct but slower), and "
            "its start-up line will say so"
        )
    else:
        note = "; vLLM probes again at start-up and says which path runs"
    return Result("host-mapping", status, f"{p.name}: {p.detail}{note}")


def injected_results(setup: Setup) -> list[Result]:
    """Fault injection (VLLM_EXPERT_VMM_FAIL_AT) of the calls that come after the probe:
    what each will make vLLM do."""
    out = []
    merge = cuda_probe.fails_at(cuda_probe.MERGE_LABELS, setup.vmm_fail_at)
    if setup.one_table and merge:
        out.append(
            Result(
                "host-mapping",
                "warn",
                f"{cuda_probe.FAIL_AT_ENV} fails {', '.join(merge)}: every split layer's "
                "merge into one table will fail, and each will keep two tables (offload-02), "
                "with one log line per layer",
                f"unset {cuda_probe.FAIL_AT_ENV} (it is for tests)",
            )
        )
    alias = cuda_probe.fails_at(cuda_probe.ALIAS_LABELS, setup.vmm_fail_at)
    if setup.one_table and setup.prefill_staging and alias:
        out.append(
            Result(
                "host-mapping",
                "warn",
                f"{cuda_probe.FAIL_AT_ENV} fails {', '.join(alias)}: prefill staging will "
                "be off for one-table layers (their prefill reads host rows over PCIe), "
                "with one log line",
                f"unset {cuda_probe.FAIL_AT_ENV} (it is for tests)",
            )
        )
    return out


# --- running the checks ----------------------------------------------------------------------


def run_checks(setup: Setup, skip: Sequence[str] = ()) -> list[Result]:
    results: list[Result] = []
    cold = None
    for name in CHECKS:
        if name in skip:
            results.append(Result(name, "skip", "skipped on request"))
            continue
        if name == "vllm":
            results += check_vllm(setup)
        elif name == "cold-file":
            found, cold = check_cold_file(setup)
            results += found
        elif name == "host-memory":
            results += check_host_memory(setup, cold)
        elif name == "gpus":
            results += check_gpus(setup)
        elif name == "host-mapping":
            if any(r.check == "gpus" and r.status == "fail" for r in results):
                results.append(Result(name, "skip", "no usable GPU"))
            else:
                results += check_host_mapping(setup)
    return results


def exit_code(results: Sequence[Result]) -> int:
    for r in results:
        if r.status == "fail":
            return EXIT_CODES[r.check]
    return EXIT_OK


def report(results: Sequence[Result], out=None) -> None:
    out = out or sys.stdout
    for r in results:
        print(f"preflight: {r.status.upper():4} {r.check}: {r.message}", file=out)
        if r.fix and r.status in ("fail", "warn"):
            print(f"preflight:      fix: {r.fix}", file=out)
    failed = [r.check for r in results if r.status == "fail"]
    if failed:
        print(
            f"preflight: {len(failed)} check(s) failed ({', '.join(failed)}); vLLM is not "
            "started. EO_SKIP_PREFLIGHT=1 starts it anyway.",
            file=out,
        )
    out.flush()


EPILOG = f"""checks, in the order they run (exit code of the first that fails):
  vllm (7)          the installed vLLM is vllm.pin's and the patch series is applied
  cold-file (6)     VLLM_EXPERT_COLD_FILE exists, is well formed and fits the model
  host-memory (4)   host experts (and PLE tables with VLLM_PLE_TABLE=host) fit MemAvailable
                    and the container's memory limit; VLLM_PLE_TABLE=auto decided as vLLM
                    decides it; with file, the tables' bytes are in the checkpoint's files
  gpus (3)          PP x TP GPUs visible, each as large as the topology's cards
  host-mapping (5)  the driver page-locks host memory for the GPU; VMM host NUMA mapping

exit codes: 0 every check passed (warnings allowed); 2 usage; 3-7 as above.
environment: EO_TOPOLOGY (default of --topology), EO_PREFLIGHT_SKIP (comma-separated checks
to skip), VLLM_EXPERT_COLD_FILE, VLLM_EXPERT_HOST_LAYERS, VLLM_PP_LAYER_PARTITION,
VLLM_PLE_TABLE.
topologies: {", ".join(TOPOLOGIES)}."""


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    serve = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        prog="preflight",
        usage="preflight [options] [-- VLLM_SERVE_ARGS...]",
        description="Check, before vLLM starts, that this machine and container can serve "
        "with expert offload; each problem is printed with what to change.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ
    ap.add_argument("--topology", default=env.get("EO_TOPOLOGY") or None)
    ap.add_argument("--cold-file", default=env.get("VLLM_EXPERT_COLD_FILE") or None)
    ap.add_argument("--host-layers", default=env.get("VLLM_EXPERT_HOST_LAYERS", ""))
    ap.add_argument(
        "--ple-table",
        choices=("gpu", "host", "file", "auto"),
        default=env.get("VLLM_PLE_TABLE") or "gpu",
        help="where Qwen4Exp's PLE n-gram tables live (VLLM_PLE_TABLE); host: counted in the "
        "host-memory check; file: their bytes checked in the checkpoint's files; auto: "
        "decided as vLLM decides it",
    )
    ap.add_argument(
        "--skip",
        action="append",
        choices=CHECKS,
        default=[s for s in env.get("EO_PREFLIGHT_SKIP", "").split(",") if s],
        help="a check to skip (repeatable)",
    )
    ap.add_argument(
        "--reserve-gib",
        type=float,
        help="host memory vLLM's own processes need besides the host experts (default: "
        f"{RESERVE_GIB_BASE:g} + {RESERVE_GIB_PER_GPU:g} per GPU); used for a warning",
    )
    ap.add_argument("--meminfo", type=pathlib.Path, default=pathlib.Path("/proc/meminfo"))
    ap.add_argument("--cgroup-root", type=pathlib.Path, default=pathlib.Path("/sys/fs/cgroup"))
    ap.add_argument("--site", type=pathlib.Path, help="site-packages holding vllm (default: found)")
    return ap.parse_args(own), serve


# the settings the preflight reads from the environment (eotools/settings.py checks them)
READS = (
    "VLLM_EXPERT_COLD_FILE",
    "VLLM_EXPERT_HOST_LAYERS",
    "VLLM_PP_LAYER_PARTITION",
    "VLLM_PLE_TABLE",
    "VLLM_EXPERT_ONE_TABLE",
    "VLLM_EXPERT_PREFILL_STAGING",
    "VLLM_EXPERT_VMM_FAIL_AT",
    "EO_PREFLIGHT_SKIP",
    "EO_TOPOLOGY",
)


def run(setup: Setup, skip: Sequence[str] = ()) -> int:
    """Run the checks, print them, and return the exit code (the start program calls this
    in-process with what it has already read)."""
    results = run_checks(setup, skip)
    report(results)
    return exit_code(results)


def main(argv: Sequence[str] | None = None) -> int:
    args, serve = parse(sys.argv[1:] if argv is None else argv)
    try:
        # the same reading as the start program's, so "HOST" or "yes" is refused here too
        values = settings.read(os.environ, READS)
        ple_table = settings.BY_NAME["VLLM_PLE_TABLE"].read(args.ple_table)
        settings.BY_NAME["VLLM_EXPERT_HOST_LAYERS"].read(args.host_layers)  # bounded
        bad = [s for s in args.skip if s not in CHECKS]
        if bad:
            raise ValueError(f"unknown check(s) to skip: {bad}; known: {CHECKS}")
        model, pp, tp = parse_serve_args(serve)
        topology = get_topology(args.topology)
    except settings.SettingError as e:
        print(f"preflight: error: {e}\npreflight:   fix: {e.fix}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, KeyError) as e:
        print(f"preflight: error: {e.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    setup = Setup(
        model=model,
        pp=pp,
        tp=tp,
        topology=topology,
        cold_file=args.cold_file,
        host_layers=args.host_layers,
        pp_partition=os.environ.get("VLLM_PP_LAYER_PARTITION", ""),
        ple_table=ple_table,
        one_table=values["VLLM_EXPERT_ONE_TABLE"],
        prefill_staging=values["VLLM_EXPERT_PREFILL_STAGING"],
        vmm_fail_at=set(values["VLLM_EXPERT_VMM_FAIL_AT"] or ()),
        meminfo=args.meminfo,
        cgroup_root=args.cgroup_root,
        site=args.site,
        reserve_gib=args.reserve_gib,
    )
    return run(setup, args.skip)
