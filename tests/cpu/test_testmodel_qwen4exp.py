# SPDX-License-Identifier: Apache-2.0
"""The synthetic Qwen4Exp test model (make-test-model --arch qwen4_exp): names and shapes as
vLLM 0.29.0 reads them, every feature on, the planted routing intact, and the checkpoint built
and loaded by vLLM's Qwen4ExpForCausalLM on the CPU (tests/cpu/qwen4exp_load.py).

    python -m pytest tests/cpu/test_testmodel_qwen4exp.py -q
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from eodev.testmodel import data, qwen4exp
from eodev.testmodel.cli import QWEN4_PRESETS
from eodev.testmodel.plant import CONTEXT_VALUE, Plan, Planting, load_plan
from eodev.testmodel.reference import ReferenceModel

TINY = Plan(QWEN4_PRESETS["tiny"], Planting())
SHAPE = qwen4exp.PRESETS["tiny"]
LM = "model.language_model.layers"
HERE = pathlib.Path(__file__).resolve().parent


def make(tmp_path_factory, repo_root, quant: str, *extra: str) -> pathlib.Path:
    out = tmp_path_factory.mktemp(f"qwen4-{quant}")
    cmd = [sys.executable, str(repo_root / "scripts/make-test-model"), str(out)]
    cmd += ["--arch", "qwen4_exp", "--preset", "tiny", "--quant", quant, "--device", "cpu"]
    subprocess.run([*cmd, "--force", *extra], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def q4_int4(tmp_path_factory, repo_root):
    return make(tmp_path_factory, repo_root, "int4")


@pytest.fixture(scope="session")
def q4_bf16(tmp_path_factory, repo_root):
    # fewer experts: the BF16 path's names and loading, not the routing, are checked here
    return make(tmp_path_factory, repo_root, "bf16", "--experts", "64", "--top-k", "4")


def vllm_load(model: pathlib.Path, repo_root: pathlib.Path, *args: str) -> dict:
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(repo_root / "scripts"), str(HERE)]),
    }
    r = subprocess.run(
        [sys.executable, str(HERE / "qwen4exp_load.py"), str(model), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_ngram_vocab_base_sizes_the_ple_tables_and_the_disk_check(tmp_path, monkeypatch, capsys):
    """--ngram-vocab-base reaches config.json, and the disk check counts the PLE tables as
    vLLM's layout sizes them from that config (eotools.ple_table)."""
    import dataclasses
    import shutil

    from eodev.testmodel import cli
    from eotools.ple_table import ple_tables

    out = tmp_path / "q4"
    assert cli.main([str(out), "--arch", "qwen4_exp", "--preset", "tiny", "--no-weights",
                     "--ngram-vocab-base", "100003"]) == 0  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["ngram_vocab_size_base"] == 100003
    tables = ple_tables(cfg)
    # two PLE layers, 16 heads of about 100,003 rows each, 256 / 16 = 16 BF16 values per row
    assert len(tables) == 2 and all(t.width == 16 and t.element_bytes == 2 for t in tables)
    assert all(16 * 100003 <= t.rows < 16 * 100003 + 16 * 2000 for t in tables)
    shape = dataclasses.replace(SHAPE, ngram_vocab_size_base=100003)
    ple = sum(t.nbytes for t in tables)
    assert qwen4exp.ple_table_bytes(shape, 6, 256) == ple

    experts = cli.TensorFactory(TINY, "int4").expert_bytes() * 512 * 6
    usage = shutil.disk_usage(tmp_path)
    new = tmp_path / "q4-weights"
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage._replace(free=experts + ple))
    assert cli._disk_shortfall(TINY, "int4", new, False, shape) is None
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage._replace(free=experts + 1000))
    why = cli._disk_shortfall(TINY, "int4", new, False, shape)
    assert why and why.startswith("the routed experts of 6 layers and the PLE tables need")
    assert cli._disk_shortfall(TINY, "int4", new, False) is None  # experts alone fit


