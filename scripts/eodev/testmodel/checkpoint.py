# SPDX-License-Identifier: Apache-2.0
"""Write a synthetic Qwen3-MoE checkpoint in Hugging Face format (one safetensors shard per
layer), its tokenizer, generation config, data sets and a description of what was planted."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from . import data, qwen4exp, tokenizer
from .plant import EOS_ID, Plan
from .weights import TensorFactory, gptq_config, to_checkpoint_dtype

FORMAT = "eo-synthetic-model/1"
MAX_POSITIONS = 40960


def hf_config(plan: Plan, quant: str) -> dict:
    g = plan.geometry
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": g.hidden_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "intermediate_size": 4 * g.moe_intermediate_size,  # dense MLP size; no layer uses one
        "moe_intermediate_size": g.moe_intermediate_size,
        "num_experts": g.num_experts,
        "num_experts_per_tok": g.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": g.vocab_size,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    if quant == "int4":
        cfg["quantization_config"] = gptq_config()
    return cfg


def write_datasets(plan: Plan, out: pathlib.Path, count: int, words: int) -> list[str]:
    """JSONL prompt sets, one file per (domain, split): data/<domain>.<split>.jsonl."""
    (out / "data").mkdir(exist_ok=True)
    names = []
    for domain in plan.planting.domains:
        for split in data.SPLITS:
            name = f"data/{domain}.{split}.jsonl"
            with open(out / name, "w") as f:
                for i, c in enumerate(data.conversations(plan, domain, split, count, words)):
                    row = {
                        "id": f"{domain}-{split}-{i}",
                        "domain": domain,
                        "split": split,
                        "topics": list(c.topics),
                        "prompt": c.text(plan),
                    }
                    f.write(json.dumps(row) + "\n")
            names.append(name)
    return names


def write(
    plan: Plan,
    out: pathlib.Path,
    quant: str = "int4",
    device: str = "cpu",
    prompts: int = 32,
    prompt_words: int = 256,
    report: dict | None = None,
    progress: Callable[[int, str], None] | None = None,
    weights: bool = True,
    shape: qwen4exp.Qwen4ExpShape | None = None,
) -> None:
    """Write the whole model directory. `progress(done, what)` is called after each shard.
    Without `weights`, everything but the safetensors shards (enough for tools that only need
    the tokenizer, the data sets or the planted routing). A qwen4_exp geometry needs `shape`
    (its layer mix, hyper-connections, PLE, QSA and Gated DeltaNet sizes)."""
    out.mkdir(parents=True, exist_ok=True)
    qwen4 = plan.geometry.arch == "qwen4_exp"
    if qwen4:
        if shape is None:
            raise ValueError("a qwen4_exp model needs its Qwen4ExpShape")
        factory: TensorFactory = qwen4exp.Qwen4ExpTensors(plan, shape, quant, device)
        config = qwen4exp.hf_config(plan, shape, quant, MAX_POSITIONS)
    else:
        factory = TensorFactory(plan, quant, device)
        config = hf_config(plan, quant)
    n_shards = plan.geometry.num_layers + 1 + qwen4  # qwen4_exp: MTP in a shard of its own
    weight_map: dict[str, str] = {}
    total = 0

    def save(index: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{index + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = to_checkpoint_dtype(tensors)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()

    if weights:
        save(0, factory.dense())
        if progress:
            progress(1, "embeddings and head")
        for layer in range(plan.geometry.num_layers):
            save(layer + 1, factory.layer(layer))
            if progress:
                progress(layer + 2, f"layer {layer}")
        if qwen4:
            save(n_shards - 1, factory.mtp())
            if progress:
                progress(n_shards, "MTP")
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save(plan, out, MAX_POSITIONS)
    datasets = write_datasets(plan, out, prompts, prompt_words)
    s_in, s_out = factory.expert_scales()
    desc = {
        "format": FORMAT,
        "generator": "scripts/make-test-model",
        "architecture": config["architectures"][0],
        "quantization": quant,
        "geometry": dataclasses.asdict(plan.geometry),
        "planting": dataclasses.asdict(plan.planting),
        "layout": {
            "token_dims": plan.token_dims,
            "const_dim": plan.const_dim,
            "own_topic_dims": [plan.own_slice.start, plan.own_slice.stop],
            "context_dims": [plan.context_slice.start, plan.context_slice.stop],
            "noise_dims": [plan.noise_slice.start, plan.noise_slice.stop],
        },
        "expert_scales": {"gate_up": s_in, "down": s_out},
        "datasets": datasets,
        "checkpoint_bytes": total if weights else None,
        "expert_bytes": factory.expert_bytes(),
        "report": report,
    }
    if qwen4:
        assert shape is not None
        desc["qwen4_exp"] = {
            **dataclasses.asdict(shape),
            "layer_types": shape.layer_types(plan.geometry.num_layers),
            "ple_layers": shape.ple_layers(plan.geometry.num_layers),
            # vLLM numbers the MTP layer after the model's; it is never a cold-file layer
            "mtp_layer": plan.geometry.num_layers,
        }
    (out / "synthetic_model.json").write_text(json.dumps(desc, indent=2) + "\n")


def prepare_dir(out: pathlib.Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty; pass --force to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
