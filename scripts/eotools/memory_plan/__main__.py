# SPDX-License-Identifier: Apache-2.0
"""`python3 -m eotools.memory_plan` (in scripts/): the same command as scripts/memory-plan."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
