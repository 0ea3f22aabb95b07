# SPDX-License-Identifier: Apache-2.0
"""Prefill staging of one-table layers (offload-03, VLLM_EXPERT_PREFILL_STAGING) on the CPU:
the series' OneTableStaging and vmm.AliasRange against the fake CUDA driver of
test_vmm_driver_calls.py (the `fake` fixture, conftest.py). Checks the second range each
staged weight gets (the table's own VRAM part, then the slot of the layer's parity), slots
that grow to the largest host part, a refused mapping that turns staging off and leaves
nothing behind, the copies (each weight's host rows into its slot), and that a swap
decision makes the next prefill copy again. That the kernel reads the same bytes through
the second range needs a GPU (tests/gpu/test_prefill_staging_one_table_gpu.py).

    scripts/test tests/cpu/test_prefill_staging_one_table.py
"""

from __future__ import annotations

import types

import pytest
import torch
from test_prefill_staging import Recorder
from test_vmm_driver_calls import GRAN, MiB
from vllm.model_executor.layers.fused_moe.expert_offload import vmm

DEVICE = 0
W13_ROW, W2_ROW = 3 * MiB + 4096, 1536 * 1024  # bytes of one expert's row in each table


@pytest.fixture
def staging(fake, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import prefill_staging

    rec = Recorder()
    rec.install(monkeypatch)
    s = prefill_staging.OneTableStaging(64)
    yield s, rec
    s.close()


class _Weight:
    """What OneTableStaging reads of a layer's weight: where it starts, its form."""

    def __init__(self, table: vmm.SplitTable, row: int) -> None:
        self._ptr = table.ptr
        self.dtype = torch.int32
        self.shape = (table.rows, row // 4)

    def data_ptr(self) -> int:
        return self._ptr


def layer(name: str, rows: int = 64, gpu_rows: int = 56, whole: tuple[str, ...] = ()):
    """A one-table layer's two weight tables (VMM ranges through the fake driver; those
    named in `whole` all in VRAM) and the module and one_table.OneTable fields staging
    reads."""

    def table(weight: str, row: int) -> vmm.SplitTable:
        vram = rows * row + GRAN if weight in whole else gpu_rows * row
        return vmm.SplitTable(rows, row, vram, device=DEVICE)

    w13, w2 = table("w13", W13_ROW), table("w2", W2_ROW)
    module = types.SimpleNamespace(
        layer_name=name, w13_weight=_Weight(w13, W13_ROW), w2_weight=_Weight(w2, W2_ROW), top_k=2
    )
    one = types.SimpleNamespace(owners=[w13, w2, object()], host_rows=rows - gpu_rows)
    return module, one, (w13, w2)


def _close(*tables) -> None:
    for t in tables:
        t.close()


def test_an_alias_maps_another_ranges_vram_then_a_slot_and_owns_neither(fake):
    table = vmm.SplitTable(10, W13_ROW, 4 * W13_ROW, device=DEVICE)
    block = vmm.SplitTable(1, table.host_bytes, table.host_bytes, device=DEVICE)
    created = list(fake.created)
    alias = vmm.AliasRange(
        [(table.device_handle(), table.gpu_bytes), (block.device_handle(), table.host_bytes)],
        device=DEVICE,
    )
    assert fake.created == created  # no memory of its own
    assert alias.size == table.size and fake.reserved[alias.ptr] == table.size
    assert fake.mappings[alias.ptr] == (table.gpu_bytes, table.device_handle())
    assert fake.mappings[alias.ptr + table.gpu_bytes] == (table.host_bytes, block.device_handle())
    assert [a[0] for a in fake.access[-2:]] == [alias.ptr, alias.ptr + table.gpu_bytes]
    alias.close()
    assert alias.ptr not in fake.reserved
    assert fake.mappings[table.ptr] == (table.gpu_bytes, table.device_handle())  # intact
    assert fake.released == []
    _close(block, table)
    fake.assert_clean()


def test_an_alias_refused_by_the_driver_leaves_nothing_and_names_the_setting(fake, monkeypatch):
    table = vmm.SplitTable(10, W13_ROW, 4 * W13_ROW, device=DEVICE)
    block = vmm.SplitTable(1, table.host_bytes, table.host_bytes, device=DEVICE)
    monkeypatch.setattr(vmm, "FAIL_AT", {"cuMemMap[alias]"})
    with pytest.raises(vmm.VmmError, match="VLLM_EXPERT_PREFILL_STAGING=0"):
        vmm.AliasRange(
            [(table.device_handle(), table.gpu_bytes), (block.device_handle(), GRAN)],
            device=DEVICE,
        )
    assert len(fake.reserved) == 2 and len(fake.mappings) == 3  # the two owners' only
    with pytest.raises(ValueError, match="multiples of"):
        vmm.AliasRange([(block.device_handle(), GRAN + 1)], device=DEVICE)
    _close(block, table)
    fake.assert_clean()


def test_each_layer_reads_its_vram_then_the_slot_of_its_parity(staging, fake):
    s, _ = staging
    layers = [layer(f"layers.{i}.mlp.experts") for i in range(2)]
    for module, table, _ in layers:
        assert s.register(module, table)
    w13, w2 = layers[0][2]
    assert s._block_bytes == [w13.host_bytes, w2.host_bytes]
    assert s.slot_bytes == w13.host_bytes + w2.host_bytes
    for i, (module, _, tables) in enumerate(layers):
        for alias, t, block in zip(
            s._aliases[module.layer_name], tables, s._blocks[i % 2], strict=True
        ):
            assert alias.size == t.size
            assert fake.mappings[alias.ptr] == (t.gpu_bytes, t.device_handle())
            assert fake.mappings[alias.ptr + t.gpu_bytes] == (t.host_bytes, block.device_handle())
    s.close()
    for _, _, tables in layers:
        _close(*tables)
    fake.assert_clean()


def test_slots_grow_to_the_largest_host_part_and_every_layer_follows(staging, fake):
    s, _ = staging
    small = layer("layers.0.mlp.experts", gpu_rows=60)
    large = layer("layers.1.mlp.experts", gpu_rows=40)
    assert s.register(*small[:2])
    old = [b.device_handle() for b in s._blocks[0] + s._blocks[1]]
    assert s.register(*large[:2])
    assert s._block_bytes == [large[2][0].host_bytes, large[2][1].host_bytes]
    assert set(old) <= set(fake.released)  # the small slots went first
    expected = (("layers.0.mlp.experts", small[2], 0), ("layers.1.mlp.experts", large[2], 1))
    for name, tables, slot in expected:
        for alias, t, block in zip(s._aliases[name], tables, s._blocks[slot], strict=True):
            assert fake.mappings[alias.ptr + t.gpu_bytes] == (t.host_bytes, block.device_handle())
    s.close()
    _close(*small[2], *large[2])
    fake.assert_clean()


def test_weights_whole_in_vram_are_not_staged(staging, fake):
    s, _ = staging
    module, table, tables = layer("layers.0.mlp.experts", whole=("w2",))
    assert tables[1].host_bytes == 0
    assert s.register(module, table)
    assert [p.name for p in s._parts["layers.0.mlp.experts"]] == ["w13_weight"]
    # another count of staged weights than the layers before: left unstaged (a log line)
    both = layer("layers.1.mlp.experts")
    assert not s.register(*both[:2])
    none = layer("layers.2.mlp.experts", whole=("w13", "w2"))
    assert not s.register(*none[:2])  # nothing on host
    assert s.order == ["layers.0.mlp.experts"]
    s.close()
    _close(*tables, *both[2], *none[2])
    fake.assert_clean()


def test_a_refused_mapping_turns_staging_off_and_frees_its_vram(staging, fake, monkeypatch):
    s, _ = staging
    first = layer("layers.0.mlp.experts")
    second = layer("layers.1.mlp.experts")
    assert s.register(*first[:2])
    monkeypatch.setattr(vmm, "FAIL_AT", {"cuMemMap[alias]"})
    assert not s.register(*second[:2])
    monkeypatch.setattr(vmm, "FAIL_AT", set())
    assert s.slot_bytes == 0 and not s._aliases and s._blocks == [[], []]
    assert s.staged("layers.0.mlp.experts", 4096) is None  # reads host rows as before
    assert not s.register(*layer("layers.2.mlp.experts")[:2])  # stays off
    _close(*first[2], *second[2])


def test_a_swap_decision_makes_the_next_prefill_copy_again(staging, fake, monkeypatch):
    from vllm.model_executor.layers.fused_moe.expert_offload import swap_runtime

    s, rec = staging
    runtime = types.SimpleNamespace(decisions=0)
    monkeypatch.setattr(swap_runtime, "get_runtime", lambda: runtime)
    copies: list[tuple[int, int, int]] = []  # (destination, source, bytes)

    class View:
        """Where a view of a range starts and how long it is, and the copies into it."""

        def __init__(self, table, dtype, shape=None, offset=0):
            self.ptr, self.n = table.ptr + offset, (shape or (0,))[0]

        def copy_(self, src, non_blocking=False):
            assert non_blocking and src.n == self.n
            copies.append((self.ptr, src.ptr, self.n))

    monkeypatch.setattr(vmm.SplitTable, "view", lambda self, *a, **k: View(self, *a, **k))
    layers = [layer(f"layers.{i}.mlp.experts") for i in range(2)]
    for module, table, _ in layers:
        s.register(module, table)
    names = [m.layer_name for m, _, _ in layers]
    assert s.staged(names[0], 4096) is None  # nothing queued ahead: reads host rows
    view = s.staged(names[1], 4096)
    assert isinstance(view.w13_weight, View) and view.layer_name == names[1]
    # layer 1 ahead of its forward, then layer 0 for the next chunk: each weight's host
    # rows, from the table's host part into the slot of its parity
    assert s.copies == 2 and len(copies) == 4
    w13, w2 = layers[1][2]
    assert copies[0:2] == [
        (s._blocks[1][0].ptr, w13.ptr + w13.gpu_bytes, w13.nbytes - w13.gpu_bytes),
        (s._blocks[1][1].ptr, w2.ptr + w2.gpu_bytes, w2.nbytes - w2.gpu_bytes),
    ]
    assert s.staged(names[0], 4096) is not None
    assert s.staged(names[1], 4096) is not None
    assert s.copies == 2  # both still held: the next prefill copies nothing
    runtime.decisions += 1  # rows may have moved: what the slots hold is stale
    assert s.staged(names[0], 4096) is None  # stale: host rows, and layer 1 ahead
    assert s.copies == 3
    assert s.staged(names[1], 4096) is not None and s.copies == 4
    s.close()
    for _, _, tables in layers:
        _close(*tables)
