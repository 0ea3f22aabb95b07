# SPDX-License-Identifier: Apache-2.0
"""vmm.py's driver call sequence against a fake cuda.bindings.driver (no GPU).

The fake keeps the driver's books (reservations, handles, mappings), checks each
call's arguments the way the VMM rules require (sizes and addresses multiples of the
granularity, maps inside a reservation and not overlapping, unmap exactly what was
mapped, free a reservation with nothing mapped in it) and can make any call fail.

    scripts/test tests/cpu/test_vmm_driver_calls.py
"""

from __future__ import annotations

import enum
import sys
from types import SimpleNamespace

import pytest
from vllm.model_executor.layers.fused_moe.expert_offload import vmm

MiB = 1 << 20
GRAN = 2 * MiB
DEVICE = 0


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_SUPPORTED = 801


class _Location:
    def __init__(self):
        self.type = None
        self.id = 0


class _Prop:
    def __init__(self):
        self.type = None
        self.location = _Location()
        self.requestedHandleTypes = 0


class _AccessDesc:
    def __init__(self):
        self.location = _Location()
        self.flags = None


DEVICE_LOC = 1
HOST_NUMA_LOC = 3
READWRITE = 3


class FakeDriver:
    """Enough of cuda.bindings.driver for vmm.py, with the driver's bookkeeping."""

    CUresult = CUresult
    CUmemAllocationProp = _Prop
    CUmemAccessDesc = _AccessDesc
    CUmemLocationType = SimpleNamespace(
        CU_MEM_LOCATION_TYPE_DEVICE=DEVICE_LOC,
        CU_MEM_LOCATION_TYPE_HOST_NUMA=HOST_NUMA_LOC,
    )
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=READWRITE)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID=134,
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=141,
    )

    @staticmethod
    def CUdeviceptr(value: int) -> int:  # noqa: N802 (the driver's name)
        return int(value)

    def __init__(self, device_gran=GRAN, host_gran=GRAN, numa_id=0, host_vmm=1):
        self.device_gran = device_gran
        self.host_gran = host_gran
        self.attributes = {134: numa_id, 141: host_vmm}
        self.calls: list[tuple[str, tuple]] = []
        self.counts: dict[str, int] = {}
        # {function name: {nth call (1-based): CUresult}}
        self.fail: dict[str, dict[int, CUresult]] = {}
        self.context = 1
        self.next_addr = 0x7F0000000000
        self.next_handle = 100
        self.reserved: dict[int, int] = {}  # address -> size
        self.handles: dict[int, tuple[int, int, int]] = {}  # handle -> size, type, id
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> size, handle
        self.created: list[int] = []
        self.released: list[int] = []
        self.access: list[tuple[int, int, int, int, int]] = []

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        impl = getattr(self, "_" + name)
        if name == "cuGetErrorName":  # not part of the sequence under test
            return impl

        def call(*args):
            self.calls.append((name, args))
            n = self.counts[name] = self.counts.get(name, 0) + 1
            if n in self.fail.get(name, {}):
                return (self.fail[name][n],)
            return impl(*args)

        return call

    # --- the calls ---
    def _cuGetErrorName(self, code):
        return (CUresult.CUDA_SUCCESS, CUresult(int(code)).name.encode())

    def _cuInit(self, flags):
        assert flags == 0
        return (CUresult.CUDA_SUCCESS,)

    def _cuDeviceGet(self, ordinal):
        return (CUresult.CUDA_SUCCESS, ordinal)

    def _cuCtxGetCurrent(self):
        return (CUresult.CUDA_SUCCESS, self.context)

    def _cuDevicePrimaryCtxRetain(self, dev):
        return (CUresult.CUDA_SUCCESS, 7)

    def _cuCtxSetCurrent(self, ctx):
        self.context = ctx
        return (CUresult.CUDA_SUCCESS,)

    def _cuCtxSynchronize(self):
        return (CUresult.CUDA_SUCCESS,)

    def _cuDeviceGetAttribute(self, attr, dev):
        return (CUresult.CUDA_SUCCESS, self.attributes[attr])

    def _cuMemGetAllocationGranularity(self, prop, option):
        assert option == 0
        if prop.location.type == DEVICE_LOC:
            return (CUresult.CUDA_SUCCESS, self.device_gran)
        assert prop.location.type == HOST_NUMA_LOC
        return (CUresult.CUDA_SUCCESS, self.host_gran)

    def _gran(self, loc_type):
        return self.device_gran if loc_type == DEVICE_LOC else self.host_gran

    def _cuMemAddressReserve(self, size, alignment, addr, flags):
        assert size > 0 and size % GRAN == 0 and addr == 0 and flags == 0
        assert alignment & (alignment - 1) == 0
        ptr = self.next_addr
        self.next_addr += size + 64 * GRAN
        self.reserved[ptr] = size
        return (CUresult.CUDA_SUCCESS, ptr)

    def _cuMemCreate(self, size, prop, flags):
        assert flags == 0 and prop.type == 1
        assert size > 0 and size % self._gran(prop.location.type) == 0, size
        handle = self.next_handle
        self.next_handle += 1
        self.handles[handle] = (size, prop.location.type, prop.location.id)
        self.created.append(handle)
        return (CUresult.CUDA_SUCCESS, handle)

    def _reservation_of(self, addr, size):
        for base, rsize in self.reserved.items():
            if base <= addr and addr + size <= base + rsize:
                return base
        raise AssertionError(f"{addr:#x}+{size} is outside every reservation")

    def _cuMemMap(self, ptr, size, offset, handle, flags):
        assert flags == 0 and offset == 0
        assert handle in self.handles, "map of a released handle"
        hsize, loc_type, _ = self.handles[handle]
        assert size <= hsize and size % self._gran(loc_type) == 0
        self._reservation_of(ptr, size)
        for addr, (msize, _) in self.mappings.items():
            assert ptr + size <= addr or addr + msize <= ptr, "overlapping map"
        self.mappings[ptr] = (size, handle)
        return (CUresult.CUDA_SUCCESS,)

    def _cuMemSetAccess(self, ptr, size, desc, count):
        assert count == len(desc) == 1
        assert self.mappings.get(ptr, (None,))[0] == size, "access on an unmapped range"
        d = desc[0]
        self.access.append((ptr, size, d.location.type, d.location.id, d.flags))
        return (CUresult.CUDA_SUCCESS,)

    def _cuMemUnmap(self, ptr, size):
        assert self.mappings.get(ptr, (None,))[0] == size, "unmap of what was not mapped"
        del self.mappings[ptr]
        return (CUresult.CUDA_SUCCESS,)

    def _cuMemRelease(self, handle):
        assert handle in self.handles, "double release"
        del self.handles[handle]
        self.released.append(handle)
        return (CUresult.CUDA_SUCCESS,)

    def _cuMemAddressFree(self, ptr, size):
        assert self.reserved.get(ptr) == size, "free of what was not reserved"
        if any(ptr <= addr < ptr + size for addr in self.mappings):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # still mapped
        del self.reserved[ptr]
        return (CUresult.CUDA_SUCCESS,)

    # --- helpers for the tests ---
    def names(self, since: int = 0) -> list[str]:
        return [name for name, _ in self.calls[since:]]

    def args_of(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]

    def assert_clean(self):
        assert not self.mappings, "leaked mappings"
        assert not self.handles, "leaked handles"
        assert not self.reserved, "leaked reservations"
        assert sorted(self.released) == sorted(self.created)


