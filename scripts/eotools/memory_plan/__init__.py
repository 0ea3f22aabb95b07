# SPDX-License-Identifier: Apache-2.0
"""Per-card VRAM and host RAM of a Qwen3-MoE, Qwen3-Next or Qwen4Exp MoE model under a pipeline
topology, from its config.json and (when present) its safetensors headers, so that a user knows
before downloading whether a machine fits (scripts/memory-plan).

Sizes follow vLLM 0.29.0 as released; each module cites the lines it follows:

- model_shape: the config fields the plan needs, with the upstream defaults of missing ones;
- weights: weight bytes per layer, from the safetensors headers or estimated from the config;
- serving: the topology and vLLM arguments that decide memory, from flags or a compose file;
- kv_cache: KV cache and recurrent state of one rank for one request at --max-model-len;
- estimate: each card's VRAM and the host RAM, and what must change for a card to fit;
- render: the plan as Markdown tables or JSON;
- cli: the command line and its exit codes.
"""
