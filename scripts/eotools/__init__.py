# SPDX-License-Identifier: Apache-2.0
"""The tools that ship in the image and that a user runs: the start-up preflight and budget
start, cold-file checks, counting, selection and the swap simulator, the memory plan, the pin.

Importable without torch or vLLM (the preflight loads torch only to probe a GPU), and without
the development tools in scripts/eodev, which the image does not ship. Scripts in scripts/ put
this package on sys.path."""
