# SPDX-License-Identifier: Apache-2.0
"""The tools' side of VLLM_PLE_TABLE=file and auto: memory-plan counts both modes (page-locked
bytes; the page cache file mode wants, apart), the preflight decides auto as vLLM does against
given MemAvailable and container figures, and checks the table's bytes in the checkpoint's
safetensors files, naming the file and the fix for each way they can be wrong."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest
from eotools import preflight as pf
from eotools.memory_plan.estimate import Plan, make_plan
from eotools.memory_plan.model_shape import load_shape
from eotools.memory_plan.serving import Serving, usable_vram_bytes
from eotools.memory_plan.weights import estimate_weights
from eotools.ple_table import choose_placement, page_cache_wanted, ple_tables
from test_preflight import only, setup_for
from test_preflight_ple import TARGET_BYTES, qwen4exp

GiB = 1 << 30
REPO = pathlib.Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "cpu" / "data" / "qwen3.8-flash-next-int4"


# --- memory-plan ---------------------------------------------------------------------------


def plan(ple_table: str, **kw) -> Plan:
    shape = load_shape(TARGET / "config.json")
    serving = Serving(
        name="2x32GB",
        pp_size=2,
        usable_vram_bytes=usable_vram_bytes(32),
        max_model_len=kw.get("max_model_len", 262_144),
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=3_600_000_000,
        mamba_cache_mode="align",
        ple_table=ple_table,
        host_gib_per_card=7.6,
        layer_partition=None,
        prefill_staging=True,
        one_table=True,
    )
    return make_plan(shape, estimate_weights(shape), serving, model="target")


def test_memory_plan_counts_the_table_pinned_or_not_by_hand():
    host, file, auto = plan("host"), plan("file"), plan("auto")
    # one PLE layer: 320,001,536 rows x 160 x 2 B, page-locked under host only
    assert host.host_ple_table == TARGET_BYTES and file.host_ple_table == auto.host_ple_table == 0
    assert host.host_total - file.host_total == TARGET_BYTES
    assert file.host_total == file.host_experts + file.host_reserve
    assert file.host_total <= 25 * GiB < host.host_total  # the target for 2x32GB
    # the page cache file mode wants: a 262,144-token prompt's rows, 16 per token, one 4 KiB
    # page each = 16 GiB, apart from the total (not locked)
    assert file.ple_page_cache == auto.ple_page_cache == 262_144 * 16 * 4096 == 16 * GiB
    assert host.ple_page_cache == 0
    # auto counts what file needs, and says what pinning would
    assert auto.host_total == file.host_total and auto.host_total_pinned == host.host_total
    # the VRAM side does not change: the table is in VRAM under gpu only
    assert [c.vram for c in host.cards] == [c.vram for c in file.cards]


def test_page_cache_is_at_most_the_table():
    short = plan("file", max_model_len=4096)
    assert short.ple_page_cache == 4096 * 16 * 4096  # 256 MiB
    [t] = ple_tables(json.loads((TARGET / "config.json").read_text()))
    assert page_cache_wanted([t], 10**9) == t.nbytes
    assert page_cache_wanted([t], 4096) == 4096 * 16 * 4096


def test_memory_plan_command_line_for_file_mode():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "memory-plan"), str(TARGET), "--topology",
         "2x32GB", "--ple-table", "file", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["serving"]["ple_table"] == "file"
    assert doc["host_ple_table"] == 0 and doc["host_total"] <= 25 * GiB
    assert doc["ple_page_cache"] == 16 * GiB
    md = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "memory-plan"), str(TARGET), "--topology",
         "2x32GB", "--ple-table", "auto"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    assert "| page cache for the PLE table read from file (not locked" in md
    assert "VLLM_PLE_TABLE=auto page-locks the PLE table when" in md


# --- auto: the rule, and the preflight applying it to given figures -------------------------


@pytest.mark.parametrize(
    "room_gib, expected",
    [(200, "host"), (118.2, "host"), (118.0, "file"), (64, "file")],
)
def test_choose_placement_needs_the_margin(room_gib, expected):
    # 95.37 + 4 + 8 = 107.37 GiB, +10% = 118.11 GiB
    table, experts, reserve = TARGET_BYTES, 4 * GiB, 8 * GiB
    placement, need = choose_placement(int(room_gib * GiB), table, experts, reserve)
    assert need == int((TARGET_BYTES + 12 * GiB) * 1.1)
    assert placement == ("host" if room_gib * GiB >= need else "file") == expected


def write_table_checkpoint(model: pathlib.Path, tensors: dict[str, tuple[str, list[int]]]):
    """A safetensors file whose header declares `tensors` (dtype, shape) with zero bytes of
    data each: what the preflight reads is the header and the file size."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path = model / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: no data written
    return path


