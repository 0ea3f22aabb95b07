# SPDX-License-Identifier: Apache-2.0
"""Development tools: the synthetic test models, benchmarks, the GPU test harness and engine
probes, and helpers of the tests. They may use anything in eotools, never the other way round
(tests/cpu/test_tool_packages.py checks both). Of these only the test-model generator is in
the image, for compose/tiny.yml (.dockerignore)."""