def test_ngram_vocab_base_is_refused_where_it_means_nothing(tmp_path, capsys):
    from eodev.testmodel import cli

    assert cli.main([str(tmp_path / "a"), "--preset", "tiny", "--ngram-vocab-base", "5003"]) == 1
    assert "--ngram-vocab-base is for --arch qwen4_exp" in capsys.readouterr().err
    argv = [str(tmp_path / "b"), "--arch", "qwen4_exp", "--preset", "tiny"]
    assert cli.main([*argv, "--ngram-vocab-base", "1"]) == 1
    assert "must be at least 2" in capsys.readouterr().err


# ---- config and names --------------------------------------------------------------------------
def test_config_has_every_feature_and_one_ple_layer_per_pp_stage(q4_int4):
    cfg = json.loads((q4_int4 / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen4ExpForCausalLM"] and cfg["model_type"] == "qwen4_exp"
    text = cfg["text_config"]
    n = text["num_hidden_layers"]
    assert n == 6 and text["num_experts"] == 512 and text["num_experts_per_tok"] == 10
    assert text["layer_types"] == ["full_attention", "linear_attention", "linear_attention"] * 2
    assert text["hc_count"] == 4 and text["shared_expert_intermediate_size"] > 0
    assert text["indexer_n_heads"] and text["indexer_budget"] // text["indexer_compress_ratio"] in (
        512,
        2048,
    )
    assert text["mtp_num_hidden_layers"] == 1
    # PLE: 1-based ids; vLLM's PP=2 split gives stage 0 layers [0, n // 2)
    ple = [i - 1 for i in text["ple_layer_ids"]]
    assert [sum(1 for p in ple if p < n // 2), sum(1 for p in ple if p >= n // 2)] == [1, 1]
    assert 0 not in ple
    assert cfg["quantization_config"]["quant_method"] == "gptq"
    desc = json.loads((q4_int4 / "synthetic_model.json").read_text())
    assert desc["architecture"] == "Qwen4ExpForCausalLM" and desc["geometry"]["arch"] == "qwen4_exp"
    assert desc["qwen4_exp"]["mtp_layer"] == n


def test_checkpoint_names_and_shapes(q4_int4):
    ref = ReferenceModel(q4_int4)
    names = set(ref._where)
    g, h = TINY.geometry, TINY.geometry.hidden_size
    for e in (0, 511):
        pre = f"{LM}.5.mlp.experts.{e}"
        assert ref.tensor(f"{pre}.gate_proj.qweight").shape == (h // 8, g.moe_intermediate_size)
        assert ref.tensor(f"{pre}.down_proj.scales").dtype == torch.float16
        assert f"mtp.layers.0.mlp.experts.{e}.up_proj.qweight" in names
    for layer in range(g.num_layers):
        pre = f"{LM}.{layer}"
        assert f"{pre}.mlp.gate.weight" in names
        assert f"{pre}.mlp.shared_expert_gate.weight" in names
        assert f"{pre}.mlp.shared_expert.down_proj.weight" in names
        assert f"{pre}.attn_hyper_connection.block_inject_weight.weight" in names
        kind = "self_attn.indexer.index_qk_proj" if layer % 3 == 0 else "linear_attn.in_proj_qkv"
        assert f"{pre}.{kind}.weight" in names
        assert (f"{pre}.ple.value_proj.weight" in names) == (layer in (1, 4))
    rows = ref.tensor(f"{LM}.4.ple.ple_embedding.ngram_embedding.weight").shape[0]
    assert rows == qwen4exp.ngram_rows(SHAPE, 1) and rows < 20_000  # a tiny n-gram table
    for name in ("mtp.fc_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        assert name in names
    assert not any(n.startswith("model.layers.") for n in names)  # all under language_model
    assert ref.tensor("lm_head.weight").shape == (g.vocab_size, h)


def test_no_component_but_layer_0_attention_writes_the_router_dimensions(q4_int4):
    ref = ReferenceModel(q4_int4)
    td, h = TINY.token_dims, TINY.geometry.hidden_size
    reserved = torch.cat([torch.arange(td, h) + s * h for s in range(SHAPE.hc_count)])
    writers = [
        f"{LM}.3.self_attn.o_proj.weight",
        f"{LM}.1.linear_attn.out_proj.weight",
        f"{LM}.2.mlp.shared_expert.down_proj.weight",
        f"{LM}.4.ple.value_proj.weight",
    ]
    for name in writers:
        w = ref.tensor(name).float()
        assert w[td:].abs().max() == 0 and w[:td].abs().max() > 0, name
    assert ref.tensor(f"{LM}.1.ple.conv1d.weight")[reserved].abs().max() == 0
    assert ref.tensor(f"{LM}.2.mlp.experts.9.down_proj.scales")[:, td:].abs().max() == 0
    for layer in range(TINY.geometry.num_layers):
        for hc in ("attn_hyper_connection", "mlp_hyper_connection"):
            pre = f"{LM}.{layer}.{hc}"
            assert ref.tensor(f"{pre}.input_mix_weight_up.weight")[reserved].abs().max() == 0
            assert ref.tensor(f"{pre}.hc_norm.weight")[reserved].abs().max() == 0
        inject = ref.tensor(f"{LM}.{layer}.attn_hyper_connection.block_inject_weight.weight")
        assert (inject.abs().max() == 0) == (layer == 0)
        gate = ref.tensor(f"{LM}.{layer}.mlp.gate.weight").float()
        assert gate[:, :td].abs().max() == 0  # routers read the reserved dimensions only
    o0 = ref.tensor(f"{LM}.0.self_attn.o_proj.weight").float()
    assert o0[: TINY.context_slice.start].abs().max() == 0
    assert o0[TINY.context_slice.stop :].abs().max() == 0


def reserved_path_topk(ref: ReferenceModel, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(T, layers, top_k) router picks from the checkpoint's planted path: the embedding (every
    stream the same), layer 0's attention through its hyper-connection (gate 1/2 on the
    reserved dimensions, uniform causal mean, output gate 1/2, injection 1), then each router
    on the reserved part. The other components write no reserved dimension (test above), and
    RMSNorm and the gates scale a token's reserved part by one positive factor."""
    td = TINY.token_dims
    x = ref.tensor("model.language_model.embed_tokens.weight").float()[torch.as_tensor(ids)]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    block_in = qwen4exp.HC_GATE * xn
    v = block_in @ ref.tensor(f"{LM}.0.self_attn.v_proj.weight").float().t()
    mean = torch.cumsum(v, 0) / torch.arange(1, len(ids) + 1)[:, None]
    hd, nh, nkv = TINY.geometry.head_dim, TINY.geometry.num_attention_heads, 2
    per_head = mean.view(len(ids), nkv, hd).repeat_interleave(nh // nkv, dim=1)
    attn = 0.5 * per_head.reshape(len(ids), nh * hd)  # sigmoid(0) output gate
    x = x + attn @ ref.tensor(f"{LM}.0.self_attn.o_proj.weight").float().t()
    r = torch.zeros_like(x)
    r[:, td:] = x[:, td:]
    picks = []
    for layer in range(TINY.geometry.num_layers):
        gate = ref.tensor(f"{LM}.{layer}.mlp.gate.weight").float()
        picks.append((r @ gate.t()).topk(TINY.geometry.top_k, dim=-1).indices)
    return torch.stack(picks, 1).numpy(), x[:, TINY.context_slice].numpy()


@pytest.mark.parametrize("domain", ["code", "legal"])
def test_planted_routing_is_what_the_plan_says(q4_int4, domain):
    conv = next(data.conversations(TINY, domain, "calibration", 1, 48))
    ids = list(conv.token_ids) + data.greedy_continuation(TINY, conv.token_ids, 16)
    picks, context = reserved_path_topk(ReferenceModel(q4_int4), ids)
    # the context layer 0 writes is the plan's: CONTEXT_VALUE times the prefix's mean topic
    np.testing.assert_allclose(context, CONTEXT_VALUE * TINY.context(np.asarray(ids)), atol=0.01)
    agree = total = 0
    for layer in range(TINY.geometry.num_layers):
        want = TINY.router_topk(layer, np.asarray(ids))
        agree += sum(len(set(a) & set(b)) for a, b in zip(picks[:, layer], want, strict=True))
        total += want.size
    # BF16 weights: a near-tie may swap the 10th pick now and then, nothing more
    assert agree / total > 0.99
    assert load_plan(q4_int4).geometry == TINY.geometry


# ---- cold-set tools ----------------------------------------------------------------------------
def test_cold_set_tools_see_the_model_layers_not_mtp(q4_int4, tmp_path):
    from eodev.synthetic_cold import synthetic_cold_file
    from eotools.selection import expert_bytes

    doc = synthetic_cold_file(q4_int4, tmp_path / "cold.json", 51)
    assert sorted(map(int, doc["layers"])) == list(range(TINY.geometry.num_layers))
    assert doc["model"]["architecture"] == "Qwen4ExpForCausalLM"
    assert doc["model"]["num_layers"] == TINY.geometry.num_layers
    desc = json.loads((q4_int4 / "synthetic_model.json").read_text())
    assert expert_bytes(q4_int4) == desc["expert_bytes"]


# ---- vLLM builds the model and loads every tensor ------------------------------------------------
def test_vllm_builds_and_loads_the_int4_checkpoint(q4_int4, repo_root):
    r = vllm_load(q4_int4, repo_root)
    assert r["architecture"] == "Qwen4ExpForCausalLM" and r["text_config"] == "Qwen4ExpTextConfig"
    assert r["quantization"] == "auto_gptq" and r["moe_method"] == "AutoGPTQMoEMethod"
    assert r["missing"] == []
    assert all(r["same_values"].values()) and len(r["same_values"]) == 4
    assert r["ple_layers"] == [1, 4]
    assert r["layer_kinds"] == ["qsa", "gdn", "gdn"] * 2
    assert r["shared_expert"] == "Qwen2MoeMLP"
    assert r["mtp_tensors"] > 0  # in the checkpoint; the target model drops them
    # the drafter (--speculative-config method mtp) loads every one of its parameters, and
    # its MoE layer is numbered after the model's: never a cold-file layer
    assert r["mtp_architecture"] == "Qwen4ExpMTP" and r["mtp_missing"] == []
    assert r["mtp_moe_layers"] == [f"mtp.layers.{TINY.geometry.num_layers}.mlp.experts"]


def test_vllm_builds_and_loads_the_bf16_checkpoint(q4_bf16, repo_root):
    r = vllm_load(q4_bf16, repo_root)
    assert r["quantization"] is None and r["moe_method"] == "UnquantizedFusedMoEMethod"
    assert r["missing"] == [] and r["mtp_missing"] == []
    assert all(r["same_values"].values())


def test_vllm_accepts_the_target_stage_config(tmp_path, repo_root):
    """The target-stage preset (24 layers, hidden 2560, 512 experts top-10, width 640) as
    vLLM's config resolves it; its 30 GB of weights are not written here."""
    out = tmp_path / "target-stage"
    cmd = [sys.executable, str(repo_root / "scripts/make-test-model"), str(out)]
    cmd += ["--arch", "qwen4_exp", "--no-weights", "--prompts", "1"]
    subprocess.run(cmd, check=True, capture_output=True)
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["num_experts"], text["num_experts_per_tok"]) == (
        2560,
        512,
        10,
    )
    assert text["moe_intermediate_size"] == 640 and text["num_hidden_layers"] == 24
    r = vllm_load(out, repo_root, "--config-only")
    assert r["architecture"] == "Qwen4ExpForCausalLM" and r["num_layers"] == 24
    assert r["ple_layer_ids"] == [2, 14]  # layers 1 and 13: one per 12-layer PP stage
    kinds = r["layers_block_type"]
    assert kinds.count("attention") == 6 and kinds.count("linear_attention") == 18
    assert r["quantization"] == "auto_gptq"
