# SPDX-License-Identifier: Apache-2.0
"""The configuration names of the result format (DEVELOPERS.md): one place for every tool."""

CONFIGS = (
    "unpatched",
    "cpu-offload-gb",
    "offload-01",
    "offload-02",
    "offload-03",
    "offload-03-swap",
)
