# SPDX-License-Identifier: Apache-2.0
"""The synthetic Qwen3-MoE test model: planted routing structure, checkpoint writer, tokenizer,
data sets and a reference forward pass. Entry point: scripts/make-test-model."""
