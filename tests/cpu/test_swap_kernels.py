# SPDX-License-Identifier: Apache-2.0
"""The runtime-swap kernels on the CPU, through Triton's interpreter
(tests/cpu/swap_interpreted_checks.py, in a process of its own: Triton fixes the interpreter
mode when it is first imported, and this process has imported it compiled).

    scripts/test tests/cpu/test_swap_kernels.py
"""

from __future__ import annotations


def test_swap_kernels_in_the_triton_interpreter(run_interpreted):
    run_interpreted("tests/cpu/swap_interpreted_checks.py", 17)
