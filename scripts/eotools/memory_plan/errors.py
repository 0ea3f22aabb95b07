# SPDX-License-Identifier: Apache-2.0
"""The one error of the memory plan: every module raises it, and the command line turns it into
a message and exit code 2 instead of a traceback."""


class PlanError(ValueError):
    """An input the plan cannot use; the message names the fix."""
