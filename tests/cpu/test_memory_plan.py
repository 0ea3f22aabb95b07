# SPDX-License-Identifier: Apache-2.0
"""scripts/memory-plan: the per-card memory table against hand-computed numbers for the
Qwen3.8-Flash-Next INT4 stand-in config (tests/cpu/data), and against a small checkpoint whose
safetensors files the test writes (sizes read from the headers only)."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest
from eotools.memory_plan.errors import PlanError
from eotools.memory_plan.estimate import make_plan
from eotools.memory_plan.model_shape import QWEN3_MOE, QWEN3_NEXT, ModelShape, load_shape
from eotools.memory_plan.render import render_markdown
from eotools.memory_plan.serving import Serving, usable_vram_bytes
from eotools.memory_plan.weights import (
    EMBED,
    EXPERTS,
    FINAL,
    LAYER,
    LM_HEAD,
    MTP,
    PLE_TABLE,
    estimate_weights,
    header_weights,
    ngram_table_rows,
    primes_above,
    read_header,
    safetensors_files,
)
from eotools.selection import GiB

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests/cpu/data/qwen3.8-flash-next-int4"
MiB = 1 << 20

# Hand-computed for the target (INT4 g128 symmetric, BF16 scales, hidden 2560, width 640):
# w13 [1280, 2560]: 1280*2560/2 packed + 20 groups*1280*2 scales; w2 [2560, 640]: 2560*640/2
# packed + 5 groups*2560*2 scales.
EXPERT = 1280 * 2560 // 2 + 20 * 1280 * 2 + 2560 * 640 // 2 + 5 * 2560 * 2
STAGE_EXPERTS = 24 * 512 * EXPERT  # 24 MoE layers per stage at PP=2
PLE_ROWS = 320_001_536  # 16 primes >= 20,000,000, summed, padded to 128 (notes/qwen4exp.md)
PLE_TABLE_BYTES = PLE_ROWS * 160 * 2  # width 2560/16, BF16
EMBED_BYTES = 248_320 * 2560 * 2
# KV: the GDN state (conv + SSM, BF16) is the largest Mamba page; vLLM's hybrid block is the
# multiple of 16 tokens whose attention page (2 KiB per token: K+V, 2 heads of 256, BF16) holds
# it, and every Mamba page is padded to that page.
GDN_PAGE = ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2
assert GDN_PAGE == 1_097_728
BLOCK = 544  # 16 * ceil(1_097_728 / (16 * 2048))
PAGE = BLOCK * 2048  # 1,114,112 B
QSA_KV_262K = 6 * 482 * BLOCK * 2048  # 6 QSA layers, 262,144 tokens in 482 blocks
# compressed keys (65,536 rows of 128 BF16, in whole pages: 16) + one page of raw-key ring
INDEX_262K = 6 * (16 * PAGE + PAGE)
GDN_ALIGN = 18 * 2 * PAGE  # 18 GDN layers per stage, 2 pages each in align mode
PLE_STATE = 2 * PAGE  # the PLE short-conv state (184,320 B) padded likewise


def serving(**kw) -> Serving:
    base = dict(
        name="2x32GB",
        pp_size=2,
        usable_vram_bytes=usable_vram_bytes(32),
        max_model_len=262_144,
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=360_000_000,
        mamba_cache_mode="align",
        ple_table="gpu",
        host_gib_per_card=3.0,
        layer_partition=None,
    )
    return Serving(**(base | kw))


@pytest.fixture(scope="module")
def target():
    shape = load_shape(TARGET / "config.json")
    return shape, estimate_weights(shape)


def test_ngram_table_rows_are_the_padded_sum_of_primes():
    assert primes_above(20_000_000, 3) == [20_000_003, 20_000_023, 20_000_033]
    assert ngram_table_rows(20_000_000, 16, 0, 128) == PLE_ROWS
    assert PLE_ROWS * 160 == 51_200_245_760  # the "51B n-gram table"
    # a second PLE layer takes the next 16 primes: a different, larger table
    assert ngram_table_rows(20_000_000, 16, 1, 128) > PLE_ROWS
    # small case by hand: primes >= 10 are 11, 13; 24 padded to 8 -> 24, to 16 -> 32
    assert ngram_table_rows(10, 2, 0, 8) == 24
    assert ngram_table_rows(10, 2, 0, 16) == 32
    assert ngram_table_rows(10, 2, 1, 1) == 17 + 19


def test_target_weights_from_the_config(target):
    shape, w = target
    assert w.expert_bytes == EXPERT
    assert round(EXPERT / MiB, 3) == 2.417  # SPEC section 1
    assert sum(p[EXPERTS] for p in w.per_layer) == 48 * 512 * EXPERT
    assert round(48 * 512 * EXPERT / GiB, 2) == 58.01  # the article's routed-expert total
    assert [p[PLE_TABLE] for p in w.per_layer] == [PLE_TABLE_BYTES] + [0] * 47
    assert round(PLE_TABLE_BYTES / GiB, 2) == 95.37
    assert w.outside[EMBED] == w.outside[LM_HEAD] == EMBED_BYTES
    # all weights a PP=1 engine loads: within 1 GiB of the article's 62.27 GiB (the config fields
    # the spec does not give are defaults, so the rest of the layers is an estimate)
    loaded = sum(p[EXPERTS] + p[LAYER] for p in w.per_layer) + 2 * EMBED_BYTES
    loaded += w.outside[FINAL]
    assert abs(loaded / GiB - 62.27) < 1.0
    assert "layer_types" in shape.defaulted  # said, not hidden


def test_target_on_2x32GB_as_the_spec_lists_it(target):
    """The SPEC settings: the PLE table in VRAM and 360 MB of KV do not start."""
    shape, w = target
    plan = make_plan(shape, w, serving())
    r0, r1 = plan.cards
    assert (r0.layers, r1.layers) == ("0-23", "24-47")
    assert r0.experts == r1.experts == STAGE_EXPERTS
    # Qwen4Exp 0.29.0: embeddings and LM head on every rank; PLE layer 1 on rank 0
    assert "embeddings" in r1.holds and "LM head" in r0.holds
    assert r0.ple_table == r0.ple_table_in_vram == PLE_TABLE_BYTES and r1.ple_table == 0
    assert r0.host_experts == r1.host_experts == 3 * GiB // EXPERT * EXPERT
    for c in plan.cards:
        assert c.kv.qsa_kv == QSA_KV_262K and round(QSA_KV_262K / GiB, 3) == 3.001
        assert c.kv.qsa_index == INDEX_262K
        assert c.kv.gdn_state == GDN_ALIGN
        assert c.kv_budget == 360_000_000 and not c.kv_fits
        assert c.allowance == int((1.26 + 0.7) * GiB)
        assert c.vram == (
            c.weights
            - c.ple_table
            + c.ple_table_in_vram
            - c.host_experts
            + c.kv_budget
            + c.buffers
            + c.allowance
        )
    assert r0.kv.ple_state == PLE_STATE and r1.kv.ple_state == 0
    assert round(r0.kv.one_request / GiB, 2) == 3.15
    # 360 MB holds (360e6 - fixed) / (6 x 2048 + 6 x 256 / 4) tokens on rank 1
    fixed = 6 * PAGE + GDN_ALIGN
    assert r1.max_context == (360_000_000 - fixed) // (6 * 2048 + 6 * 64) == 24_716
    assert not r0.fits and not plan.fits
    text = render_markdown(plan)
    assert "vLLM refuses to start" in text and "VLLM_PLE_TABLE=host" in text


def test_target_on_2x32GB_with_the_table_on_host(target):
    shape, w = target
    s = serving(ple_table="host", kv_cache_memory_bytes=3_600_000_000, host_gib_per_card=7.0)
    plan = make_plan(shape, w, s)
    assert plan.fits
    assert plan.host_ple_table == PLE_TABLE_BYTES
    assert plan.host_experts == 2 * (7 * GiB // EXPERT * EXPERT)
    assert plan.host_total == plan.host_experts + PLE_TABLE_BYTES + (2 + 3 * 2) * GiB
    for c in plan.cards:
        assert c.ple_table_in_vram == 0 and c.kv_fits and c.max_context >= 262_144
        assert c.vram <= c.usable == int(31.4 * GiB)
    # 3 GiB per card is not enough once one 262,144-token request's K/V is in VRAM
    short = make_plan(shape, w, serving(ple_table="host", kv_cache_memory_bytes=3_600_000_000))
    assert not short.fits and all(6 < c.min_host_gib < 7 for c in short.cards)


def test_prefill_staging_adds_two_slots_of_the_largest_layers_host_experts(target):
    """VLLM_EXPERT_PREFILL_STAGING=1 on 2x32GB at 7 GiB per card: 2,965 host experts over 24
    MoE layers, at most 124 in a layer, two slots of them: 628,531,200 B (0.59 GiB) more per
    card, which the 2x32GB cards do not have: the plan says so, and how much more to put on
    host."""
    shape, w = target
    base = dict(ple_table="host", kv_cache_memory_bytes=3_600_000_000, host_gib_per_card=7.0)
    off = make_plan(shape, w, serving(**base))
    on = make_plan(shape, w, serving(**base, prefill_staging=True))
    assert 7 * GiB // EXPERT == 2965 and -(-2965 // 24) == 124
    for a, b in zip(off.cards, on.cards, strict=True):
        assert a.staging == 0 and b.staging == 2 * 124 * EXPERT == 628_531_200
        assert b.vram - a.vram == 628_531_200
    assert off.fits and not on.fits
    assert "+ prefill staging slots | 0.59 | 0.59 |" in render_markdown(on)
    assert "prefill staging" not in render_markdown(off)
    # the compose file's own budget (7.6 GiB) pays for the slots; 7 GiB does not
    r = run(str(TARGET), "--topology", "2x32GB", "--json", env={"HOST_BUDGET_GIB": "7"})
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and [c["staging"] for c in doc["cards"]] == [628_531_200] * 2
    r = run(str(TARGET), "--topology", "2x32GB", "--no-prefill-staging", "--json")
    assert r.returncode == 0 and [c["staging"] for c in json.loads(r.stdout)["cards"]] == [0, 0]


def test_layer_partition_moves_layers_and_what_they_hold(target):
    shape, w = target
    plan = make_plan(shape, w, serving(layer_partition=[26, 22], ple_table="host"))
    r0, r1 = plan.cards
    assert (r0.layers, r1.layers) == ("0-25", "26-47")
    assert r0.experts == 26 * 512 * EXPERT and r1.experts == 22 * 512 * EXPERT
    # layers 3,7,...,23 on rank 0 (6 QSA layers), 27,...,47 on rank 1 (6)
    assert r0.kv.qsa_kv == r1.kv.qsa_kv
    with pytest.raises(PlanError, match="does not split 48 layers"):
        make_plan(shape, w, serving(layer_partition=[20, 20]))


# --- a small checkpoint written by the test ---------------------------------------------------

SMALL = {
    "architectures": ["Qwen4ExpForCausalLM"],
    "model_type": "qwen4_exp",
    "torch_dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "intermediate_size": 512,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "hc_count": 4,
    "hc_lowrank": 32,
    "ple_layer_ids": [1, 3],
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 100,
    "make_ngram_vocab_size_divisible_by": 8,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 64,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
}


def _expert_tensors(prefix: str) -> dict[str, np.ndarray]:
    """One GPTQ INT4 expert, hidden 256, width 128 (scales as 2-byte floats)."""
    h, i, g = 256, 128, 128
    out = {}
    for name, n_in, n_out in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)):
        out[f"{prefix}.{name}.qweight"] = np.zeros((n_in // 8, n_out), np.int32)
        out[f"{prefix}.{name}.scales"] = np.zeros((n_in // g, n_out), np.float16)
        out[f"{prefix}.{name}.qzeros"] = np.zeros((n_in // g, n_out // 8), np.int32)
        out[f"{prefix}.{name}.g_idx"] = np.zeros((n_in,), np.int32)
    return out


SMALL_EXPERT = 3 * (256 * 128 // 2 + 2 * 128 * 2)  # qweight + scales; qzeros, g_idx dropped


def write_small_checkpoint(path: pathlib.Path) -> dict[str, int]:
    """Two safetensors files and their index; returns the bytes the plan should count."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SMALL))
    lm = "model.language_model"
    files: list[dict[str, np.ndarray]] = [{}, {}]
    want = {"layer1": 0, "ple0": 0, "ple2": 0}
    for layer in range(4):
        t = files[layer // 2]
        for e in range(8):
            t.update(_expert_tensors(f"{lm}.layers.{layer}.mlp.experts.{e}"))
        t[f"{lm}.layers.{layer}.mlp.gate.weight"] = np.zeros((8, 256), np.float16)
        t[f"{lm}.layers.{layer}.input_layernorm.weight"] = np.zeros((256,), np.float16)
        if layer in (0, 2):  # ple_layer_ids 1 and 3: rows 101+103+107+109 -> 424 (0) etc.
            rows = ngram_table_rows(100, 4, layer // 2, 8)
            t[f"{lm}.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"] = np.zeros(
                (rows, 64), np.float16
            )
            want[f"ple{layer}"] = rows * 64 * 2
    want["layer1"] = 8 * 256 * 2 + 256 * 2
    files[0][f"{lm}.embed_tokens.weight"] = np.zeros((512, 256), np.float16)
    files[1]["lm_head.weight"] = np.zeros((512, 256), np.float16)
    files[1][f"{lm}.norm.weight"] = np.zeros((256,), np.float16)
    files[1]["mtp.layers.0.mlp.experts.0.gate_proj.qweight"] = np.zeros((32, 128), np.int32)
    index = {}
    for k, t in enumerate(files):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(t, str(path / name))
        index.update(dict.fromkeys(t, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return want


def test_small_checkpoint_sizes_come_from_the_headers(tmp_path):
    model = tmp_path / "small"
    want = write_small_checkpoint(model)
    shape = load_shape(model / "config.json")
    w = header_weights(shape, safetensors_files(model))
    assert w.source == "safetensors headers (2 files)"
    assert w.expert_bytes == SMALL_EXPERT
    assert [p[EXPERTS] for p in w.per_layer] == [8 * SMALL_EXPERT] * 4
    assert [p[PLE_TABLE] for p in w.per_layer] == [want["ple0"], 0, want["ple2"], 0]
    assert want["ple0"] == (101 + 103 + 107 + 109 + 4) * 64 * 2  # 424 rows, padded to 8
    assert w.per_layer[1][LAYER] == want["layer1"]  # router gate + norm
    assert w.outside[EMBED] == w.outside[LM_HEAD] == 512 * 256 * 2
    assert w.outside[MTP] == 32 * 128 * 4 and w.outside[FINAL] == 256 * 2
    # the config-only estimate sizes the same expert and the same tables
    est = estimate_weights(shape)
    assert est.expert_bytes == SMALL_EXPERT
    assert [p[PLE_TABLE] for p in est.per_layer] == [p[PLE_TABLE] for p in w.per_layer]


def test_small_checkpoint_plan_over_two_cards(tmp_path):
    model = tmp_path / "small"
    want = write_small_checkpoint(model)
    shape = load_shape(model / "config.json")
    w = header_weights(shape, safetensors_files(model))
    s = serving(
        usable_vram_bytes=3 * GiB,
        max_model_len=4096,
        kv_cache_memory_bytes=None,
        host_gib_per_card=3 * SMALL_EXPERT / GiB,
        ple_table="host",
    )
    plan = make_plan(shape, w, s)
    r0, r1 = plan.cards
    assert r0.host_experts == r1.host_experts == 3 * SMALL_EXPERT
    assert plan.host_ple_table == want["ple0"] + want["ple2"]
    assert r0.ple_table == want["ple0"] and r1.ple_table == want["ple2"]
    # one QSA layer per rank (layers 1 and 3), K+V 2 x 64 x 2 B = 512 B per token. The largest
    # Mamba page here is the PLE state (1024 channels x 9 x 2 B = 18,432 B; GDN: 9,728 B), so
    # the block is 48 tokens (16 x ceil(18,432 / 8,192)) and every page 48 x 512 = 24,576 B
    assert r0.kv.qsa_kv == r1.kv.qsa_kv == 86 * 48 * 512  # 4096 tokens in 86 blocks
    assert r0.kv.ple_state == r0.kv.gdn_state == 2 * 24_576  # one layer each, 2 pages
    assert r0.kv_budget == 2 * r0.kv.one_request  # no --kv-cache-memory-bytes: 2 requests
    assert plan.fits  # 1.96 GiB of allowance at chunk 2048 dominates a model this small
    assert any("no --kv-cache-memory-bytes" in n for n in plan.notes)
    assert not make_plan(shape, w, serving(usable_vram_bytes=GiB)).fits


def test_headers_only_no_tensor_data_is_read(tmp_path):
    """A file whose header claims 4 GiB of experts but holds no data: sizes still come out."""
    model = tmp_path / "hollow"
    model.mkdir()
    cfg = dict(SMALL, num_hidden_layers=1, layer_types=["full_attention"], ple_layer_ids=[])
    (model / "config.json").write_text(json.dumps(cfg))
    n = 4 * GiB
    name = "model.language_model.layers.0.mlp.experts.0.gate_proj.qweight"
    header = json.dumps({name: {"dtype": "I32", "shape": [n // 4], "data_offsets": [0, n]}})
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    w = header_weights(load_shape(model / "config.json"), safetensors_files(model))
    assert w.per_layer[0][EXPERTS] == n and w.expert_bytes == n


def test_mixed_folders_and_bad_files_are_named(tmp_path):
    model = tmp_path / "m"
    write_small_checkpoint(model)
    cfg = dict(SMALL, num_hidden_layers=2, layer_types=SMALL["layer_types"][:2])
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="mixes two models"):
        header_weights(load_shape(model / "config.json"), safetensors_files(model))
    # with 2 MTP layers, layers 2 and 3 are MTP weights stored after the last layer
    (model / "config.json").write_text(json.dumps(dict(cfg, mtp_num_hidden_layers=2)))
    w = header_weights(load_shape(model / "config.json"), safetensors_files(model))
    assert w.outside[MTP] > 2 * 8 * SMALL_EXPERT and len(w.per_layer) == 2
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"abc")
    with pytest.raises(PlanError, match="not a safetensors file"):
        read_header(bad)


# --- the command line -------------------------------------------------------------------------


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """scripts/memory-plan ARGS, with `env` added to this process's environment."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/memory-plan"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_help_and_exit_codes(tmp_path):
    r = run("--help")
    assert r.returncode == 0 and "Exit codes" in r.stdout
    r = run(str(tmp_path / "nothing"), "--max-model-len", "10")
    assert r.returncode == 2 and "config.json" in r.stderr
    r = run(str(TARGET), "--topology", "nope")
    assert r.returncode == 2 and "unknown topology 'nope'" in r.stderr
    # the SPEC's 2x32GB line with the upstream table in VRAM: printed, and exit 1
    r = run(str(TARGET), "--topology", "2x32GB", "--ple-table", "gpu", "--host-gib-per-card", "3")
    assert r.returncode == 1 and "estimated from config.json" in r.stdout
    assert "| **VRAM** |" in r.stdout


def test_cli_json_and_env_partition(tmp_path):
    r = run(
        str(TARGET / "config.json"), "--pp-size", "2", "--vram-gib", "40", "--max-model-len",
        "4096", "--json", env={"VLLM_PP_LAYER_PARTITION": "25,23"},
    )  # fmt: skip
    doc = json.loads(r.stdout)
    assert [c["layers"] for c in doc["cards"]] == ["0-24", "25-47"]
    assert doc["serving"]["ple_table"] == "gpu" and doc["fits"] is False  # 95 GiB in VRAM
    assert r.returncode == 1


def test_the_shell_sets_the_compose_files_variables_as_compose_does():
    """PREFILL_STAGING=1 MAX_NUM_BATCHED_TOKENS=8192 on 2x32GB: the staging slots and the
    larger chunk's activations do not fit at the default 7.6 GiB per card; the plan says how
    much to put on host, and with that much it fits (what compose/README.md tells users)."""

    def plan(**env: str) -> tuple[int, dict]:
        r = run(str(TARGET), "--topology", "2x32GB", "--json", env=env)
        return r.returncode, json.loads(r.stdout)

    rc, base = plan()
    assert rc == 0 and base["serving"]["max_num_batched_tokens"] == 2048
    assert base["serving"]["prefill_staging"] is True  # the compose default
    assert plan(PREFILL_STAGING="0")[1]["serving"]["prefill_staging"] is False
    rc, big = plan(PREFILL_STAGING="1", MAX_NUM_BATCHED_TOKENS="8192")
    assert rc == 1 and big["serving"]["max_num_batched_tokens"] == 8192
    assert big["serving"]["prefill_staging"] is True
    need = max(c["min_host_gib"] for c in big["cards"])
    assert 10.0 < need < 11.0
    assert all(c["staging"] > 0 and not c["fits"] for c in big["cards"])
    rc, enough = plan(
        PREFILL_STAGING="1", MAX_NUM_BATCHED_TOKENS="8192", HOST_BUDGET_GIB=f"{need + 0.1:.1f}"
    )
    assert rc == 0 and all(c["fits"] for c in enough["cards"])
    # the per-chunk copy it implies, and that activations past chunk 2048 are extrapolated
    env = {"PREFILL_STAGING": "1", "MAX_NUM_BATCHED_TOKENS": "8192", "HOST_BUDGET_GIB": "10.6"}
    r = run(str(TARGET), "--topology", "2x32GB", env=env)
    host = 10.6 * GiB // EXPERT * EXPERT
    assert f"({host / GiB:.2f} GiB) once per chunk of 8192 tokens" in r.stdout
    assert f"about {host / 50e9 * 1e3:.0f} ms at 50 GB/s" in r.stdout
    assert "to chunk 8192 (not measured)" in r.stdout
    assert "not measured" not in run(str(TARGET), "--topology", "2x32GB").stdout


@pytest.mark.parametrize("name", ["2x32GB", "3x24GB", "2x24GB"])
def test_every_big_compose_file_fits_the_target(name):
    """The compose files' settings start the target: every card fits, the KV holds one request
    at --max-model-len (the tool reads the settings from compose/<name>.yml)."""
    r = run(str(TARGET), "--topology", name, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout
    assert doc["serving"]["ple_table"] in ("host", "auto")
    assert all(c["kv_fits"] and c["fits"] for c in doc["cards"])


def test_one_table_counts_its_swap_counters_and_extra_host_experts(target):
    """VLLM_EXPERT_ONE_TABLE=1 (the compose default): the runtime swap's counters and maps
    (12 B per layer and expert: 24 x 512 x 12 = 147,456 B per 2x32GB stage) in VRAM, and
    up to three more experts per MoE layer on host (24 x 3 x one expert per card; an H200
    measured 3 at 26% host), which the host RAM total counts; the plan's notes say which
    path runs."""
    shape, w = target
    base = dict(host_gib_per_card=7.6, prefill_staging=True)
    off = make_plan(shape, w, serving(**base))
    on = make_plan(shape, w, serving(**base, one_table=True))
    for a, b in zip(off.cards, on.cards, strict=True):
        assert (a.swap, b.swap) == (0, 24 * 512 * 12)
        assert b.vram - a.vram == b.swap
        assert b.one_table_host == 3 * 24 * w.expert_bytes
    assert on.host_total - off.host_total == 2 * 3 * 24 * w.expert_bytes
    assert any("one table with the runtime swap" in n for n in on.notes)
    assert any("split experts (offload-02" in n for n in off.notes)


def test_staging_below_its_minimum_chunk_is_named_as_buying_nothing(target):
    shape, w = target
    small = make_plan(
        shape,
        w,
        serving(host_gib_per_card=14, prefill_staging=True, max_num_batched_tokens=512),
    )
    [note] = [n for n in small.notes if n.startswith("offload path")]
    assert "below its 2048-token minimum" in note and "PREFILL_STAGING=0" in note


# Public configs of three MoE models (the fields memory-plan reads), and hand-computed figures.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_235B_A22B = QWEN3_30B_A3B | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "moe_intermediate_size": 1536,
}
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "mtp_num_hidden_layers": 1,
}


def shape_of(tmp_path: pathlib.Path, cfg: dict) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_shape(tmp_path / "config.json")


def test_qwen3_30b_a3b_is_sized_as_qwen3_moe(tmp_path):
    """Every layer full attention (no Gated DeltaNet, no hyper-connections, no PLE):
    - one BF16 expert 3 x 2048 x 768 x 2 = 9,437,184 B; 128 per layer;
    - a layer besides its experts: q/k/v (4096 + 2 x 512 rows) 20,971,520, o 16,777,216,
      q/k norms 512, two RMS norms 8,192, router 524,288 = 38,281,728 B;
    - all weights 48 layers + two 622,329,856 B embeddings + the final norm = 61,064,245,248 B
      (30.5B parameters in BF16);
    - KV per token and layer 2 x 4 x 128 x 2 = 2,048 B: 49,152 B per rank at PP=2."""
    shape = shape_of(tmp_path, QWEN3_30B_A3B)
    assert shape.family == QWEN3_MOE and set(shape.layer_types) == {"full_attention"}
    assert shape.defaulted == []  # nothing of Qwen3-Next's or Qwen4Exp's is missing
    w = estimate_weights(shape)
    assert w.expert_bytes == 9_437_184
    assert all(p[EXPERTS] == 128 * 9_437_184 for p in w.per_layer)
    assert all(p[LAYER] == 38_281_728 for p in w.per_layer)
    total = sum(p[EXPERTS] + p[LAYER] for p in w.per_layer) + sum(w.outside.values())
    assert total == 61_064_245_248
    s = serving(max_model_len=32_768, kv_cache_memory_bytes=None, host_gib_per_card=0)
    plan = make_plan(shape, w, s)
    for card in plan.cards:
        assert card.kv.per_token == 49_152 and card.kv.gdn_state == card.kv.ple_state == 0
        assert card.kv.one_request == 32_768 * 49_152
        assert card.max_context == card.kv_budget // 49_152
    assert plan.cards[0].holds == ["embeddings"] and plan.cards[1].holds == ["LM head"]


def test_qwen3_235b_a22b_is_sized_as_qwen3_moe(tmp_path):
    """94 layers of hidden 4096: an expert 3 x 4096 x 1536 x 2 = 37,748,736 B; a layer besides
    its experts 75,497,472 + 67,108,864 + 512 + 16,384 + 1,048,576 = 143,671,808 B; all weights
    470,187,269,120 B (235B parameters); KV 47 x 2,048 = 96,256 B per token per rank at PP=2."""
    shape = shape_of(tmp_path, QWEN3_235B_A22B)
    w = estimate_weights(shape)
    assert w.expert_bytes == 37_748_736
    assert w.per_layer[0][LAYER] == 143_671_808
    total = sum(p[EXPERTS] + p[LAYER] for p in w.per_layer) + sum(w.outside.values())
    assert total == 470_187_269_120
    s = serving(max_model_len=8192, kv_cache_memory_bytes=None, host_gib_per_card=0)
    assert [c.kv.per_token for c in make_plan(shape, w, s).cards] == [96_256, 96_256]


def test_qwen3_next_80b_keeps_its_hybrid_layers(tmp_path):
    """Every 4th layer full attention (full_attention_interval), the others Gated DeltaNet;
    no hyper-connections or PLE. Per rank at PP=2: 6 full layers x 2 x 2 x 256 x 2 B =
    12,288 B of KV per token; 18 GDN layers, each state ((2 x 2048 + 4096) x 3 + 32 x 128 x
    128) x 2 = 1,097,728 B padded to a 544-token page of 1,114,112 B, two pages in align
    mode: 40,108,032 B. An expert 3 x 2048 x 512 x 2 = 6,291,456 B, 512 per layer; one MTP
    layer (not loaded)."""
    shape = shape_of(tmp_path, QWEN3_NEXT_80B)
    assert shape.family == QWEN3_NEXT and shape.defaulted == []
    assert (
        shape.layer_types.count("full_attention") == 12 and shape.layer_types[3] == "full_attention"
    )
    assert shape.hc_count == 0 and shape.ple_layer_ids == [] and shape.indexer_n_heads is None
    w = estimate_weights(shape)
    assert w.expert_bytes == 6_291_456 and w.per_layer[0][EXPERTS] == 512 * 6_291_456
    assert w.outside[MTP] > 0
    s = serving(max_model_len=65_536, kv_cache_memory_bytes=None, host_gib_per_card=0)
    for card in make_plan(shape, w, s).cards:
        assert card.kv.per_token == 12_288
        assert card.kv.gdn_state == 18 * 2 * 1_114_112 == 40_108_032


def test_a_tiny_qwen3_moe_model_holds_what_its_kv_holds(tmp_path):
    """Two full-attention layers, not two Gated DeltaNet ones: the KV budget bounds the context
    (before: "1,000,000,000 tokens")."""
    cfg = QWEN3_30B_A3B | {"num_hidden_layers": 2, "hidden_size": 256, "head_dim": 64}
    shape = shape_of(tmp_path, cfg)
    w = estimate_weights(shape)
    s = serving(pp_size=1, max_model_len=4096, kv_cache_memory_bytes=1 << 30, host_gib_per_card=0)
    [card] = make_plan(shape, w, s).cards
    assert card.kv.per_token == 2 * 2 * 4 * 64 * 2
    assert card.max_context == (1 << 30) // 2048 == 524_288


def test_an_architecture_it_cannot_size_is_refused_with_what_it_knows(tmp_path):
    cfg = QWEN3_30B_A3B | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    with pytest.raises(PlanError, match="cannot size MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        shape_of(tmp_path, cfg)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    r = run(str(tmp_path / "m"), "--pp-size", "1", "--max-model-len", "4096")
    assert r.returncode == 2 and "cannot size MixtralForCausalLM" in r.stderr
    assert "Traceback" not in r.stderr
