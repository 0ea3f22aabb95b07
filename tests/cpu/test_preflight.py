# SPDX-License-Identifier: Apache-2.0
"""The start-up preflight (scripts/preflight, eotools/preflight.py) against fakes: a fake
/proc/meminfo and cgroup folder, fake checkpoints (config.json and the expert size), fake GPU
lists and CUDA bindings. The checks against a real extracted vLLM are in test_image.py."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
from eotools import cuda_probe, hostmem
from eotools import preflight as pf
from eotools.cuda_probe import Gpu, Probe
from eotools.topologies import TOPOLOGIES

GiB = 1 << 30
MiB = 1 << 20
EXPERT = 2 * MiB  # bytes of one expert in the fake checkpoint


def make_model(tmp: pathlib.Path, layers: int = 8, experts: int = 512) -> pathlib.Path:
    """A checkpoint folder with what the preflight reads: config.json and the expert size
    (synthetic_model.json: a make-test-model folder written without weights)."""
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": layers,
        "num_experts": experts,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "synthetic_model.json").write_text(json.dumps({"expert_bytes": EXPERT}))
    return d


def make_cold(
    tmp: pathlib.Path,
    layers: dict[int, list[int]],
    model: dict | None = None,
    budget: dict | None = None,
    name: str = "cold.json",
) -> pathlib.Path:
    doc = {
        "format": "vllm-expert-offload/cold-set",
        "version": 1,
        "model": model
        or {"architecture": "Qwen3MoeForCausalLM", "num_layers": 8, "num_experts": 512},
        "budget": budget,
        "provenance": {},
        "layers": {str(k): v for k, v in layers.items()},
    }
    p = tmp / name
    p.write_text(json.dumps(doc))
    return p


def fake_host(tmp: pathlib.Path, avail_gib: float, limit_gib: float | None, used_gib=1.0):
    """A /proc/meminfo and a cgroup v2 folder (limit None: memory.max is 'max')."""
    meminfo = tmp / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {512 * 1024 * 1024} kB\nMemAvailable:   {int(avail_gib * 1024**2)} kB\n"
    )
    cg = tmp / "cgroup"
    cg.mkdir(exist_ok=True)
    (cg / "memory.max").write_text("max\n" if limit_gib is None else f"{int(limit_gib * GiB)}\n")
    (cg / "memory.current").write_text(f"{int(used_gib * GiB)}\n")
    return meminfo, cg


def no_gpus():
    return [], "no GPUs here"


def gpus(*total_gib: float, free_fraction: float = 1.0):
    def query():
        return [
            Gpu(i, "Fake GPU", int(t * GiB), int(t * GiB * free_fraction))
            for i, t in enumerate(total_gib)
        ], "fake"

    return query


def setup_for(tmp, **kw) -> pf.Setup:
    meminfo, cg = fake_host(tmp, kw.pop("avail_gib", 64), kw.pop("limit_gib", None))
    defaults = dict(meminfo=meminfo, cgroup_root=cg, query_gpus=no_gpus, probes=lambda: [])
    return pf.Setup(**{**defaults, **kw})


def only(results, check):
    return [r for r in results if r.check == check]


# --- serve arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["/models/m", "--pipeline-parallel-size", "2"], ("/models/m", 2, 1)),
        (["/m", "-pp", "3", "-tp", "2"], ("/m", 3, 2)),
        (["--model=/m", "--tensor-parallel-size=4"], ("/m", 1, 4)),
        (["--max-model-len", "4096", "--model", "/m"], ("/m", 1, 1)),
        ([], (None, 1, 1)),
    ],
)
def test_serve_arguments(args, expected):
    assert pf.parse_serve_args(args) == expected


def test_serve_arguments_with_a_bad_size():
    with pytest.raises(ValueError, match="parallel sizes"):
        pf.parse_serve_args(["/m", "-pp", "two"])


# --- host memory ----------------------------------------------------------------------------


def test_meminfo_and_cgroup_v2(tmp_path):
    meminfo, cg = fake_host(tmp_path, avail_gib=10, limit_gib=8, used_gib=3)
    assert hostmem.mem_available(meminfo) == 10 * GiB
    mem = hostmem.cgroup_memory(cg)
    assert (mem.limit, mem.usage, mem.room) == (8 * GiB, 3 * GiB, 5 * GiB)
    assert mem.source.endswith("memory.max")
    (cg / "memory.max").write_text("max\n")
    assert hostmem.cgroup_memory(cg) is None


def test_cgroup_v1(tmp_path):
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    mem = hostmem.cgroup_memory(tmp_path)
    assert mem.room == 3 * GiB and mem.source.endswith("memory.limit_in_bytes")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert hostmem.cgroup_memory(tmp_path) is None


def cold_100_per_layer(tmp, **kw):
    return make_cold(tmp, {layer: list(range(100)) for layer in range(8)}, **kw)


def test_host_memory_fails_when_the_container_limit_is_too_small(tmp_path):
    model = make_model(tmp_path)
    cold = cold_100_per_layer(tmp_path)
    s = setup_for(tmp_path, model=str(model), pp=2, cold_file=str(cold), limit_gib=2)
    results = pf.run_checks(s, skip=["vllm"])
    [mem] = only(results, "host-memory")
    assert mem.status == "fail"
    # 800 experts x 2 MiB = 1.5625 GiB, 400 per rank; 2 GiB limit less 1 GiB used
    assert "1.56 GiB" in mem.message and "[400, 400]" in mem.message
    assert "only 1.00 GiB is free" in mem.message and "memory.max" in mem.message
    assert "deploy.resources.limits.memory" in mem.fix
    assert pf.exit_code(results) == 4


def test_host_memory_uses_the_tighter_of_meminfo_and_cgroup(tmp_path):
    model = make_model(tmp_path)
    cold = cold_100_per_layer(tmp_path)
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold), avail_gib=1.5, limit_gib=64)
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "fail" and "MemAvailable" in mem.message


def test_host_memory_warns_when_vllm_itself_may_not_fit(tmp_path):
    model = make_model(tmp_path)
    cold = cold_100_per_layer(tmp_path)
    tight = setup_for(tmp_path, model=str(model), pp=2, cold_file=str(cold), limit_gib=5)
    [warn] = [
        r for r in only(pf.run_checks(tight, ["vllm"]), "host-memory") if "usually" in r.message
    ]
    assert warn.status == "warn" and "~8 GiB" in warn.message  # 2 + 3 per GPU, 2 GPUs
    roomy = setup_for(tmp_path, model=str(model), pp=2, cold_file=str(cold), limit_gib=64)
    mem = only(pf.run_checks(roomy, ["vllm"]), "host-memory")
    assert mem[0].status == "ok"


def test_host_memory_counts_whole_host_layers(tmp_path):
    model = make_model(tmp_path)
    s = setup_for(tmp_path, model=str(model), pp=2, host_layers="0-1,7", limit_gib=64)
    [mem] = [r for r in only(pf.run_checks(s, ["vllm"]), "host-memory") if "need" in r.message]
    # layers 0-1 on rank 0, layer 7 on rank 1, 512 experts each
    assert "[1024, 512]" in mem.message and "3.00 GiB" in mem.message


def test_a_low_locked_memory_limit_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(pf.resource, "getrlimit", lambda what: (64 << 10, 64 << 10))
    model = make_model(tmp_path)
    s = setup_for(tmp_path, model=str(model), host_layers="0", limit_gib=64)
    results = pf.run_checks(s, ["vllm", "gpus", "host-mapping"])
    [lock] = [r for r in only(results, "host-memory") if "locked-memory" in r.message]
    assert lock.status == "warn" and "limit is 64 KiB" in lock.message
    assert "memlock: -1" in lock.fix
    assert pf.exit_code(results) == 0


@pytest.mark.parametrize(
    "layers, expected",
    [("0-3,x", "cannot read 'x'"), ("2,8", "names layer(s) 8, but the model has 8 layers")],
)
def test_bad_host_layers(tmp_path, layers, expected):
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), host_layers=layers)
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail" and expected in r.message


def test_host_memory_is_skipped_without_offload(tmp_path):
    s = setup_for(tmp_path, model=str(make_model(tmp_path)))
    [mem] = only(pf.run_checks(s, ["vllm"]), "host-memory")
    assert mem.status == "skip"


# --- cold file against the model --------------------------------------------------------------


def test_a_missing_cold_file_says_where_the_file_must_be(tmp_path):
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file="/cold/3GiB-per-card.json")
    results = pf.run_checks(s, ["vllm"])
    [cold] = only(results, "cold-file")
    assert cold.status == "fail" and "no such file" in cold.message
    for step in ("COLD_DIR", "COLD_FILE=/cold/", "inside the container"):
        assert step in cold.fix
    assert "count-experts" not in cold.fix  # a typo needs no recipe for a new cold set
    assert only(results, "host-memory")[0].status == "skip"  # nothing to count without it
    assert pf.exit_code(results) == 6


def test_a_mistyped_cold_file_lists_the_files_beside_it(tmp_path):
    folder = tmp_path / "cold"
    folder.mkdir()
    (folder / "3GiB-per-card.json").write_text("{}")
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file=str(folder / "3GiB.json"))
    [cold] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert cold.status == "fail" and "has: 3GiB-per-card.json" in cold.fix


def test_a_host_path_as_cold_file_is_named_as_one(tmp_path):
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file="/home/me/x/cold.json")
    [cold] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert "looks like a path on the host" in cold.fix


def test_a_cold_file_for_another_model_gives_a_recipe_for_a_real_model(tmp_path):
    """count-experts' default source reads only make-test-model checkpoints: the recipe for a
    served model counts on the server, for this model and pipeline size."""
    model = make_model(tmp_path)
    other = {"architecture": "Qwen3MoeForCausalLM", "num_layers": 48, "num_experts": 512}
    cold = make_cold(tmp_path, {0: [1, 2]}, model=other)
    s = setup_for(tmp_path, model=str(model), cold_file=str(cold), pp=2)
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail"
    assert "scripts/count-experts --source server" in r.fix
    assert "VLLM_EXPERT_COUNT_FILE" in r.fix and "--counts-file" in r.fix
    assert f"select --model {model} " in r.fix and "--pp-size 2 " in r.fix


BAD_COLD = {
    "another layer count": (
        dict(model={"architecture": "Qwen3MoeForCausalLM", "num_layers": 48, "num_experts": 512}),
        "made for 48 layers, but the model has 8",
    ),
    "another architecture": (
        dict(model={"architecture": "Qwen4ExpForCausalLM", "num_layers": 8, "num_experts": 512}),
        "made for a Qwen4ExpForCausalLM",
    ),
    "another expert count": (
        dict(model={"num_experts": 256}),
        "made for 256 experts per layer, but the model has 512",
    ),
    "a layer the model lacks": (
        dict(layers={9: [1]}),
        "lists layer(s) 9, but the model has 8 layers (0-7)",
    ),
    "an expert id out of range": (dict(layers={0: [1, 512]}), "outside 0-511"),
    "a duplicate id": (dict(layers={0: [3, 3]}), "more than once"),
    "over its budget": (
        # rank 0 (layers 0-3) holds 400 x 2 MiB = 0.78 GiB, made for 0.5 GiB per stage
        dict(budget={"pipeline_parallel_size": 2, "gib_per_stage": [0.5, 0.5]}),
        "0.78 GiB on pipeline rank 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD_COLD))
def test_a_cold_file_that_does_not_fit_the_model_fails(tmp_path, case):
    change, expected = BAD_COLD[case]
    layers = change.pop("layers", {layer: list(range(100)) for layer in range(8)})
    cold = make_cold(tmp_path, layers, **change)
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), pp=2, cold_file=str(cold))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail"
    assert expected in r.message
    assert "scripts/select-cold-set" in r.fix


def test_a_cold_file_layer_also_in_host_layers_fails(tmp_path):
    cold = make_cold(tmp_path, {2: [1, 2]})
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file=str(cold), host_layers="2")
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail" and "also in VLLM_EXPERT_HOST_LAYERS" in r.message


def test_a_fitting_cold_file_passes(tmp_path):
    cold = cold_100_per_layer(
        tmp_path, budget={"pipeline_parallel_size": 2, "gib_per_stage": [0.8, 0.8]}
    )
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), pp=2, cold_file=str(cold))
    results = pf.run_checks(s, ["vllm"])
    [r] = only(results, "cold-file")
    assert r.status == "ok" and "800 host experts in 8 layers" in r.message
    assert pf.exit_code([x for x in results if x.check != "gpus"]) == 0


def test_a_hub_model_gets_the_cold_file_checked_on_its_own(tmp_path):
    cold = make_cold(tmp_path, {0: [1]}, budget={"bytes_per_expert": EXPERT})
    s = setup_for(tmp_path, model="Org/Some-MoE", cold_file=str(cold))
    results = pf.run_checks(s, ["vllm"])
    [r] = only(results, "cold-file")
    assert r.status == "warn" and "not a local directory" in r.message
    # the expert size from the cold file's budget
    [mem] = [r for r in only(results, "host-memory") if "need" in r.message]
    assert mem.status == "ok" and "1 experts x 2097152 bytes" in mem.message


def test_a_malformed_cold_file_fails(tmp_path):
    p = tmp_path / "cold.json"
    p.write_text("{not json")
    s = setup_for(tmp_path, model=str(make_model(tmp_path)), cold_file=str(p))
    [r] = only(pf.run_checks(s, ["vllm"]), "cold-file")
    assert r.status == "fail" and "not readable as JSON" in r.message


# --- GPUs -------------------------------------------------------------------------------------


def test_too_few_gpus(tmp_path):
    s = setup_for(tmp_path, pp=2, query_gpus=gpus(80))
    results = pf.run_checks(s, ["vllm"])
    [r] = only(results, "gpus")
    assert r.status == "fail" and "2 GPU(s) needed" in r.message and "1 visible" in r.message
    assert "count: 2" in r.fix
    assert only(results, "host-mapping")[0].message == "no usable GPU"
    assert pf.exit_code(results) == 3


def test_cards_smaller_than_the_topology(tmp_path):
    s = setup_for(tmp_path, pp=2, topology=TOPOLOGIES["2x32GB"], query_gpus=gpus(23.7, 23.7))
    [r] = only(pf.run_checks(s, ["vllm"]), "gpus")
    assert r.status == "fail" and "needs cards of 32 GB" in r.message and "23.7 GiB" in r.message


def test_cards_of_the_topology_pass(tmp_path):
    # an RTX 5090 reports 31.8 GiB, an RTX 3090 23.7 GiB: both count as their nominal size
    s = setup_for(tmp_path, pp=2, topology=TOPOLOGIES["2x32GB"], query_gpus=gpus(31.8, 31.8, 31.8))
    [r] = only(pf.run_checks(s, ["vllm"]), "gpus")
    assert r.status == "ok" and "2 of 3 GPU(s) used" in r.message
    s = setup_for(tmp_path, pp=3, topology=TOPOLOGIES["3x24GB"], query_gpus=gpus(23.7, 23.7, 23.7))
    assert only(pf.run_checks(s, ["vllm"]), "gpus")[0].status == "ok"


def test_gpus_warnings(tmp_path):
    s = setup_for(
        tmp_path, pp=2, topology=TOPOLOGIES["3x24GB"], query_gpus=gpus(24, 24, free_fraction=0.5)
    )
    results = only(pf.run_checks(s, ["vllm"]), "gpus")
    assert [r.status for r in results] == ["warn", "warn", "ok"]
    assert "ask for 2" in results[0].message and "12.0 GiB in use" in results[1].message


def test_nvidia_smi_rows():
    rows = (
        "0, GPU-aaaa-1111, NVIDIA GeForce RTX 5090, 32607, 31000\n"
        "1, GPU-bbbb-2222, NVIDIA H200, 143771, 143000\n"
    )
    found = cuda_probe.parse_nvidia_smi(rows)
    assert found[0] == Gpu(0, "NVIDIA GeForce RTX 5090", 32607 * MiB, 31000 * MiB)
    assert found[1].name == "NVIDIA H200"
    # CUDA_VISIBLE_DEVICES selects and renumbers, by index or UUID prefix
    assert [g.name for g in cuda_probe.parse_nvidia_smi(rows, "1")] == ["NVIDIA H200"]
    assert [g.index for g in cuda_probe.parse_nvidia_smi(rows, "GPU-bbbb,0")] == [0, 1]
    assert cuda_probe.parse_nvidia_smi(rows, "") == []
    assert len(cuda_probe.parse_nvidia_smi(rows, "0,7,1")) == 1  # stops at an unknown one


# --- host mapping -----------------------------------------------------------------------------


def test_host_register_refused_fails_the_preflight(tmp_path):
    probes = [Probe("cudaHostRegister", False, "refused 4 MiB (cudaError 2)")]
    s = setup_for(tmp_path, host_layers="0", query_gpus=gpus(80), probes=lambda: probes)
    results = pf.run_checks(s, ["vllm", "cold-file", "host-memory"])
    [r] = only(results, "host-mapping")
    assert r.status == "fail" and "cudaError 2" in r.message and "memlock: -1" in r.fix
    assert pf.exit_code(results) == 5


def test_vmm_refused_is_only_a_warning(tmp_path):
    probes = [
        Probe("cudaHostRegister", True, "4 MiB page-locked"),
        Probe("cuMemCreate(HOST_NUMA)", False, "cuMemCreate failed (CUDA_ERROR_NOT_SUPPORTED)"),
    ]
    s = setup_for(tmp_path, host_layers="0", query_gpus=gpus(80), probes=lambda: probes)
    results = pf.run_checks(s, ["vllm", "cold-file", "host-memory"])
    assert [r.status for r in only(results, "host-mapping")] == ["ok", "warn"]
    assert "falls back to split experts" in only(results, "host-mapping")[1].message
    assert pf.exit_code(results) == 0


def test_no_probe_without_offload(tmp_path):
    def probes():
        raise AssertionError("probed although nothing is offloaded")

    s = setup_for(tmp_path, query_gpus=gpus(80), probes=probes)
    [r] = only(pf.run_checks(s, ["vllm"]), "host-mapping")
    assert r.status == "skip"


class FakeCudart:
    def __init__(self, error: int = 0):
        self.error, self.calls = error, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_host_register_probe_registers_page_aligned_memory_and_releases_it():
    rt = FakeCudart()
    p = cuda_probe.probe_host_register(rt)
    assert p.works is True
    (_, ptr, size, flags), (undo, ptr2) = rt.calls
    assert ptr % 4096 == 0 and size == 4 * MiB and flags == 0x03  # portable | mapped
    assert (undo, ptr2) == ("unregister", ptr)


def test_host_register_probe_reports_the_error():
    rt = FakeCudart(error=2)
    p = cuda_probe.probe_host_register(rt)
    assert p.works is False and "cudaError 2" in p.detail
    assert [c[0] for c in rt.calls] == ["register"]  # nothing to undo


def _ns(**names):
    return SimpleNamespace(**{k: k for k in names} | names)


class FakeDriver:
    """The parts of cuda.bindings.driver the VMM probe uses; `fail` names the call to refuse."""

    CUdevice_attribute = _ns(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID=134)
    CUmemAllocationType = _ns(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = _ns(CU_MEM_LOCATION_TYPE_HOST_NUMA=3, CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = _ns(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = _ns(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    class CUmemAllocationProp:
        def __init__(self):
            self.location = SimpleNamespace(type=None, id=None)

    CUmemAccessDesc = CUmemAllocationProp

    def __init__(self, fail: str = ""):
        self.fail, self.calls, self.value = fail, [], 0

    def __getattr__(self, fn):
        results = {
            "cuDeviceGet": 0,
            "cuDevicePrimaryCtxRetain": "ctx",
            "cuDeviceGetAttribute": 1,
            "cuMemGetAllocationGranularity": 2 * MiB,
            "cuMemCreate": "handle",
            "cuMemAddressReserve": 0x7F0000000000,
        }

        def call(*args):
            self.calls.append(fn)
            if fn == self.fail:
                return (801,)
            if fn == "cuMemsetD8":
                self.value = args[1]
            if fn == "cuMemcpyDtoH":
                ctypes.memset(args[0], self.value, args[2])
            return (0, results[fn]) if fn in results else (0,)

        return call

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_NOT_SUPPORTED"


def test_vmm_probe_maps_host_numa_memory_and_releases_everything():
    drv = FakeDriver()
    p = cuda_probe.probe_vmm_host_numa(drv)
    assert p.works is True and "host NUMA node 1" in p.detail
    made = ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]
    assert [c for c in drv.calls if c in made] == made
    undo = ["cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuDevicePrimaryCtxRelease"]
    assert drv.calls[-4:] == undo


def test_vmm_probe_reports_a_refusal_and_still_releases():
    drv = FakeDriver(fail="cuMemMap")
    p = cuda_probe.probe_vmm_host_numa(drv)
    assert p.works is False and p.detail == "cuMemMap failed (CUDA_ERROR_NOT_SUPPORTED)"
    assert drv.calls[-3:] == ["cuMemAddressFree", "cuMemRelease", "cuDevicePrimaryCtxRelease"]


# the calls of vLLM's own host-mapping probe (a host-only VMM range), by its labels
PROBE_STEPS = [
    ("cuMemGetAllocationGranularity[host]", "cuMemGetAllocationGranularity"),
    ("cuMemCreate[host]", "cuMemCreate"),
    ("cuMemAddressReserve", "cuMemAddressReserve"),
    ("cuMemMap[host]", "cuMemMap"),
    ("cuMemSetAccess[host]", "cuMemSetAccess"),
]


@pytest.mark.parametrize(("label", "fn"), PROBE_STEPS)
def test_vmm_probe_fails_where_vllms_fault_injection_would(monkeypatch, label, fn):
    """VLLM_EXPERT_VMM_FAIL_AT fails the same labelled calls in the preflight's probe as in
    vLLM's, so the preflight predicts the fallback it injects: the call is not made, what
    was made is released, and the reason names the label and the setting."""
    monkeypatch.setenv("VLLM_EXPERT_VMM_FAIL_AT", f"somethingElse,{label}")
    drv = FakeDriver()
    p = cuda_probe.probe_vmm_host_numa(drv)
    assert p.works is False and label in p.detail and "VLLM_EXPERT_VMM_FAIL_AT" in p.detail
    assert fn not in drv.calls
    assert drv.calls[-1] == "cuDevicePrimaryCtxRelease"
    monkeypatch.setenv("VLLM_EXPERT_VMM_FAIL_AT", fn)  # a bare name fails every such call
    assert cuda_probe.probe_vmm_host_numa(FakeDriver()).works is False
    # calls only a layer's merge makes leave the probe alone
    monkeypatch.setenv("VLLM_EXPERT_VMM_FAIL_AT", "cuMemCreate[device],cuMemMap[alias]")
    assert cuda_probe.probe_vmm_host_numa(FakeDriver()).works is True


def _mapping(tmp_path, probe_works: bool | None, **kw) -> list[pf.Result]:
    probes = [
        Probe("cudaHostRegister", True, "4 MiB page-locked"),
        Probe("cuMemCreate(HOST_NUMA)", probe_works, "cuMemCreate failed (CUDA_ERROR_X)"),
    ]
    s = setup_for(tmp_path, host_layers="0", query_gpus=gpus(80), probes=lambda: probes, **kw)
    return only(pf.run_checks(s, ["vllm", "cold-file", "host-memory"]), "host-mapping")


def test_the_host_mapping_check_says_which_path_one_table_will_run(tmp_path):
    ok = _mapping(tmp_path, True, one_table=True)
    assert [r.status for r in ok] == ["ok", "ok"]
    assert "split layers will run as one table (offload-03)" in ok[1].message
    refused = _mapping(tmp_path, False, one_table=True)
    assert [r.status for r in refused] == ["ok", "warn"]
    assert "every split layer will keep two tables (offload-02" in refused[1].message
    untried = _mapping(tmp_path, None, one_table=True)
    assert untried[1].status == "skip" and "vLLM probes again" in untried[1].message


@pytest.mark.parametrize(
    "label", ["cuMemCreate[device]", "cuMemMap[device]", "cuMemSetAccess[device]", "cuMemMap"]
)
def test_injected_merge_failures_are_predicted_per_layer(tmp_path, label):
    """Calls that only a layer's merge makes (its VRAM part) fail after the probe passed:
    the check says every split layer will keep two tables, one log line each."""
    results = _mapping(tmp_path, True, one_table=True, vmm_fail_at={label})
    warn = [r for r in results if r.status == "warn"]
    assert len(warn) == 1 and "with one log line per layer" in warn[0].message
    assert "(offload-02)" in warn[0].message and "VLLM_EXPERT_VMM_FAIL_AT" in warn[0].fix
    # without one table nothing merges: nothing to predict
    assert all(r.status == "ok" for r in _mapping(tmp_path, True, vmm_fail_at={label}))


def test_an_injected_alias_failure_predicts_staging_off(tmp_path):
    both = dict(one_table=True, prefill_staging=True, vmm_fail_at={"cuMemSetAccess[alias]"})
    [warn] = [r for r in _mapping(tmp_path, True, **both) if r.status == "warn"]
    assert "prefill staging will be off for one-table layers" in warn.message
    both["prefill_staging"] = False
    assert all(r.status == "ok" for r in _mapping(tmp_path, True, **both))


def test_the_preflight_reads_the_path_settings_from_the_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr(pf, "run_checks", lambda setup, skip: seen.setdefault("s", setup) and [])
    monkeypatch.setattr(pf, "report", lambda results: None)
    monkeypatch.setenv("VLLM_EXPERT_ONE_TABLE", "1")
    monkeypatch.setenv("VLLM_EXPERT_PREFILL_STAGING", "1")
    monkeypatch.setenv("VLLM_EXPERT_VMM_FAIL_AT", " cuMemCreate[device] ,cuMemMap[alias]")
    pf.main(["--skip", "vllm"])
    s = seen["s"]
    assert s.one_table and s.prefill_staging
    assert s.vmm_fail_at == {"cuMemCreate[device]", "cuMemMap[alias]"}


def test_vmm_probe_without_cuda_python(monkeypatch):
    monkeypatch.setattr(cuda_probe, "default_driver", lambda: None)
    p = cuda_probe.probe_vmm_host_numa()
    assert p.works is None and "cuda-python" in p.detail


# --- vLLM version and the command line ------------------------------------------------------


def fake_site(tmp: pathlib.Path, version: str) -> pathlib.Path:
    site = tmp / f"site-{version}"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm/_version.py").write_text(f"__version__ = version = '{version}'\n")
    return site


def test_another_vllm_release_fails(tmp_path):
    s = setup_for(tmp_path, site=fake_site(tmp_path, "0.28.1"))
    [r] = only(pf.run_checks(s), "vllm")
    assert r.status == "fail" and "0.28.1" in r.message and pf.PIN.vllm_version in r.message
    assert pf.PIN.vllm_image in r.fix
    assert pf.exit_code(pf.run_checks(s)) == 7


def test_a_changed_vllm_of_the_pinned_release_fails(tmp_path):
    # the pinned version (a local build label is fine) but none of the files the series
    # changes: apply-patches.sh --check exits 1, neither applied nor applicable
    s = setup_for(tmp_path, site=fake_site(tmp_path, pf.PIN.vllm_version + "+cu129"))
    [r] = only(pf.run_checks(s), "vllm")
    assert r.status == "fail" and "neither applies to nor is applied" in r.message


def preflight_cli(repo_root, *args, **env):
    unset = {"VLLM_EXPERT_COLD_FILE", "VLLM_EXPERT_HOST_LAYERS", "EO_TOPOLOGY"} - set(env)
    e = {k: v for k, v in os.environ.items() if k not in unset} | env
    return subprocess.run(
        [sys.executable, str(repo_root / "scripts/preflight"), *args],
        capture_output=True,
        text=True,
        env=e,
    )


def test_cli_exit_codes(repo_root, tmp_path):
    model = make_model(tmp_path)
    cold = cold_100_per_layer(tmp_path)
    meminfo, cg = fake_host(tmp_path, avail_gib=64, limit_gib=2)
    common = ["--meminfo", str(meminfo), "--cgroup-root", str(cg), "--cold-file", str(cold)]
    serve = ["--", str(model), "--pipeline-parallel-size", "2"]
    skip = {"EO_PREFLIGHT_SKIP": "vllm,gpus,host-mapping"}
    r = preflight_cli(repo_root, *common, *serve, **skip)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "FAIL host-memory" in r.stdout and "fix:" in r.stdout
    (cg / "memory.max").write_text("max\n")
    r = preflight_cli(repo_root, *common, *serve, **skip)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK   cold-file" in r.stdout and "SKIP gpus: skipped on request" in r.stdout
    assert preflight_cli(repo_root, "--topology", "4x80GB").returncode == 2
    assert preflight_cli(repo_root, "--", "/m", "-pp", "x").returncode == 2
    h = preflight_cli(repo_root, "--help")
    assert h.returncode == 0 and "exit codes" in h.stdout and "2x32GB" in h.stdout


def test_exit_code_is_the_first_failure():
    results = [
        pf.Result("vllm", "ok", ""),
        pf.Result("host-memory", "fail", ""),
        pf.Result("gpus", "fail", ""),
    ]
    assert pf.exit_code(results) == 4
    assert pf.exit_code([pf.Result("gpus", "warn", "")]) == 0


def test_a_cold_files_budget_is_for_its_own_experts(tmp_path):
    """Whole layers of VLLM_EXPERT_HOST_LAYERS come on top of the budget a cold file states
    (the series checks the file's own experts against it): a budget-only start's file with
    host layers beside it is not over its budget."""
    model = make_model(tmp_path)  # 8 layers, 2 MiB experts
    budget = {"pipeline_parallel_size": 2, "gib_per_stage": [0.25, 0.25]}  # 128 experts
    cold = make_cold(tmp_path, {1: list(range(100)), 5: list(range(100))}, budget=budget)
    s = setup_for(tmp_path, model=str(model), pp=2, cold_file=str(cold), host_layers="0,4")
    [r] = only(pf.run_checks(s, skip=["vllm"]), "cold-file")
    assert r.status == "ok", r
    over = make_cold(tmp_path, {1: list(range(200))}, budget=budget, name="over.json")
    s = setup_for(tmp_path, model=str(model), pp=2, cold_file=str(over))
    [r] = only(pf.run_checks(s, skip=["vllm"]), "cold-file")
    assert r.status == "fail" and "made for a budget of 0.25 GiB per stage" in r.message
