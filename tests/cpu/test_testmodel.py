# SPDX-License-Identifier: Apache-2.0
"""The synthetic test model: checkpoint format, tokenizer, planted routing and its statistics.

scripts/test tests/cpu/test_testmodel.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from eodev.testmodel import data, gptq
from eodev.testmodel.cli import PRESETS
from eodev.testmodel.plant import DOMAINS, Plan, Planting
from eodev.testmodel.reference import ReferenceModel
from eodev.testmodel.stats import (
    calibration_report,
    cold_share,
    count_picks_from_ids,
    least_used,
)

TINY = Plan(PRESETS["tiny"], Planting())


def make(tmp_path_factory, repo_root, quant: str):
    out = tmp_path_factory.mktemp(f"tiny-{quant}")
    cmd = [
        sys.executable,
        str(repo_root / "scripts/make-test-model"),
        str(out),
        "--preset",
        "tiny",
        "--quant",
        quant,
        "--device",
        "cpu",
        "--force",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_int4(tmp_path_factory, repo_root):
    return make(tmp_path_factory, repo_root, "int4")


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory, repo_root):
    return make(tmp_path_factory, repo_root, "bf16")


def topk_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of picks two (tokens, top_k) id arrays have in common, per token as sets."""
    return sum(len(set(x) & set(y)) for x, y in zip(a, b, strict=True)) / a.size


# ---- GPTQ packing ------------------------------------------------------------------------------
def test_gptq_pack_layout_and_round_trip():
    q = torch.arange(16).repeat(2).view(32, 1) % 16  # rows 0..15, 0..15 in one column
    packed = gptq.pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (4, 1)
    # row i lives in bits 4*(i % 8): the first word holds nibbles 7,6,...,0 from the top
    assert packed[0, 0].item() == 0x76543210
    assert packed[1, 0].item() == 0xFEDCBA98 - 2**32
    assert torch.equal(gptq.unpack_rows(packed), q)
    rnd = torch.randint(0, 16, (256, 24))
    assert torch.equal(gptq.unpack_rows(gptq.pack_rows(rnd)), rnd)


def test_gptq_dequantize_is_symmetric_around_eight():
    q = torch.tensor([[8], [0], [15]] + [[8]] * 5)
    w = gptq.dequantize(gptq.pack_rows(q), torch.tensor([[0.5]], dtype=torch.float16), group=8)
    assert w[:3, 0].tolist() == [0.0, -4.0, 3.5]
    zeros = gptq.qzeros(256, 16, 128)
    assert zeros.shape == (2, 2) and int(zeros[0, 0]) == 0x77777777


