# SPDX-License-Identifier: Apache-2.0
"""Docker's variable substitution, shared by the memory plan (compose files' ${VAR:-default})
and the development tools that read the Dockerfile."""

from __future__ import annotations

import re

VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def substitute(text: str, env: dict[str, str]) -> str:
    """Docker's ${VAR}, ${VAR:-default} and $VAR substitution (unset or empty: the default, or
    nothing)."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env and env[name] != "":
            return env[name]
        return m.group(2) or ""

    return VAR.sub(repl, text)
