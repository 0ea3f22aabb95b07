# SPDX-License-Identifier: Apache-2.0
"""What the preflight asks the GPUs: which are visible and how much memory they have, and
whether the driver lets them read host memory the two ways the series uses.

- cudaHostRegister (offload-01/02): page-lock host memory and read it through a device
  address. If this is refused, expert offload cannot run at all.
- cuMemCreate with CU_MEM_LOCATION_TYPE_HOST_NUMA mapped into a reserved VA range (offload-03's
  one table across VRAM and host): if refused, the series falls back to the split path.

Both probes take 4 MiB and give it back. The CUDA bindings are parameters so that tests can
hand in fakes; by default they come from PyTorch and cuda-python.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

PROBE_BYTES = 4 << 20
# the series' fault injection (tests only): the named VMM driver calls fail on purpose, in
# vLLM and here alike, so that the preflight predicts what vLLM will do
FAIL_AT_ENV = "VLLM_EXPERT_VMM_FAIL_AT"
# the labels vLLM's VMM wrapper gives the calls of its host-mapping probe (a host-only
# range); the calls only a layer's merge makes (its VRAM part) or prefill staging's
# second mapping make come after it
PROBE_LABELS = {
    "cuMemGetAllocationGranularity": "cuMemGetAllocationGranularity[host]",
    "cuMemCreate": "cuMemCreate[host]",
    "cuMemAddressReserve": "cuMemAddressReserve",
    "cuMemMap": "cuMemMap[host]",
    "cuMemSetAccess": "cuMemSetAccess[host]",
}
MERGE_LABELS = ("cuMemCreate[device]", "cuMemMap[device]", "cuMemSetAccess[device]")
ALIAS_LABELS = ("cuMemMap[alias]", "cuMemSetAccess[alias]")
PAGE = 4096
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # the flags host_memory.HostArena uses
_PATTERN = 0x5A


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int | None


@dataclass(frozen=True)
class Probe:
    """Outcome of one host-mapping probe: works, refused (with why), or could not be tried."""

    name: str
    works: bool | None  # None: not tried (no bindings, no GPU)
    detail: str


def query_gpus() -> tuple[list[Gpu], str]:
    """The visible GPUs, and how they were found (or why none could be listed)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(Gpu(i, torch.cuda.get_device_name(i), int(total), int(free)))
        return gpus, "torch.cuda"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        why = "torch.cuda sees no GPU" if torch is not None else "torch is not installed"
        return [], f"{why} and nvidia-smi is not on PATH"
    r = subprocess.run(
        [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return [], f"nvidia-smi failed: {(r.stderr or r.stdout).strip()}"
    return parse_nvidia_smi(r.stdout, os.environ.get("CUDA_VISIBLE_DEVICES")), "nvidia-smi"


SMI_FIELDS = "index,uuid,name,memory.total,memory.free"


def parse_nvidia_smi(text: str, visible: str | None = None) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=SMI_FIELDS` (MiB, no units), in the order and selection
    of CUDA_VISIBLE_DEVICES (indices or UUIDs) where it is set, as CUDA would number them."""
    rows = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) != 5:
            continue
        index, uuid, name, total, free = (c.strip() for c in row)
        rows[index] = (uuid, name, int(total) << 20, int(free) << 20)
    order = list(rows)
    if visible is not None:
        order = []
        for want in filter(None, (v.strip() for v in visible.split(","))):
            match = [i for i, r in rows.items() if want == i or r[0].startswith(want)]
            if not match:
                break  # CUDA stops at the first entry it cannot find
            order.append(match[0])
    return [Gpu(n, *rows[i][1:]) for n, i in enumerate(order)]


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


def default_cudart() -> Any | None:
    """PyTorch's CUDA runtime bindings, where a GPU is usable; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.cudart() if torch.cuda.is_available() else None


def probe_host_register(
    cudart: Any | None = None, nbytes: int = PROBE_BYTES, read_back: bool | None = None
) -> Probe:
    """Page-lock `nbytes` of host memory with cudaHostRegister (as offload-01/02 do), read it
    back through the GPU where PyTorch can (by default only with the real runtime: a fake one
    registers nothing the GPU could read), and release it."""
    name = "cudaHostRegister"
    if read_back is None:
        read_back = cudart is None
    cudart = cudart if cudart is not None else default_cudart()
    if cudart is None:
        return Probe(name, None, "not tried: no CUDA runtime (torch.cuda sees no GPU)")
    buf = bytearray(nbytes + PAGE)
    pinned = (ctypes.c_char * len(buf)).from_buffer(buf)  # holds the buffer in place
    base = ctypes.addressof(pinned)
    ptr = base + (-base % PAGE)
    offset = ptr - base
    buf[offset : offset + nbytes] = bytes([_PATTERN]) * nbytes
    err = _code(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE_MAPPED))
    if err != 0:
        return Probe(name, False, f"refused {nbytes >> 20} MiB (cudaError {err})")
    try:
        seen = _read_through_gpu(ptr, nbytes) if read_back else None
    finally:
        cudart.cudaHostUnregister(ptr)
        del pinned
    if seen is not None and seen != _PATTERN * nbytes:
        return Probe(name, False, "the GPU read different bytes than were written to host memory")
    how = "read back through the GPU" if seen is not None else "registered"
    return Probe(name, True, f"{nbytes >> 20} MiB page-locked and {how}")


def _read_through_gpu(ptr: int, nbytes: int) -> int | None:
    """Sum of the bytes the GPU reads at host address `ptr` (unified addressing), or None
    where PyTorch cannot be used for it."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    class _Mapping:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }

    view = torch.as_tensor(_Mapping(), device="cuda")
    total = int(view.to(torch.int64).sum().item())
    del view
    torch.cuda.synchronize()
    return total


def default_driver() -> Any | None:
    """cuda-python's driver bindings (cuda.bindings.driver), or None if not importable."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def probe_vmm_host_numa(drv: Any | None = None, device: int = 0) -> Probe:
    """Create CU_MEM_LOCATION_TYPE_HOST_NUMA memory, map it into a reserved VA range with
    device access (the way offload-03 builds its one table), write and read it from the
    GPU, and release everything, whatever step fails."""
    name = "cuMemCreate(HOST_NUMA)"
    drv = drv if drv is not None else default_driver()
    if drv is None:
        return Probe(name, None, "not tried: cuda.bindings.driver (cuda-python) is not installed")
    cleanup: list[tuple[Any, tuple]] = []
    injected = injected_failures()

    def call(fn: str, *args: Any) -> Any:
        label = PROBE_LABELS.get(fn, fn)
        if label in injected or fn in injected:
            raise _DriverError(label, f"an injected error, {FAIL_AT_ENV}")
        out = getattr(drv, fn)(*args)
        err, rest = out[0], out[1:]
        if _code(err) != 0:
            raise _DriverError(fn, _error_name(drv, err))
        return rest[0] if len(rest) == 1 else rest

    try:
        call("cuInit", 0)
        dev = call("cuDeviceGet", device)
        ctx = call("cuDevicePrimaryCtxRetain", dev)
        cleanup.append(("cuDevicePrimaryCtxRelease", (dev,)))
        call("cuCtxSetCurrent", ctx)
        numa = call(
            "cuDeviceGetAttribute", drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev
        )
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        prop.location.id = max(int(numa), 0)
        gran = call(
            "cuMemGetAllocationGranularity",
            prop,
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        size = -(-PROBE_BYTES // int(gran)) * int(gran)
        handle = call("cuMemCreate", size, prop, 0)
        cleanup.append(("cuMemRelease", (handle,)))
        va = call("cuMemAddressReserve", size, 0, 0, 0)
        cleanup.append(("cuMemAddressFree", (va, size)))
        call("cuMemMap", va, size, 0, handle, 0)
        cleanup.append(("cuMemUnmap", (va, size)))
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        call("cuMemSetAccess", va, size, [access], 1)
        call("cuMemsetD8", va, _PATTERN, size)
        back = (ctypes.c_char * PAGE)()
        call("cuMemcpyDtoH", ctypes.addressof(back), va, PAGE)
        if any(b != _PATTERN for b in bytes(back)):
            return Probe(name, False, "mapped, but the GPU read back different bytes")
        return Probe(name, True, f"{size >> 20} MiB of host NUMA node {numa} mapped for the GPU")
    except _DriverError as e:
        return Probe(name, False, f"{e.fn} failed ({e.error})")
    except Exception as e:  # no driver library at all: the bindings raise, not return
        return Probe(name, False, f"{type(e).__name__}: {e}")
    finally:
        for fn, args in reversed(cleanup):
            # best effort: the process exits right after the preflight anyway
            with contextlib.suppress(Exception):
                getattr(drv, fn)(*args)


def injected_failures(environ: dict[str, str] | None = None) -> set[str]:
    """The driver calls VLLM_EXPERT_VMM_FAIL_AT makes fail (labels or bare names)."""
    env = os.environ if environ is None else environ
    return {n.strip() for n in env.get(FAIL_AT_ENV, "").split(",") if n.strip()}


def fails_at(labels: tuple[str, ...], injected: set[str]) -> list[str]:
    """Which of these labelled calls the injected set names, by label or bare name."""
    return [x for x in labels if x in injected or x.split("[", 1)[0] in injected]


class _DriverError(RuntimeError):
    def __init__(self, fn: str, error: str) -> None:
        super().__init__(f"{fn}: {error}")
        self.fn, self.error = fn, error


def _error_name(drv: Any, err: Any) -> str:
    try:
        _, text = drv.cuGetErrorName(err)
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        return f"CUresult {_code(err)}"


# --- in a child process -----------------------------------------------------------------------
# The image's start program runs the preflight in its own process and then execs `vllm serve`
# there. CUDA state made in that process (torch's contexts on every visible GPU, the driver's
# device files) must not be inherited by vLLM, so the start asks the GPUs from a child that
# exits before vLLM starts.

CHILD_TIMEOUT_S = 300.0


def _in_child(what: str, timeout_s: float) -> tuple[Any | None, str]:
    """`what` ("gpus" or "probes") from `python3 -m eotools.cuda_probe`; (result, "") or
    (None, why the child gave none)."""
    import json
    import sys

    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [scripts, os.environ.get("PYTHONPATH")])),
    }
    try:
        r = subprocess.run(
            [sys.executable, "-m", "eotools.cuda_probe", what],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None, f"the GPU query took more than {timeout_s:.0f} s"
    except OSError as e:
        return None, f"the GPU query could not start ({e.strerror})"
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
        return None, f"the GPU query died ({how}{': ' + tail if tail else ''})"
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, "the GPU query printed no answer"


def query_gpus_in_child(timeout_s: float = CHILD_TIMEOUT_S) -> tuple[list[Gpu], str]:
    """query_gpus() in a child process (above)."""
    got, why = _in_child("gpus", timeout_s)
    if got is None:
        return [], why
    return [Gpu(**g) for g in got["gpus"]], got["how"]


def probes_in_child(timeout_s: float = CHILD_TIMEOUT_S) -> list[Probe]:
    """The two host-mapping probes in a child process (above); a child that died is a
    refusal of both: vLLM would meet the same driver."""
    got, why = _in_child("probes", timeout_s)
    if got is None:
        return [Probe(n, False, why) for n in ("cudaHostRegister", "cuMemCreate(HOST_NUMA)")]
    return [Probe(**p) for p in got]


def _child_main(what: str) -> int:
    import dataclasses
    import json

    if what == "gpus":
        gpus, how = query_gpus()
        out: Any = {"gpus": [dataclasses.asdict(g) for g in gpus], "how": how}
    elif what == "probes":
        out = [dataclasses.asdict(p) for p in (probe_host_register(), probe_vmm_host_numa())]
    else:
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_child_main(sys.argv[1] if len(sys.argv) > 1 else ""))