def _round_up(n, m):
    return -(-n // m) * m


ROW = 3 * MiB + 4096 + 100  # not a multiple of anything


def _table(**kw):
    args = dict(rows=10, row_bytes=ROW, gpu_bytes=4 * ROW + 5, device=DEVICE)
    args.update(kw)
    return vmm.SplitTable(**args)


# ---------------------------------------------------------------------------
# sizes, order, offsets


def test_sizes_passed_to_cuMemCreate(fake):
    t = _table()
    total = 10 * ROW
    gpu = (4 * ROW + 5) // GRAN * GRAN
    creates = fake.args_of("cuMemCreate")
    assert [size for size, _, _ in creates] == [gpu, _round_up(total, GRAN) - gpu]
    assert creates[0][0] <= 4 * ROW + 5  # rounded down: VRAM never grows
    assert creates[0][1].location.type == DEVICE_LOC and creates[0][1].location.id == 0
    assert creates[1][1].location.type == HOST_NUMA_LOC
    assert (t.gpu_bytes, t.host_bytes) == (gpu, _round_up(total, GRAN) - gpu)
    assert t.size == _round_up(total, GRAN) == t.gpu_bytes + t.host_bytes
    assert t.gpu_rows == gpu // ROW == 3  # the 4th row straddles: a host row
    assert t.host_rows == 7
    assert t.granularity == GRAN
    ((size, align, addr, flags),) = fake.args_of("cuMemAddressReserve")
    assert (size, align, addr, flags) == (t.size, GRAN, 0, 0)
    t.close()
    fake.assert_clean()


def test_maps_adjacent_in_order_with_device_access(fake):
    t = _table()
    maps = fake.args_of("cuMemMap")
    handles = fake.created
    assert maps == [
        (t.ptr, t.gpu_bytes, 0, handles[0], 0),
        (t.ptr + t.gpu_bytes, t.host_bytes, 0, handles[1], 0),
    ]
    assert fake.access == [
        (t.ptr, t.gpu_bytes, DEVICE_LOC, DEVICE, READWRITE),
        (t.ptr + t.gpu_bytes, t.host_bytes, DEVICE_LOC, DEVICE, READWRITE),
    ]
    # each part: create, map, grant access; device part first
    core = [n for n in fake.names() if n.startswith("cuMem") and "Granularity" not in n]
    assert core == [
        "cuMemAddressReserve",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
    ]
    t.close()


def test_close_releases_in_reverse_order_once(fake):
    t = _table()
    dev_handle, host_handle = fake.created
    start = len(fake.calls)
    t.close()
    assert fake.calls[start:] == [
        ("cuCtxSynchronize", ()),
        ("cuMemUnmap", (t.ptr + t.gpu_bytes, t.host_bytes)),
        ("cuMemUnmap", (t.ptr, t.gpu_bytes)),
        ("cuMemRelease", (host_handle,)),
        ("cuMemRelease", (dev_handle,)),
        ("cuMemAddressFree", (t.ptr, t.size)),
    ]
    fake.assert_clean()
    assert t.closed
    n = len(fake.calls)
    t.close()  # idempotent
    assert len(fake.calls) == n
    with pytest.raises(vmm.VmmError, match="closed"):
        t.view(vmm.torch.uint8)


def test_context_manager_closes(fake):
    with _table() as t:
        assert fake.mappings
    assert t.closed
    fake.assert_clean()


def test_context_manager_closes_on_exception(fake):
    with pytest.raises(KeyError), _table():
        raise KeyError("boom")
    fake.assert_clean()


def test_all_rows_on_gpu_creates_no_host_memory(fake):
    t = _table(gpu_bytes=100 * ROW)
    assert t.host_bytes == 0 and t.gpu_bytes == t.size
    assert t.gpu_rows == 10 and t.host_rows == 0
    assert len(fake.args_of("cuMemCreate")) == 1
    assert fake.handles[fake.created[0]][1] == DEVICE_LOC
    t.close()
    fake.assert_clean()


def test_gpu_part_below_one_granule_is_all_host(fake):
    t = _table(gpu_bytes=GRAN - 1)
    assert t.gpu_bytes == 0 and t.gpu_rows == 0 and t.host_rows == 10
    ((size, prop, _),) = fake.args_of("cuMemCreate")
    assert size == t.size and prop.location.type == HOST_NUMA_LOC
    assert fake.args_of("cuMemMap")[0][0] == t.ptr
    t.close()
    fake.assert_clean()


def test_gpu_bytes_between_total_and_rounded_total(fake):
    # 10 rows end mid-granule; asking for exactly the rows' bytes keeps the last
    # granule (partly used) on the host rather than growing VRAM.
    t = _table(gpu_bytes=10 * ROW)
    assert t.gpu_bytes == 10 * ROW // GRAN * GRAN <= 10 * ROW
    assert t.host_bytes == GRAN
    assert t.gpu_rows == t.gpu_bytes // ROW
    t.close()


def test_granularity_is_the_larger_of_device_and_host(monkeypatch, fake):
    fake.host_gran = 4 * MiB
    assert vmm.granularity(DEVICE) == 4 * MiB
    t = _table(gpu_bytes=5 * MiB)
    assert t.granularity == 4 * MiB and t.gpu_bytes == 4 * MiB
    assert t.size % (4 * MiB) == 0
    t.close()
    fake.host_gran = 64 * 1024
    assert vmm.granularity(DEVICE) == GRAN


def test_host_memory_on_the_gpus_numa_node(fake):
    fake.attributes[134] = 1
    t = _table()
    assert t.numa_node == 1
    assert fake.args_of("cuMemCreate")[1][1].location.id == 1
    t.close()


@pytest.mark.parametrize("numa_id", [-1, None])
def test_numa_node_0_without_numa(fake, numa_id):
    if numa_id is None:
        fake.fail["cuDeviceGetAttribute"] = {1: CUresult.CUDA_ERROR_INVALID_VALUE}
    else:
        fake.attributes[134] = numa_id
    assert vmm.host_numa_node(DEVICE) == 0


def test_explicit_numa_node(fake):
    t = _table(numa_node=3)
    assert fake.args_of("cuMemCreate")[1][1].location.id == 3
    t.close()


def test_no_host_numa_vmm_support_creates_nothing(fake):
    fake.attributes[141] = 0
    with pytest.raises(vmm.VmmError, match="VLLM_EXPERT_ONE_TABLE=0") as e:
        _table()
    assert "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED" in str(e.value)
    assert not fake.created and not fake.reserved
    # an all-GPU table does not need it
    _table(gpu_bytes=100 * ROW).close()
    fake.assert_clean()


def test_primary_context_made_current_when_none(fake):
    fake.context = 0
    t = _table()
    assert "cuDevicePrimaryCtxRetain" in fake.names()
    assert fake.context == 7
    t.close()


def test_bad_arguments(fake):
    with pytest.raises(ValueError):
        _table(rows=0)
    with pytest.raises(ValueError):
        _table(gpu_bytes=-1)
    t = _table()
    with pytest.raises(ValueError, match="not one row"):
        t.row_view(vmm.torch.int32, (ROW // 4 + 1,))
    with pytest.raises(ValueError, match="offset"):
        t.view(vmm.torch.int32, (4,), offset=2)
    with pytest.raises(ValueError, match="needs"):
        t.view(vmm.torch.uint8, (t.nbytes,), offset=1)
    t.close()


# ---------------------------------------------------------------------------
# failures halfway release everything created before them

CONSTRUCTION_STEPS = [
    "cuInit",
    "cuMemGetAllocationGranularity[device]",
    "cuMemGetAllocationGranularity[host]",
    "cuMemAddressReserve",
    "cuMemCreate[device]",
    "cuMemMap[device]",
    "cuMemSetAccess[device]",
    "cuMemCreate[host]",
    "cuMemMap[host]",
    "cuMemSetAccess[host]",
]


@pytest.mark.parametrize("label", CONSTRUCTION_STEPS)
@pytest.mark.parametrize("how", ["env", "hook"])
def test_injected_failure_releases_everything(fake, monkeypatch, label, how):
    if how == "env":
        monkeypatch.setenv(vmm.FAIL_AT_ENV, f"somethingElse, {label}")
    else:
        vmm.FAIL_AT.add(label)
    with pytest.raises(vmm.VmmError) as e:
        _table()
    assert e.value.call == label
    assert label in str(e.value) and "injected" in str(e.value)
    fake.assert_clean()
    # the refused call was not made; for a host step, the device part's call was
    fn = label.split("[")[0]
    assert fake.names().count(fn) == (1 if label.endswith("[host]") else 0)


# (driver function, which call of it fails, CUresult) for failures the driver reports
DRIVER_FAILURES = [
    ("cuMemAddressReserve", 1, CUresult.CUDA_ERROR_OUT_OF_MEMORY),
    ("cuMemCreate", 1, CUresult.CUDA_ERROR_OUT_OF_MEMORY),
    ("cuMemMap", 1, CUresult.CUDA_ERROR_INVALID_VALUE),
    ("cuMemSetAccess", 1, CUresult.CUDA_ERROR_INVALID_VALUE),
    ("cuMemCreate", 2, CUresult.CUDA_ERROR_OUT_OF_MEMORY),
    ("cuMemMap", 2, CUresult.CUDA_ERROR_NOT_SUPPORTED),
    ("cuMemSetAccess", 2, CUresult.CUDA_ERROR_NOT_SUPPORTED),
]


@pytest.mark.parametrize(("fn", "nth", "code"), DRIVER_FAILURES)
def test_driver_failure_releases_everything(fake, fn, nth, code):
    fake.fail[fn] = {nth: code}
    with pytest.raises(vmm.VmmError) as e:
        _table()
    assert e.value.code == int(code)
    assert e.value.call.startswith(fn)
    assert code.name in str(e.value)
    assert "[host]" in e.value.call if nth == 2 else True
    fake.assert_clean()


def test_host_failure_message_names_call_and_fix(fake):
    fake.fail["cuMemCreate"] = {2: CUresult.CUDA_ERROR_OUT_OF_MEMORY}
    with pytest.raises(vmm.VmmError) as e:
        _table()
    msg = str(e.value)
    assert msg.startswith("cuMemCreate[host] failed with CUDA_ERROR_OUT_OF_MEMORY")
    assert "ulimit -l" in msg and "VLLM_EXPERT_ONE_TABLE=0" in msg


def test_close_goes_on_past_a_failed_release(fake):
    t = _table()
    start = len(fake.calls)
    fake.fail["cuMemUnmap"] = {fake.counts.get("cuMemUnmap", 0) + 1: CUresult(1)}
    with pytest.raises(vmm.VmmError, match=r"cuMemUnmap\[host\]") as e:
        t.close()
    names = fake.names(start)
    assert "cuMemUnmap[host]" in str(e.value) and "process exits" in str(e.value)
    assert names.count("cuMemUnmap") == 2
    assert names.count("cuMemRelease") == 2
    assert names[-1] == "cuMemAddressFree"
    assert t.closed
    n = len(fake.calls)
    t.close()
    assert len(fake.calls) == n


def test_repeated_create_close_leaves_nothing(fake):
    for i in range(50):
        with _table(gpu_bytes=i * MiB):
            pass
    fake.assert_clean()
    assert len(fake.created) > 50


# ---------------------------------------------------------------------------
# probe, _check, driver loading


@pytest.mark.parametrize("label", ["cuMemCreate[host]", "cuMemMap", "cuMemSetAccess[host]"])
def test_probe_reports_refusal_without_raising(fake, monkeypatch, label):
    monkeypatch.setenv(vmm.FAIL_AT_ENV, label)
    reason = vmm.probe_host_mapping(DEVICE)
    assert isinstance(reason, str) and label in reason
    fake.assert_clean()
    # the probe maps host memory only: 4 MiB, one host allocation
    assert fake.args_of("cuMemAddressReserve")[0][0] == vmm.PROBE_BYTES


def test_probe_reports_driver_error(fake):
    fake.fail["cuMemCreate"] = {1: CUresult.CUDA_ERROR_NOT_SUPPORTED}
    reason = vmm.probe_host_mapping(DEVICE)
    assert "cuMemCreate[host]" in reason and "CUDA_ERROR_NOT_SUPPORTED" in reason
    fake.assert_clean()


def test_check_unpacks_results(fake):
    assert vmm._check("x", (CUresult.CUDA_SUCCESS,)) is None
    assert vmm._check("x", (CUresult.CUDA_SUCCESS, 5)) == 5
    assert vmm._check("x", (CUresult.CUDA_SUCCESS, 5, 6)) == (5, 6)
    assert vmm._check("x", CUresult.CUDA_SUCCESS) is None
    with pytest.raises(vmm.VmmError, match="cuFoo failed with CUDA_ERROR_INVALID_VALUE"):
        vmm._check("cuFoo", (CUresult.CUDA_ERROR_INVALID_VALUE, 0))


def test_bare_name_injects_every_labelled_call(fake, monkeypatch):
    monkeypatch.setenv(vmm.FAIL_AT_ENV, "cuMemCreate")
    with pytest.raises(vmm.VmmError) as e:
        _table()
    assert e.value.call == "cuMemCreate[device]"
    fake.assert_clean()


def test_missing_cuda_python_names_the_fix(monkeypatch):
    monkeypatch.setattr(vmm, "_driver_module", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(vmm.VmmError, match="pip install cuda-bindings"):
        vmm._driver()
    assert vmm.probe_host_mapping(DEVICE) is not None


def test_one_table_puts_every_gpu_row_of_every_tensor_in_vram(fake, monkeypatch):
    """One table's allocator rounds each tensor's VRAM part up, not down: with small rows
    (a layer's scales, 25,600 B here) rounding 461 rows' bytes down to the granularity
    would leave the last 52 of them in host memory, read over PCIe but counted as VRAM
    rows by the swap policy and the counters. Where the host rows fit in that rounding
    up, the whole tensor stays in VRAM (a plain tensor): never more VRAM than the
    rounded-up GPU part, and no host memory."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    monkeypatch.setattr(vmm.SplitTable, "row_view", lambda self, dtype, shape: None)
    empty = torch.empty
    devices = []

    def cpu_empty(shape, dtype, device):  # the CPU stands in for the GPU's VRAM
        devices.append(device)
        return empty(shape, dtype=dtype)

    monkeypatch.setattr(torch, "empty", cpu_empty)
    row, g = 10 * 1280 * 2, 461  # bf16 [10, 1280]
    assert g * row // GRAN * GRAN // row == 409  # what rounding down would keep
    cases = {  # rows, gpu rows -> kept whole in VRAM
        (512, g): False,  # 51 host rows (1.3 MB) > the rounding (0.78 MB)
        (512, 500): True,  # 12 host rows (0.3 MB) < the rounding (1.9 MB)
        (512, 0): False,  # all host
        (512, 512): True,
        (3, 1): True,
    }
    for (rows, gpu_rows), whole in cases.items():
        table, t = one_table.vmm_allocator(
            rows, gpu_rows, (10, 1280), torch.bfloat16, torch.device("cuda", 0)
        )
        rounded_up = _round_up(gpu_rows * row, GRAN)
        assert isinstance(t, one_table.VramRows) is whole, (rows, gpu_rows)
        assert t.gpu_rows >= gpu_rows
        assert t.gpu_bytes <= rounded_up  # at most one granule over the rows
        if whole:
            assert (t.gpu_rows, t.gpu_bytes, t.host_bytes) == (rows, rows * row, 0)
            assert table.shape == (rows, 10, 1280) and table is t.table
            assert devices.pop() == torch.device("cuda", 0)
        else:
            assert t.gpu_bytes == rounded_up
            assert t.gpu_bytes + t.host_bytes == _round_up(rows * row, GRAN)
        t.close()
    assert not devices
    fake.assert_clean()
