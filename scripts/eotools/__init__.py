# SPDX-License-Identifier: Apache-2.0
"""Tools of the expert-offload project that run outside vLLM: the pin, the synthetic test model,
cold-set and benchmark helpers. Scripts in scripts/ put this package on sys.path."""
