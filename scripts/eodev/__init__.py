# SPDX-License-Identifier: Apache-2.0
"""Development tools: the synthetic test models, benchmarks, the GPU test harness and engine
probes, and helpers of the tests. Not in the image; they may use anything in eotools, never
the other way round (tests/cpu/test_tool_packages.py checks both)."""