TABLE = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight"
ROWS = 320_001_536


def target_with_table(tmp_path, **tensors) -> pathlib.Path:
    model = qwen4exp(tmp_path, [1])
    write_table_checkpoint(model, tensors or {TABLE: ("BF16", [ROWS, 160])})
    return model


def test_auto_pins_when_meminfo_covers_the_table(tmp_path):
    s = setup_for(
        tmp_path, model=str(target_with_table(tmp_path)), ple_table="auto", avail_gib=200,
        reserve_gib=8,
    )  # fmt: skip
    mem = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem[0].status == "ok" and "VLLM_PLE_TABLE=auto: page-locks the tables" in mem[0].message
    assert "n-gram tables 95.37 GiB + host experts 0.00 GiB + reserve 8.00 GiB" in mem[0].message
    assert any("PLE n-gram tables need 95.37 GiB" in r.message for r in mem[1:])  # then counted


def test_auto_reads_the_file_when_the_container_limit_is_tight(tmp_path):
    # MemAvailable 200 GiB, but the container may take 64 GiB (1 GiB in use)
    s = setup_for(
        tmp_path, model=str(target_with_table(tmp_path)), ple_table="auto", avail_gib=200,
        limit_gib=64, reserve_gib=8,
    )  # fmt: skip
    mem = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem[0].status == "ok"
    assert "reads the tables from the checkpoint file" in mem[0].message
    assert "container's memory limit 64.0 GiB" in mem[0].message
    assert mem[1].status == "ok" and "nothing page-locked" in mem[1].message
    assert pf.exit_code(mem) == 0


def test_autos_decision_is_exported_for_vllm(tmp_path):
    """One rule: the preflight's auto decision goes to vLLM as VLLM_PLE_TABLE_RESOLVED."""
    for limit, want in ((None, "host"), (64, "file")):
        sub = tmp_path / want
        sub.mkdir()
        s = setup_for(
            sub, model=str(target_with_table(sub)), ple_table="auto", avail_gib=200,
            limit_gib=limit, reserve_gib=8,
        )  # fmt: skip
        pf.run_checks(s, skip=["vllm"])
        assert s.exports == {"VLLM_PLE_TABLE_RESOLVED": want}
    # only auto is decided here: file and host are vLLM's own setting already
    s = setup_for(tmp_path, model=str(target_with_table(tmp_path)), ple_table="file")
    pf.run_checks(s, skip=["vllm"])
    assert s.exports == {}


def test_the_start_program_hands_the_decision_to_vllm(monkeypatch):
    from eotools import serve_args, settings, start

    def run(setup, skip, code=0):
        setup.exports["VLLM_PLE_TABLE_RESOLVED"] = "file"
        return code

    monkeypatch.setattr(pf, "run", run)
    environ: dict[str, str] = {}
    values = settings.read({"VLLM_PLE_TABLE": "auto"})
    assert start.run_preflight(values, environ, serve_args.parse(["/models/m"]), None) == 0
    assert environ == {"VLLM_PLE_TABLE_RESOLVED": "file"}
    # a failed preflight hands nothing on (vLLM is not started)
    monkeypatch.setattr(pf, "run", lambda setup, skip: run(setup, skip, code=3))
    environ.clear()
    assert start.run_preflight(values, environ, serve_args.parse(["/models/m"]), None) == 3
    assert environ == {}


def test_file_mode_counts_nothing_pinned(tmp_path):
    s = setup_for(tmp_path, model=str(target_with_table(tmp_path)), ple_table="file", avail_gib=8)
    mem = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert [r.status for r in mem] == ["ok", "skip"]
    assert "(1 x 95.37 GiB) read from the checkpoint's safetensors files" in mem[0].message


# --- bad input: each a message naming the file and the fix ----------------------------------


def file_check(tmp_path, model) -> pf.Result:
    s = setup_for(tmp_path, model=str(model), ple_table="file", avail_gib=8)
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "fail" and pf.exit_code([mem]) == 4
    return mem


def test_a_missing_table_is_named(tmp_path):
    model = target_with_table(tmp_path, **{"model.language_model.norm.weight": ("BF16", [2560])})
    mem = file_check(tmp_path, model)
    assert "no n-gram table of PLE layer 1" in mem.message and str(model) in mem.message
    assert "re-download or re-convert the checkpoint" in mem.fix


