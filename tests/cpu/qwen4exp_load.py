# SPDX-License-Identifier: Apache-2.0
"""Build vLLM 0.29.0's Qwen4ExpForCausalLM from a make-test-model checkpoint on the CPU and load
every tensor into it (no forward pass). Run as a script in a process of its own (it adjusts a
few vLLM internals that only matter without a GPU, listed below); prints one JSON line.

    VLLM_TARGET_DEVICE=cpu python tests/cpu/qwen4exp_load.py MODEL_DIR

What this process changes, and why it does not weaken the check:
- `torchvision` is absent from the CPU test environment, and vLLM's Qwen4Exp module imports
  the Qwen3-VL processor, which imports `torchvision.transforms.v2.functional` at module level:
  an empty module stands in (no image is ever processed);
- vLLM inspects the architecture in a subprocess (to keep CUDA out of the parent); here it runs
  in this process, so the stand-in above applies;
- QSA refuses to build without FlashAttention's varlen kernel, activations look up
  `torch.ops._C` kernels the CPU wheel lacks, and no INT4 MoE kernel supports the CPU: all are
  only called in a forward pass; the INT4 experts get the backend a GPU picks (Marlin), so
  their parameters are created and loaded as on a GPU (repacking, after loading, is not run).
"""

from __future__ import annotations

import json
import pathlib
import sys
import types


def _cpu_stand_ins() -> None:
    import torch
    import vllm.config  # noqa: F401  (transformers decides torchvision is absent first)

    for name in (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["torchvision.transforms.v2"].functional = sys.modules[  # type: ignore[attr-defined]
        "torchvision.transforms.v2.functional"
    ]
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()
    lib = torch.library.Library("_C", "FRAGMENT")
    for op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
        if not hasattr(torch.ops._C, op):
            lib.define(f"{op}(Tensor! out, Tensor input) -> ()")
    _cpu_stand_ins.lib = lib  # type: ignore[attr-defined]  (keep the definitions alive)
    import vllm.model_executor.layers.quantization.auto_gptq as auto_gptq
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    def marlin(*args, **kwargs):  # the GPU's choice for GPTQ INT4 experts (Marlin)
        backend = int_wna16.WNA16MoEBackend.MARLIN
        return backend, int_wna16.backend_to_kernel_cls(backend)[0]

    auto_gptq.select_wna16_moe_backend = marlin
    import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (qsa imports model first)
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    qsa.is_flash_attn_varlen_func_available = lambda: True


def checkpoint_tensors(model_dir: pathlib.Path):
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def same_values(model, model_dir: pathlib.Path) -> dict[str, bool]:
    """A few loaded parameters against the checkpoint tensors they came from."""
    import torch
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())

    def ckpt(name: str) -> torch.Tensor:
        with safe_open(str(model_dir / index["weight_map"][name]), framework="pt") as f:
            return f.get_tensor(name)

    layers = model.model.layers
    pre = "model.language_model.layers"
    out = {}
    routed = layers[2].mlp.experts.routed_experts
    if hasattr(routed, "w13_qweight"):
        n = routed.w2_qweight.shape[1] * 8  # w2: (E, width / 8, hidden)
        out["expert 7 gate_proj.qweight"] = torch.equal(
            routed.w13_qweight[7][:, :n], ckpt(f"{pre}.2.mlp.experts.7.gate_proj.qweight")
        )
        scales = routed.w2_scales[7]  # stored FP16, held in the model's dtype
        out["expert 7 down_proj.scales"] = torch.equal(
            scales, ckpt(f"{pre}.2.mlp.experts.7.down_proj.scales").to(scales.dtype)
        )
    ple = layers[1].ple.ple_embedding.ngram_embedding.weight
    out["layer 1 n-gram table"] = torch.equal(
        ple, ckpt(f"{pre}.1.ple.ple_embedding.ngram_embedding.weight").to(ple.dtype)
    )
    shared = layers[3].mlp.shared_expert.down_proj.weight
    out["layer 3 shared_expert.down_proj"] = torch.equal(
        shared, ckpt(f"{pre}.3.mlp.shared_expert.down_proj.weight").to(shared.dtype)
    )
    return out


NOT_STORED = ("_bias", "_g_idx_sort_indices")  # GPTQ: no biases; the act-order sort is built


