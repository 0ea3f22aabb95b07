# SPDX-License-Identifier: Apache-2.0
"""Benchmark client for an OpenAI-compatible server (scripts/bench, scripts/compare-logprobs)."""
