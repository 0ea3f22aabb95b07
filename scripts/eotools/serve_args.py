# SPDX-License-Identifier: Apache-2.0
"""What start-up needs from a `vllm serve` command line: the model, the pipeline and tensor
parallel sizes, the API keys given with --api-key, and whether help was asked for.

A module of its own so that the start program, budget-start and the preflight read the
command line the same way, and budget-start does not depend on the preflight. The arguments
themselves go to vLLM unchanged; vLLM's own parser has the last word on everything else.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# far above any machine these images serve on; bounds what a typo can ask for
MAX_PARALLEL = 1024

_OPTIONS = {
    "--model": "model",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
}


# options vLLM's parser would also take shortened (argparse's abbreviations) or from a file:
# start-up would read them as absent, so they are refused with the full spelling
_SPELLED_OUT = ("--model", "--pipeline-parallel-size", "--tensor-parallel-size", "--api-key")


class ServeArgsError(ValueError):
    """A serve argument start-up needs and cannot read; the message names it."""


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    pp: int = 1
    tp: int = 1
    api_keys: tuple[str, ...] | None = None  # None: no --api-key among the arguments
    wants_help: bool = False


def _option(arg: str) -> tuple[str, bool, str]:
    """An argument as (option name with dashes, whether it has '=', inline value); vLLM's
    parser accepts --pipeline_parallel_size for --pipeline-parallel-size."""
    key, eq, inline = arg.partition("=")
    if key.startswith("--"):
        key = "--" + key[2:].replace("_", "-")
    return key, bool(eq), inline


def _size(option: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 6:
        raise ServeArgsError(
            f"cannot read the parallel sizes of the serve arguments: {option} {text[:40]!r} "
            "is not a whole number"
        )
    size = int(text)
    if not 1 <= size <= MAX_PARALLEL:
        raise ServeArgsError(
            f"cannot read the parallel sizes of the serve arguments: {option} {size} is "
            f"outside 1-{MAX_PARALLEL}"
        )
    return size


def parse(args: Sequence[str]) -> ServeArgs:
    """The parts of a `vllm serve` command line start-up uses (the model is the leading
    positional argument or --model; the last of repeated options wins, as in argparse)."""
    args = list(args)
    model = args[0] if args and not args[0].startswith("-") else None
    for arg in args:
        key = _option(arg)[0]
        if key == "--config":
            raise ServeArgsError(
                "--config: start-up reads the model, the parallel sizes and the API key from "
                "the command line, not from a config file; give them as arguments"
            )
        if len(key) > 3 and key not in _OPTIONS and key != "--api-key":
            whole = [o for o in _SPELLED_OUT if o.startswith(key)]
            if whole:
                raise ServeArgsError(
                    f"{key} is a shortened option (vLLM would read it as {whole[0]}, start-up "
                    f"would not); write {whole[0]} in full"
                )
    values: dict[str, tuple[str, str]] = {}
    api_keys: list[str] | None = None
    wants_help = False
    for i, arg in enumerate(args):
        key, eq, inline = _option(arg)
        if key in ("-h", "--help"):
            wants_help = True
        elif key == "--api-key":
            # one or more keys (nargs="+"): the values up to the next option
            api_keys = api_keys or []
            if eq:
                api_keys.append(inline)
            else:
                taken = list(itertools.takewhile(lambda a: not a.startswith("-"), args[i + 1 :]))
                api_keys.extend(taken or [""])
        elif key in _OPTIONS:
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
            else:
                raise ServeArgsError(f"the serve argument {key} has no value after it")
            values[_OPTIONS[key]] = (key, value)
    if "model" in values:
        model = values["model"][1]
    pp = _size(*values["pp"]) if "pp" in values else 1
    tp = _size(*values["tp"]) if "tp" in values else 1
    keys = tuple(api_keys) if api_keys is not None else None
    return ServeArgs(model or None, pp, tp, keys, wants_help)
