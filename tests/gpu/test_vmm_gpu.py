# SPDX-License-Identifier: Apache-2.0
"""vmm.py on a real GPU: mapping, Triton reads across the VRAM/host boundary,
release, granularity rounding, and the fallback when the driver refuses a step.

    scripts/test-gpu tests/gpu/test_vmm_gpu.py -s   (docs/developing.md, "GPU tests")

Run with -s to see the measured numbers (granularity, NUMA node, VRAM deltas).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from eodev.host_read import EXPERT_BYTES  # one INT4 expert of the target model
from vllm.model_executor.layers.fused_moe.expert_offload import vmm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@triton.jit
def _row_sums_kernel(
    src_ptr,
    idx_ptr,
    out_ptr,
    row_bytes,
    n_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[k, c] = sum of bytes [c*CHUNK, (c+1)*CHUNK) of row idx[k]."""
    k = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(idx_ptr + k).to(tl.int64)
    base = src_ptr + row * row_bytes
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + i + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < row_bytes, other=0)
        acc += x.to(tl.int32)
    tl.store(out_ptr + k * n_chunks + c, tl.sum(acc, axis=0))


def _triton_row_sums(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-row byte sums of table[idx] (uint8 [rows, row_bytes]) by a Triton kernel."""
    row_bytes = table.shape[1]
    chunk, block = 64 * 1024, 1024
    n_chunks = triton.cdiv(row_bytes, chunk)
    out = torch.zeros((idx.numel(), n_chunks), dtype=torch.int32, device=table.device)
    _row_sums_kernel[(idx.numel(), n_chunks)](
        table, idx, out, row_bytes, n_chunks, CHUNK=chunk, BLOCK=block
    )
    return out.sum(1, dtype=torch.int64)


@pytest.fixture(autouse=True)
def _no_injection(monkeypatch):
    monkeypatch.delenv(vmm.FAIL_AT_ENV, raising=False)
    monkeypatch.setattr(vmm, "FAIL_AT", set())


@pytest.fixture(scope="module")
def dev() -> int:
    index = torch.cuda.current_device()
    torch.zeros(1, device=index)  # CUDA context up
    # Warm up everything the VRAM measurements touch (lazy module loading, the
    # driver's first VMM bookkeeping) so that it is not counted as a leak.
    with vmm.SplitTable(4, EXPERT_BYTES, EXPERT_BYTES, device=index) as t:
        _exercise(t)
    return index


@pytest.fixture(scope="module")
def gran(dev) -> int:
    g = vmm.granularity(dev)
    print(
        f"\n[vmm] GPU {dev} {torch.cuda.get_device_name(dev)}: granularity {g} B, "
        f"host NUMA node {vmm.host_numa_node(dev)}"
    )
    return g


def _free_vram(device: int) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _exercise(t: vmm.SplitTable) -> None:
    """Touch every byte of the table from the GPU, allocating nothing that stays."""
    v = t.view(torch.uint8, (t.nbytes,))
    v.fill_(1)
    assert int(v.sum(dtype=torch.int64)) == t.nbytes
    del v


def test_granularity(gran):
    assert gran > 0 and gran & (gran - 1) == 0


def test_probe_ok(dev):
    assert vmm.probe_host_mapping(dev) is None


def test_mapping_patterns(dev, gran):
    rows = 8
    with vmm.SplitTable(rows, EXPERT_BYTES, 3 * EXPERT_BYTES, device=dev) as t:
        print(f"[vmm] {t}")
        assert 0 < t.gpu_rows < rows and t.host_rows == rows - t.gpu_rows
        tab = t.row_view(torch.uint8, (EXPERT_BYTES,))
        assert tab.device == torch.device("cuda", dev)
        assert tab.data_ptr() == t.ptr and tab.shape == (rows, EXPERT_BYTES)

        # a constant per row, written and summed by torch kernels on the GPU
        for r in range(rows):
            tab[r].fill_(r * 31 + 7)
        sums = tab.sum(1, dtype=torch.int64).cpu()
        assert sums.tolist() == [(r * 31 + 7) % 256 * EXPERT_BYTES for r in range(rows)]

        # random bytes copied in from the CPU, read back
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (rows, EXPERT_BYTES), dtype=torch.uint8, generator=g)
        tab.copy_(data)
        assert torch.equal(tab.cpu(), data)

        # int32 words across the whole range, boundary included
        n = t.nbytes // 4
        words = t.view(torch.int32, (n,))
        words.copy_(torch.arange(n, dtype=torch.int32, device=dev))
        back = words.cpu()
        assert torch.equal(back, torch.arange(n, dtype=torch.int32))
        edge = t.gpu_bytes // 4
        assert back[edge - 2 : edge + 2].tolist() == list(range(edge - 2, edge + 2))

        # views at an offset inside the host part
        off = t.gpu_bytes + 4096
        tail = t.view(torch.bfloat16, (1024,), offset=off)
        tail.fill_(1.5)
        assert float(tail.float().sum()) == 1536.0
        assert int(t.view(torch.uint8, (2,), offset=off)[1]) == 0x3F  # bf16 1.5
        del tab, words, tail


def test_triton_reads_across_boundary(dev):
    rows = 8
    with vmm.SplitTable(rows, EXPERT_BYTES, 3 * EXPERT_BYTES, device=dev) as t:
        # the straddling row has bytes on both sides
        assert t.gpu_rows * EXPERT_BYTES < t.gpu_bytes < (t.gpu_rows + 1) * EXPERT_BYTES
        tab = t.row_view(torch.uint8, (EXPERT_BYTES,))
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 256, (rows, EXPERT_BYTES), dtype=torch.uint8, generator=g)
        tab.copy_(data)
        idx = torch.randperm(rows, generator=g)
        got = _triton_row_sums(tab, idx.to(dev)).cpu()
        assert torch.equal(got, data.to(torch.int64).sum(1)[idx])
        # and the GPU writes a host row that the kernel then reads
        tab[rows - 1].fill_(2)
        last = torch.tensor([rows - 1], device=dev)
        assert int(_triton_row_sums(tab, last)) == 2 * EXPERT_BYTES
        del tab


def test_triton_reads_host_only_table(dev):
    """A table with no GPU rows: the tensor's pointer is host-NUMA memory.

    A failure here (e.g. Triton's launcher: "Pointer argument cannot be accessed
    from Triton (cpu tensor?)") means kernels must get a table base that starts in
    VRAM, or the address as a plain integer.
    """
    with vmm.SplitTable(3, EXPERT_BYTES, 0, device=dev) as t:
        assert t.gpu_bytes == 0 and t.gpu_rows == 0 and t.host_rows == 3
        tab = t.row_view(torch.uint8, (EXPERT_BYTES,))
        assert tab.data_ptr() == t.ptr
        tab.fill_(3)
        idx = torch.arange(3, device=dev)
        assert _triton_row_sums(tab, idx).tolist() == [3 * EXPERT_BYTES] * 3
        del tab


def test_vram_use_is_the_gpu_part(dev, gran):
    free0 = _free_vram(dev)
    t = vmm.SplitTable(64, EXPERT_BYTES, 8 * EXPERT_BYTES, device=dev)
    try:
        _exercise(t)
        drop = free0 - _free_vram(dev)
        print(f"[vmm] VRAM drop {drop} B for gpu_bytes {t.gpu_bytes}, host_bytes {t.host_bytes}")
        assert t.gpu_bytes - gran <= drop <= t.gpu_bytes + 2 * gran
        assert t.host_bytes > 4 * gran  # so the host part would have shown
    finally:
        t.close()
    assert abs(free0 - _free_vram(dev)) <= gran


def test_release_and_no_leak_over_50(dev, gran):
    free0 = _free_vram(dev)
    t = vmm.SplitTable(32, EXPERT_BYTES, 16 * EXPERT_BYTES, device=dev)
    _exercise(t)
    t.close()
    assert t.closed
    t.close()  # idempotent
    with pytest.raises(vmm.VmmError, match="closed"):
        t.view(torch.uint8)
    assert abs(free0 - _free_vram(dev)) <= gran
    for i in range(50):
        with vmm.SplitTable(16, EXPERT_BYTES, (i % 9) * EXPERT_BYTES, device=dev) as t:
            _exercise(t)
    free1 = _free_vram(dev)
    print(f"[vmm] free VRAM before {free0} B, after 51 tables {free1} B")
    assert abs(free0 - free1) <= gran


def test_granularity_rounding(dev, gran):
    rows = 10
    want = 5 * gran + 12345
    free0 = _free_vram(dev)
    with vmm.SplitTable(rows, EXPERT_BYTES, want, device=dev) as t:
        assert t.gpu_bytes == 5 * gran <= want
        assert t.gpu_bytes % gran == 0 and t.size % gran == 0
        assert t.nbytes <= t.size < t.nbytes + gran
        assert t.host_bytes == t.size - t.gpu_bytes
        assert t.gpu_rows == 5 * gran // EXPERT_BYTES
        assert t.host_rows == rows - t.gpu_rows
        drop = free0 - _free_vram(dev)
        assert t.gpu_bytes - gran <= drop <= t.gpu_bytes + 2 * gran
    with vmm.SplitTable(rows, EXPERT_BYTES, gran - 1, device=dev) as t:
        assert t.gpu_bytes == 0 and t.gpu_rows == 0
        _exercise(t)
    with vmm.SplitTable(rows, EXPERT_BYTES, 100 * rows * EXPERT_BYTES, device=dev) as t:
        assert t.host_bytes == 0 and t.host_rows == 0 and t.gpu_rows == rows
        _exercise(t)


@pytest.mark.parametrize(
    "label",
    [
        "cuMemCreate[host]",
        "cuMemMap[host]",
        "cuMemSetAccess[host]",
        "cuMemMap[device]",
        "cuMemAddressReserve",
    ],
)
def test_fallback_on_injected_failure(dev, gran, monkeypatch, label):
    free0 = _free_vram(dev)
    monkeypatch.setenv(vmm.FAIL_AT_ENV, label)
    with pytest.raises(vmm.VmmError) as e:
        vmm.SplitTable(16, EXPERT_BYTES, 8 * EXPERT_BYTES, device=dev)
    assert e.value.call == label and label in str(e.value)
    assert vmm._fix(label) in str(e.value)  # names the fix too
    # the device part created before the failure is gone
    assert abs(free0 - _free_vram(dev)) <= gran
    reason = vmm.probe_host_mapping(dev)
    if label.endswith("[device]"):
        assert reason is None  # the probe maps host memory only
    else:
        assert isinstance(reason, str) and label in reason
        print(f"[vmm] probe with {label} refused: {reason}")
    monkeypatch.delenv(vmm.FAIL_AT_ENV)
    # nothing is left broken: the probe and a table work again
    assert vmm.probe_host_mapping(dev) is None
    with vmm.SplitTable(16, EXPERT_BYTES, 8 * EXPERT_BYTES, device=dev) as t:
        _exercise(t)
    assert abs(free0 - _free_vram(dev)) <= gran


def test_real_refusal_releases_device_part(dev, gran):
    """A host-NUMA node that does not exist: the driver itself refuses."""
    free0 = _free_vram(dev)
    try:
        t = vmm.SplitTable(16, EXPERT_BYTES, 8 * EXPERT_BYTES, device=dev, numa_node=4093)
    except vmm.VmmError as e:
        print(f"[vmm] NUMA node 4093 refused: {e}")
        assert e.call in ("cuMemGetAllocationGranularity[host]", "cuMemCreate[host]")
        assert e.code is not None
    else:
        t.close()
        pytest.skip("the driver accepted host NUMA node 4093")
    assert abs(free0 - _free_vram(dev)) <= gran
    assert vmm.probe_host_mapping(dev) is None  # the context is still usable