def test_a_table_of_another_shape_is_named(tmp_path):
    model = target_with_table(tmp_path, **{TABLE: ("BF16", [ROWS - 128, 160])})
    mem = file_check(tmp_path, model)
    assert "model.safetensors" in mem.message and f"has shape [{ROWS - 128}, 160]" in mem.message
    assert f"the config wants [{ROWS}, 160]" in mem.message


def test_a_table_of_another_dtype_is_named(tmp_path):
    model = target_with_table(tmp_path, **{TABLE: ("F32", [ROWS, 160])})
    assert (
        "is F32, vLLM reads this table with 2-byte elements" in file_check(tmp_path, model).message
    )


def test_a_truncated_file_is_named(tmp_path):
    model = target_with_table(tmp_path)
    path = model / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 4096)
    mem = file_check(tmp_path, model)
    assert f"{path}: the file is truncated ({size - 4096} bytes" in mem.message


def test_missing_row_shards_are_named(tmp_path):
    cfg_path = qwen4exp(tmp_path, [1], split_ngram_parts=4) / "config.json"
    shard = ROWS // 4
    name = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_{}.weight"
    write_table_checkpoint(
        cfg_path.parent, {name.format(k): ("BF16", [shard, 160]) for k in (0, 1, 3)}
    )
    mem = file_check(tmp_path, cfg_path.parent)
    assert f"has {3 * shard} of {ROWS} rows (a shard file is missing?)" in mem.message


def test_whole_row_shards_pass(tmp_path):
    cfg_path = qwen4exp(tmp_path, [1], split_ngram_parts=4) / "config.json"
    name = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_{}.weight"
    write_table_checkpoint(
        cfg_path.parent, {name.format(k): ("BF16", [ROWS // 4, 160]) for k in range(4)}
    )
    s = setup_for(tmp_path, model=str(cfg_path.parent), ple_table="file", avail_gib=8)
    assert only(pf.run_checks(s, skip=["vllm"]), "host-memory")[0].status == "ok"


def test_a_file_that_cannot_be_mapped_is_named(tmp_path, monkeypatch):
    from eotools import ple_table

    model = target_with_table(tmp_path)

    def refuse(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(ple_table.mmap, "mmap", refuse)
    mem = file_check(tmp_path, model)
    assert "cannot be memory-mapped" in mem.message and "model.safetensors" in mem.message
    assert "copy the checkpoint to a local drive" in mem.fix


def test_the_command_line_takes_file_and_auto(monkeypatch):
    monkeypatch.setenv("VLLM_PLE_TABLE", "auto")
    assert pf.parse([])[0].ple_table == "auto"
    assert pf.parse(["--ple-table", "file"])[0].ple_table == "file"


# --- bench-ple-file's parts that need no GPU -------------------------------------------------


def test_bench_table_file_is_a_table_vllm_can_plan(tmp_path):
    from eodev import ple_file_read as bench

    path = tmp_path / "t.safetensors"
    base, nbytes = bench.write_table(path, 1000, seed=0)
    assert nbytes == 1000 * 160 * 2 and path.stat().st_size == base + nbytes and base % 8 == 0
    header = json.loads(path.read_bytes()[8:base])
    assert header[bench.NAME] == {
        "dtype": "BF16",
        "shape": [1000, 160],
        "data_offsets": [0, nbytes],
    }
    values = np.frombuffer(path.read_bytes()[base:], dtype=np.uint16)
    assert values.min() >= 0x3C00 and values.max() < 0x3F80  # finite BF16 in [2^-7, 1)
    assert bench.write_table(path, 1000, seed=0) == (base, nbytes)  # kept, not rewritten
    # resident after reading it all; a drive's random-read rate is positive
    path.read_bytes()
    assert bench.resident_bytes(path, base, nbytes) >= nbytes - 4096
    assert bench.iops(path, base, nbytes, depth=4, reads=64, seed=0) > 0


def test_bench_markdown_names_each_case():
    from eodev import ple_file_read as bench

    case = {"median": 1.0, "p90": 2.0}
    r = {
        "table": {"gib": 16.0},
        "gpu": "H200",
        "disk": {"iops_qd1": 4500, "iops_qd64": 36000},
        "decode": {"1": {"file_cold_ms": case, "file_warm_ms": case, "pinned_ms": case}},
        "prefill": {
            "8192": {"file_cold_ms": 900.0, "file_cold_prefetch_ms": 300.0, "file_warm_ms": 5.0}
        },
        "resident_bytes_after": 2 * GiB,
    }
    md = bench.markdown(r)
    assert "4500 random 4 KiB reads/s at queue depth 1, 36000 at 64" in md
    assert "| 8192 | 900.0 | 300.0 | 5.0 | - |" in md and "Resident after the run: 2.00 GiB" in md