def load_mtp(vc, model_dir: pathlib.Path) -> dict:
    """Build vLLM's drafter (Qwen4ExpMTP, as `--speculative-config '{"method": "mtp"}'`
    would) and load the checkpoint into it: every MTP parameter must come from `mtp.*` (or
    the shared embedding and head)."""
    import dataclasses

    import torch
    from vllm.config import ParallelConfig, SpeculativeConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    spec = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=1,
        target_model_config=vc.model_config,
        target_parallel_config=ParallelConfig(),
    )
    draft = dataclasses.replace(vc, model_config=spec.draft_model_config, speculative_config=spec)
    with (
        set_current_vllm_config(draft),
        set_default_torch_dtype(torch.bfloat16),
        torch.device("cpu"),
    ):
        mtp = Qwen4ExpMTP(vllm_config=draft, prefix="")
    params = {n for n, _ in mtp.named_parameters()}
    loaded = {
        n.replace(".mlp.experts.", ".mlp.experts.routed_experts.")
        for n in mtp.load_weights(checkpoint_tensors(model_dir))
    }
    moe = [
        m.layer_name
        for m in mtp.modules()
        if hasattr(m, "layer_name") and "experts" in m.layer_name
    ]
    return {
        "mtp_architecture": spec.draft_model_config.architectures[0],
        "mtp_params": len(params),
        "mtp_missing": sorted(n for n in params - loaded if not n.endswith(NOT_STORED)),
        "mtp_moe_layers": sorted(set(moe)),
    }


def main(model_dir: pathlib.Path) -> dict:
    _cpu_stand_ins()
    import torch
    from eodev.vllm_context import free_port
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc = ModelConfig(model=str(model_dir), dtype="bfloat16")
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    result: dict = {
        "architecture": mc.architectures[0],
        "hf_config": type(mc.hf_config).__name__,
        "text_config": type(mc.hf_text_config).__name__,
        "quantization": mc.quantization,
    }
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
        try:
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                model = initialize_model(vllm_config=vc)
            params = {n for n, _ in model.named_parameters()}
            seen: list[str] = []

            def tensors():
                for name, t in checkpoint_tensors(model_dir):
                    seen.append(name)
                    yield name, t

            # the MoE runner reports its experts' parameters without `.routed_experts`
            loaded = {
                n.replace(".mlp.experts.", ".mlp.experts.routed_experts.")
                for n in model.load_weights(tensors())
            }
            experts = model.model.layers[0].mlp.experts.routed_experts
            result.update(
                model_class=type(model).__name__,
                checkpoint_tensors=len(seen),
                mtp_tensors=sum(n.startswith("mtp.") for n in seen),
                params=len(params),
                missing=sorted(n for n in params - loaded if not n.endswith(NOT_STORED)),
                same_values=same_values(model, model_dir),
                moe_method=type(experts.quant_method).__name__,
                expert_params=sorted(n.rsplit(".", 1)[-1] for n, _ in experts.named_parameters()),
                ple_layers=[
                    i for i, layer in enumerate(model.model.layers) if layer.ple is not None
                ],
                layer_kinds=[
                    "qsa" if hasattr(layer, "self_attn") else "gdn" for layer in model.model.layers
                ],
                shared_expert=type(model.model.layers[0].mlp.shared_expert).__name__,
            )
            del model
            result.update(load_mtp(vc, model_dir))
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return result


def config_only(model_dir: pathlib.Path) -> dict:
    """vLLM's config of the model (what `vllm serve` resolves before building anything)."""
    _cpu_stand_ins()
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(model_dir), dtype="bfloat16")
    VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    text = mc.hf_text_config
    return {
        "architecture": mc.architectures[0],
        "text_config": type(text).__name__,
        "num_layers": text.num_hidden_layers,
        "ple_layer_ids": list(text.ple_layer_ids),
        "layers_block_type": text.layers_block_type,
        "quantization": mc.quantization,
    }


if __name__ == "__main__":
    if sys.argv[2:] == ["--config-only"]:
        print("RESULT " + json.dumps(config_only(pathlib.Path(sys.argv[1]))))
    else:
        print("RESULT " + json.dumps(main(pathlib.Path(sys.argv[1]))))