# ---- checkpoint --------------------------------------------------------------------------------
def test_checkpoint_files_and_config(tiny_int4):
    cfg = json.loads((tiny_int4 / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["num_experts"] == 512 and cfg["num_experts_per_tok"] == 10
    assert cfg["quantization_config"] == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }
    index = json.loads((tiny_int4 / "model.safetensors.index.json").read_text())
    names = index["weight_map"]
    assert all((tiny_int4 / shard).exists() for shard in set(names.values()))
    h, w = cfg["hidden_size"], cfg["moe_intermediate_size"]
    ref = ReferenceModel(tiny_int4)
    for e in (0, 511):
        pre = f"model.layers.3.mlp.experts.{e}"
        assert ref.tensor(f"{pre}.gate_proj.qweight").shape == (h // 8, w)
        assert ref.tensor(f"{pre}.down_proj.qweight").shape == (w // 8, h)
        assert ref.tensor(f"{pre}.down_proj.scales").shape == (w // 128, h)
        assert ref.tensor(f"{pre}.down_proj.scales").dtype == torch.float16
        assert ref.tensor(f"{pre}.up_proj.g_idx").tolist() == [i // 128 for i in range(h)]
    assert ref.tensor("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    assert json.loads((tiny_int4 / "generation_config.json").read_text())["eos_token_id"] == 0
    desc = json.loads((tiny_int4 / "synthetic_model.json").read_text())
    assert desc["geometry"]["num_experts"] == 512
    for name in desc["datasets"]:
        rows = [json.loads(x) for x in (tiny_int4 / name).read_text().splitlines()]
        assert len(rows) == 32 and all(r["prompt"] for r in rows)


def test_vllm_reads_the_quantisation_the_way_we_mean(tiny_int4):
    """vLLM's GPTQ config must see INT4 experts and treat attention and router as unquantised
    (it infers the quantised modules from the safetensors dtypes)."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    cfg = json.loads((tiny_int4 / "config.json").read_text())["quantization_config"]
    assert AutoGPTQConfig.override_quantization_method(cfg, None) == "auto_gptq"
    q = AutoGPTQConfig.from_config(cfg)
    q.maybe_update_config(str(tiny_int4))
    quantised = set(q.modules_in_block_to_quantize)
    assert "model.layers.2.mlp.experts.7.down_proj" in quantised
    assert not any("self_attn" in m or m.endswith("mlp.gate") for m in quantised)


def test_expert_outputs_never_touch_the_router_dimensions(tiny_int4):
    ref = ReferenceModel(tiny_int4)
    s = ref.tensor("model.layers.1.mlp.experts.5.down_proj.scales")
    assert s[:, TINY.token_dims :].abs().max() == 0
    assert s[:, : TINY.token_dims].abs().min() > 0


def test_bad_geometry_is_refused(tmp_path, repo_root):
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "scripts/make-test-model"),
            str(tmp_path / "m"),
            "--hidden-size",
            "128",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "too small" in r.stderr


def test_non_empty_output_needs_force(tmp_path, repo_root):
    (tmp_path / "keep").write_text("x")
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "scripts/make-test-model"),
            str(tmp_path),
            "--preset",
            "tiny",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3 and "--force" in r.stderr
    assert (tmp_path / "keep").exists()


# one routed expert of the target geometry in the INT4 checkpoint (hidden 2560, width 640, GPTQ
# group 128): gate and up 819,200 + 25,600 + 6,400 + 10,240 B each, down 819,200 + 25,600 +
# 6,400 + 2,560 B (qweight, fp16 scales, qzeros, g_idx)
TARGET_EXPERT_BYTES = 2 * 861_440 + 853_760


def test_too_little_disk_space_is_found_before_writing(tmp_path, monkeypatch):
    """A 24-layer target checkpoint holds 29.5 GiB of routed experts; what --force would
    remove counts as free."""
    import shutil

    from eodev.testmodel import cli

    plan = Plan(dataclasses.replace(cli.PRESETS["target"], num_layers=24), Planting())
    need = 24 * 512 * TARGET_EXPERT_BYTES
    out = tmp_path / "models" / "target-int4-24l"  # its parent does not exist yet
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage._replace(free=need))
    assert cli._disk_shortfall(plan, "int4", out, force=False) is None
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage._replace(free=need - 1000))
    why = cli._disk_shortfall(plan, "int4", out, force=False)
    assert why.startswith("the routed experts of 24 layers need 29.5 GiB")
    assert "remove other test models" in why
    out.mkdir(parents=True)
    (out / "model-00001.safetensors").write_bytes(b"x" * 1000)
    assert cli._disk_shortfall(plan, "int4", out, force=True) is None
    assert cli._disk_shortfall(plan, "int4", out, force=False) is not None


def test_make_test_model_stops_on_a_full_disk_before_removing_anything(
    tmp_path, monkeypatch, capsys
):
    import shutil

    from eodev.testmodel import cli

    out = tmp_path / "target-int4-24l"
    out.mkdir()
    (out / "keep").write_text("x")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage._replace(free=1 << 30))
    assert cli.main([str(out), "--layers", "24", "--force"]) == 4
    assert "need 29.5 GiB" in capsys.readouterr().err
    assert (out / "keep").exists()


# ---- tokenizer ---------------------------------------------------------------------------------
def test_tokenizer_round_trips_conversations(tiny_int4):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_int4))
    for domain in DOMAINS[:3]:
        conv = next(data.conversations(TINY, domain, "heldout", 1, 40))
        text = conv.text(TINY)
        ids = tok(text)["input_ids"]
        assert ids == list(conv.token_ids)
        assert tok.decode(ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant")
    assert tok(chat)["input_ids"][-1] == TINY.vocabulary.index("assistant")


# ---- the planted routing in a real forward pass ---------------------------------------------
def decode_stream(domain: str, words: int = 48, decode: int = 24) -> tuple[list[int], int]:
    conv = next(data.conversations(TINY, domain, "calibration", 1, words))
    return list(conv.token_ids) + data.greedy_continuation(TINY, conv.token_ids, decode), words


@pytest.mark.parametrize("domain", ["code", "chat", "legal"])
def test_forward_decodes_the_planted_chain_and_routes_as_planned(tiny_int4, domain):
    model = ReferenceModel(tiny_int4)
    seq, prompt = decode_stream(domain)
    res = model.forward(seq)
    # greedy decoding from the prompt follows the planted successor chain
    assert res.logits[prompt - 1 : -1].argmax(-1).tolist() == seq[prompt:]
    # the logprob of the chosen token is neither ~0 nor tiny: expert outputs move it
    chosen = res.logits.log_softmax(-1)[prompt - 1 : -1].max(-1).values
    assert -1.5 < chosen.mean().item() < -0.02
    for layer in range(TINY.geometry.num_layers):
        planned = TINY.router_topk(layer, np.array(seq))
        assert topk_agreement(res.topk_ids[:, layer].numpy(), planned) > 0.99


def test_expert_outputs_change_the_logprobs(tiny_int4):
    """A forward that reads a wrong expert must be visible in the logprobs: this is what the
    offload correctness tests rely on."""
    model = ReferenceModel(tiny_int4)
    seq, prompt = decode_stream("math")
    first = model.forward(seq)
    base = first.logits.log_softmax(-1)
    hot = np.bincount(first.topk_ids[:, 2].ravel().numpy(), minlength=512).argmax()
    model._experts[(2, int(hot))] = model.expert(2, (int(hot) + 1) % 512)  # read a neighbour
    swapped = model.forward(seq).logits.log_softmax(-1)
    diff = (base - swapped)[prompt - 1 : -1].gather(1, torch.tensor(seq[prompt:])[:, None])
    assert diff.abs().max().item() > 0.01


def test_transformers_agrees_with_the_reference_forward(tiny_bf16):
    """An independent implementation (transformers' Qwen3-MoE) loads the BF16 checkpoint and
    picks the same experts."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_bf16), dtype=torch.float32)
    seq, prompt = decode_stream("story", words=32, decode=8)
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_router_logits=True)
    ref = ReferenceModel(tiny_bf16).forward(seq)
    assert out.logits[0, prompt - 1 : -1].argmax(-1).tolist() == seq[prompt:]
    for layer in range(TINY.geometry.num_layers):
        hf_ids = out.router_logits[layer].topk(10, dim=-1).indices.numpy()
        assert topk_agreement(hf_ids, ref.topk_ids[:, layer].numpy()) > 0.99


def test_router_picks_counted_over_generated_prompts_are_skewed(tiny_int4):
    """Count the router's picks of a real forward pass over generated prompts of every domain:
    the least-used 10% of each layer's experts get a tiny share, the most-used 10% a large one,
    and a cold set counted on one domain is worse than uniform on its opposite domain."""
    model = ReferenceModel(tiny_int4)
    per_domain = {}
    for domain in DOMAINS:
        ids = []
        for conv in data.conversations(TINY, domain, "calibration", 2, 96):
            seq = list(conv.token_ids) + data.greedy_continuation(TINY, conv.token_ids, 32)
            ids.append(model.forward(seq).topk_ids.numpy())
        per_domain[domain] = count_picks_from_ids(np.concatenate(ids), 512)
    total = sum(per_domain.values())
    assert cold_share(least_used(total, 0.1), total) < 0.01  # uniform would be 10%
    hot = [np.argsort(row)[-51:] for row in total]
    assert cold_share(hot, total) > 0.35  # uniform would be 10%
    code_cold = least_used(per_domain["code"], 0.1)
    assert cold_share(code_cold, per_domain["story"]) > 0.10


# ---- calibration of the plan ---------------------------------------------------------------
def test_planted_statistics_match_the_reference():
    """The calibration targets: least-used 10% get ~0.3% in-sample; a cold set of 10% from
    normalised multi-domain counts gets ~2.5% on held-out prompts; one-domain sets are worse
    than uniform on the opposite domain; the mixed set beats uniform on every domain."""
    plan = Plan(PRESETS["tiny"], Planting())
    r = calibration_report(plan, conversations_per_domain=12)
    assert 0.0015 < r["in_sample_share"] < 0.006
    assert 0.015 < r["heldout_share"] < 0.04
    assert all(v < 0.10 for v in r["heldout_share_by_domain"].values())
    for i, d in enumerate(plan.planting.domains):
        opposite = plan.planting.domains[i ^ 1]
        assert r["single_domain_share"][d][opposite] > 0.10


def test_router_structure_does_not_depend_on_hidden_size():
    a = Plan(PRESETS["tiny"], Planting())
    b = Plan(dataclasses.replace(PRESETS["tiny"], hidden_size=2560), Planting())
    ids = np.array(next(data.conversations(a, "code", "heldout", 1, 64)).token_ids)
    assert np.array_equal(np.sort(a.router_topk(1, ids)), np.sort(b.router_topk(1, ids)))


def test_conversations_are_deterministic_and_in_domain():
    one = list(data.conversations(TINY, "math", "calibration", 3, 50, seed=4))
    two = list(data.conversations(TINY, "math", "calibration", 3, 50, seed=4))
    assert one == two
    d = DOMAINS.index("math")
    topics = TINY.word_topic[np.array(one[0].token_ids)]
    assert np.all(topics // TINY.planting.topics_per_domain == d)
    with pytest.raises(ValueError, match="unknown domain"):
        next(data.conversations(TINY, "poetry", "calibration", 1, 5))
