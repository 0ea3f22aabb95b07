# SPDX-License-Identifier: Apache-2.0
"""The preflight's count of Qwen4Exp's PLE n-gram tables (VLLM_PLE_TABLE=host) in its
host-memory check, against numbers computed by hand for the target config and, where the
patched vLLM is installed, against the table vLLM itself builds."""

from __future__ import annotations

import json
import pathlib

import pytest
from eotools import preflight as pf
from eotools.ple_table import ple_tables
from test_preflight import cold_100_per_layer, make_model, only, setup_for

GiB = 1 << 30
# The target (Qwen3.8-Flash-Next) text config's PLE fields are the config defaults:
# ngram_size 3, heads_per_ngram 8 -> 16 heads; base 20,000,000; padding 128; hidden 2560.
# The 16 primes above 19,999,999 sum to 320,001,446 (checked below) -> 320,001,536 rows
# padded to 128; width 2560 / 16 = 160; BF16: 102,400,491,520 bytes = 95.37 GiB.
TARGET_ROWS = 320_001_536
TARGET_BYTES = TARGET_ROWS * 160 * 2


def qwen4exp(tmp: pathlib.Path, ple_layer_ids, **text) -> pathlib.Path:
    d = tmp / "qwen4exp"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "text_config": {
            "hidden_size": 2560,
            "num_hidden_layers": 48,
            "num_experts": 512,
            "ple_layer_ids": ple_layer_ids,
            "torch_dtype": "bfloat16",
            **text,
        },
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_the_target_table_by_hand(tmp_path):
    [t] = ple_tables(json.loads((qwen4exp(tmp_path, [1]) / "config.json").read_text()))
    assert (t.rows, t.width, t.element_bytes) == (TARGET_ROWS, 160, 2)
    assert t.nbytes == 102_400_491_520 and f"{t.nbytes / GiB:.2f}" == "95.37"
    # the 16 primes: the first is 20,000,003 (20,000,000 .. 20,000,002 are composite)
    from eotools.ple_table import _primes_after

    primes = _primes_after(19_999_999, 16)
    assert primes[0] == 20_000_003 and sum(primes) == 320_001_446


def test_fp8_tables_take_one_byte_and_layers_differ(tmp_path):
    cfg = json.loads((qwen4exp(tmp_path, [24, 12]) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    a, b = ple_tables(cfg)
    assert (a.layer_id, b.layer_id) == (12, 24) and a.element_bytes == b.element_bytes == 1
    assert a.rows == TARGET_ROWS and b.rows != a.rows  # layer 2's heads take the next primes


def test_matches_the_table_vllm_builds():
    """The preflight's rows equal those of vLLM's own layout code, per PLE layer."""
    from vllm.models.qwen4_exp.nvidia import ple_layer

    E = ple_layer.Qwen4ExpNGramEmbedding
    cfg = {"hidden_size": 48, "ple_layer_ids": [1, 3, 4], "ngram_vocab_size_base": 1000}
    cfg.update(ngram_size=4, heads_per_ngram=2, make_ngram_vocab_size_divisible_by=16)
    for dense, t in enumerate(ple_tables(cfg)):
        *_, total = E._make_vocab_layout(
            ngram_vocab_size_base=1000, ngram_heads=6, ple_dense_layer_id=dense
        )
        assert t.rows == (total + 15) // 16 * 16 and t.width == 8


def test_host_placement_counts_the_tables_without_expert_offload(tmp_path):
    model = qwen4exp(tmp_path, [1])
    s = setup_for(tmp_path, model=str(model), ple_table="host", avail_gib=64)
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "fail"
    assert "PLE n-gram tables need 95.37 GiB (1 x 320001536 rows x 160 x 2 B" in mem.message
    assert "only 64.00 GiB is free" in mem.message and "VLLM_PLE_TABLE=gpu" in mem.fix
    s = setup_for(tmp_path, model=str(model), ple_table="host", avail_gib=200, reserve_gib=8)
    mem, *memlock = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "ok" and "95.37 GiB" in mem.message
    # and, where the locked-memory limit is below the table, a warning naming both
    for r in memlock:
        assert r.status == "warn" and "95.37 GiB to page-lock" in r.message


def test_tables_in_vram_are_not_counted(tmp_path):
    s = setup_for(tmp_path, model=str(qwen4exp(tmp_path, [1])), avail_gib=8)
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "skip"


def test_tables_and_host_experts_add_up(tmp_path):
    experts_model = make_model(tmp_path)  # 800 host experts x 2 MiB = 1.5625 GiB
    cold = cold_100_per_layer(tmp_path)
    cfg = json.loads((experts_model / "config.json").read_text())
    cfg.update(ple_layer_ids=[2], hidden_size=2560)
    (experts_model / "config.json").write_text(json.dumps(cfg))
    s = setup_for(
        tmp_path, model=str(experts_model), cold_file=str(cold), ple_table="host", avail_gib=96
    )
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    # 95.37 + 1.56 GiB > 96 GiB, though each alone fits
    assert mem.status == "fail" and "host experts need 1.56 GiB" in mem.message
    assert "PLE n-gram tables need 95.37 GiB" in mem.message


def test_a_hub_model_is_a_warning(tmp_path):
    s = setup_for(tmp_path, model="org/Qwen4Exp", ple_table="host")
    [mem] = only(pf.run_checks(s, skip=["vllm"]), "host-memory")
    assert mem.status == "warn" and "no local config.json" in mem.message


def test_the_command_line_reads_vllm_ple_table(monkeypatch):
    monkeypatch.setenv("VLLM_PLE_TABLE", "host")
    args, _ = pf.parse([])
    assert args.ple_table == "host"


@pytest.mark.parametrize("value", ["HOST", "Host", "", "cpu"])
def test_the_preflight_reads_vllm_ple_table_as_vllm_does(repo_root, tmp_path, value):
    """vLLM compares VLLM_PLE_TABLE case-sensitively and refuses anything but gpu and host:
    the preflight neither reads "HOST" as gpu (leaving the tables out of its memory check)
    nor lets it pass. Empty means unset (gpu)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_PLE_TABLE": value, "EO_PREFLIGHT_SKIP": "vllm,gpus,host-mapping"}
    r = subprocess.run(
        [sys.executable, str(repo_root / "scripts/preflight"), "--", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    if value == "":
        assert r.returncode == 0, r.stdout + r.stderr
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"VLLM_PLE_TABLE={value!r}" in r.stderr and "fix:" in r.stderr
    assert ("write host" in r.stderr) == (value.lower() == "host")
    assert "Traceback" not in r.stderr
