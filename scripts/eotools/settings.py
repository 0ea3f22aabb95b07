# SPDX-License-Identifier: Apache-2.0
"""Every environment setting the series, the image's start program and the compose files
read, in one table: name, type, range, default and what it does.

The start program (scripts/start, the image's entrypoint) reads them all through this table
before anything else runs, so that a value vLLM would read differently from what was meant
("yes" for 0/1, "-1" read as true, "HOST" refused deep in a worker, "inf" GiB, a relative
folder) stops the start with a message naming the setting, the value, the problem and the
fix. ``--help`` and docs/configuration.md print the same table (``python3 -m
eotools.settings`` writes its Markdown).

An empty value means unset, for every setting (compose's ``${COLD_FILE:-}``); the start
program removes empty settings from the environment before it starts vLLM, so that vLLM
sees its defaults too.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .cold_contract import MAX_LAYERS, ContractError, parse_layer_list

# upper bounds of what a typo can ask for; each far above what a real setup uses
MAX_BUDGET_GIB = 4096.0  # routed experts on host, per card
MAX_LAYER = 4095  # the highest layer number any model has (bounds layer lists and ranges)
PREFLIGHT_CHECKS = ("vllm", "cold-file", "host-memory", "gpus", "host-mapping")
TOPOLOGY_NAMES = ("2x32GB", "3x24GB", "2x24GB", "tiny")  # eotools/topologies.py
DEFAULT_API_KEY_FILE = "/run/secrets/vllm_api_key"


class SettingError(ValueError):
    """A setting that start-up refuses: which one, its value, what is wrong, the fix."""

    def __init__(self, name: str, value: str, problem: str, fix: str, secret: bool = False):
        shown = "(hidden)" if secret else repr(value if len(value) <= 80 else value[:77] + "...")
        super().__init__(f"{name}={shown}: {problem}")
        self.name, self.problem, self.fix = name, problem, fix


class Invalid(ValueError):
    """What a kind's parser raises: the problem, and the fix where it knows a better one
    than the setting's own."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.fix = fix


@dataclass(frozen=True)
class Kind:
    """A type with its range: `parse` turns the text into a value or raises Invalid."""

    type: str  # as the table shows it
    range: str  # as the table shows it
    parse: Callable[[str], Any]


def flag() -> Kind:
    def parse(text: str) -> bool:
        if text not in ("0", "1"):
            raise Invalid("must be 0 or 1")
        return text == "1"

    return Kind("0/1", "0 or 1", parse)


_INT = re.compile(r"-?[0-9]{1,12}")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")


def integer(low: int, high: int) -> Kind:
    def parse(text: str) -> int:
        if not _INT.fullmatch(text):
            raise Invalid("not a whole number")
        value = int(text)
        if not low <= value <= high:
            raise Invalid(f"outside {low}-{high}")
        return value

    return Kind("integer", f"{low}-{high:,}", parse)


def _plain(x: float) -> str:
    """1e9 as 1,000,000,000."""
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def number(low: float, high: float, low_open: bool = False) -> Kind:
    """A finite decimal number in [low, high] ((low, high] with low_open)."""

    def parse(text: str) -> float:
        if not _NUMBER.fullmatch(text):
            raise Invalid("not a finite decimal number (inf, nan and hex are refused)")
        value = float(text)
        if not math.isfinite(value):
            raise Invalid("not a finite number (it overflows to infinity)")
        if value < low or (low_open and value == low) or value > high:
            raise Invalid(f"outside {shown}")
        return value

    shown = f"{'>' if low_open else '>='} {_plain(low)} and <= {_plain(high)}"
    return Kind("number", shown, parse)


def choice(options: Iterable[str]) -> Kind:
    options = tuple(options)

    def parse(text: str) -> str:
        if text in options:
            return text
        lower = [o for o in options if o.lower() == text.lower()]
        if lower:  # vLLM compares case-sensitively: "HOST" is not "host"
            raise Invalid(f"not one of {', '.join(options)} (case matters)", f"write {lower[0]}")
        raise Invalid(f"not one of {', '.join(options)}")

    return Kind("choice", " or ".join(options), parse)


def names(options: Iterable[str] | None, pattern: str = r"[A-Za-z][A-Za-z0-9_-]*") -> Kind:
    """A comma-separated list of names from `options` (or matching `pattern`)."""
    known = tuple(options) if options is not None else None
    form = re.compile(pattern)

    def parse(text: str) -> frozenset[str]:
        out = set()
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            if (known is not None and item not in known) or not form.fullmatch(item):
                listed = f"; known: {', '.join(known)}" if known else ""
                raise Invalid(f"{item[:40]!r} is not a name this setting takes{listed}")
            out.add(item)
        return frozenset(out)

    shown = ", ".join(known) if known else "names"
    return Kind("comma list", shown, parse)


def path(what: str) -> Kind:
    """An absolute path: a relative one would be read against whatever folder vLLM's
    processes run in, and what they keep there would be lost with the container."""

    def parse(text: str) -> str:
        if "\0" in text or "\n" in text:
            raise Invalid("holds a control character")
        if not text.startswith("/"):
            raise Invalid(
                "a relative path: it would be resolved against the server's working folder",
                f"give the absolute path of the {what} (starting with /)",
            )
        return text

    return Kind("path", f"absolute path of a {what}", parse)


def layer_list(variable: str) -> Kind:
    def parse(text: str) -> frozenset[int]:
        try:
            # the contract's own cap; the model's layers are checked once it is read
            return parse_layer_list(text, variable)
        except ContractError as e:  # problem: "VARIABLE='spec': what", and its fix
            raise Invalid(e.problem.split(": ", 1)[-1], e.fix) from None

    return Kind("layer list", f"layers 0-{MAX_LAYERS - 1} and ranges, e.g. 0-5,40", parse)


def partition() -> Kind:
    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):
            raise Invalid("not a comma-separated list of layer counts, one per pipeline stage")
        counts = tuple(int(p) for p in parts)
        if min(counts) < 1:
            raise Invalid("a pipeline stage of 0 layers")
        return counts

    return Kind("layer counts", "one count >= 1 per pipeline stage, e.g. 24,24", parse)


def secret() -> Kind:
    def parse(text: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in text):
            raise Invalid("holds a control character (a newline?), which no client can send")
        if text != text.strip():
            raise Invalid("starts or ends with a space, which clients do not send")
        return text

    return Kind("text", "printable, no surrounding spaces", parse)


def derived(by: str) -> Kind:
    """A value the start sets itself; one set from outside would skip what decides it."""

    def parse(text: str) -> str:
        raise Invalid(f"is set by the start ({by}), not by hand", "unset it")

    return Kind("set by the start", "unset", parse)


@dataclass(frozen=True)
class Setting:
    name: str
    kind: Kind
    default: str  # the text used when unset or empty ("" : none)
    what: str
    reader: str  # "vLLM" (the series or vLLM itself) or "start" (the image's start-up)
    fix: str = ""  # what to set instead, where more can be said than the range
    secret: bool = False

    def read(self, text: str | None) -> Any:
        """The value of `text` (None or empty: the default's); SettingError if refused."""
        if not text:
            return self.kind.parse(self.default) if self.default else None
        try:
            return self.kind.parse(text)
        except Invalid as e:
            fix = e.fix or self.fix or f"set {self.name} to {self.kind.range}"
            default = f"the default, {self.default}" if self.default else "none"
            raise SettingError(
                self.name,
                text,
                str(e),
                f"{fix}, or unset it ({default})",
                self.secret,
            ) from None


def _flag(name: str, default: str, what: str, reader: str, on: str, off: str) -> Setting:
    return Setting(name, flag(), default, what, reader, f"set {name}=1 ({on}) or {name}=0 ({off})")


SETTINGS: tuple[Setting, ...] = (
    # read by the patched vLLM (envs.py of the series) or vLLM itself
    Setting(
        "VLLM_EXPERT_HOST_LAYERS",
        layer_list("VLLM_EXPERT_HOST_LAYERS"),
        "",
        "MoE layers whose routed experts all live in host memory: absolute layer numbers and "
        "ranges in ASCII digits, separated by commas, e.g. 0-5,40 (spaces around numbers, "
        "dashes and commas are allowed; a range runs upwards)",
        "vLLM",
        "list layer numbers and ranges of the model's layers, such as 0-5,40",
    ),
    Setting(
        "VLLM_EXPERT_COLD_FILE",
        path("cold file"),
        "",
        "a cold file (cold/README.md): per layer, the experts kept in host memory; in the "
        "image a path inside the container (compose: COLD_FILE, in the folder mounted at "
        "/cold); unset with EO_HOST_BUDGET_GIB set: a budget-only start",
        "vLLM",
    ),
    _flag(
        "VLLM_EXPERT_ONE_TABLE",
        "0",
        "1: merge each split layer into one table in a CUDA virtual range (offload-03; the "
        "compose files' default 1); layers fall back to two tables when the driver refuses",
        "vLLM",
        "one table per split layer, offload-03",
        "two tables, offload-02",
    ),
    _flag(
        "VLLM_EXPERT_SWAP",
        "1",
        "with one table: 1 moves the experts the router keeps picking into VRAM at run time, "
        "0 keeps the start-up placement",
        "vLLM",
        "runtime swap",
        "keep the start-up placement",
    ),
    Setting(
        "VLLM_EXPERT_SWAP_INTERVAL",
        integer(1, 1_000_000),
        "8",
        "runtime swap: decode steps between decisions",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_SWAP_HALF_LIFE",
        number(0, 1e9, low_open=True),
        "512",
        "runtime swap: decode steps for a pick count to halve",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_SWAP_MARGIN",
        number(-1e9, 1e9),
        "2",
        "runtime swap: how much more a host expert must be used than the least used GPU "
        "expert to trade places (negative: every layer swaps at every decision, a stress "
        "test only)",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_SWAP_SELF_CHECK",
        integer(0, 1_000_000_000),
        "0",
        "testing: every N swap decisions, check that every row holds the expert it should "
        "(slow; 0: never)",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_COUNT_FILE",
        path("counts file"),
        "",
        "count each MoE layer's router picks per expert and write them to this JSON file "
        "(one per pipeline rank: .ppN); a budget-only start sets it in EO_STATE_DIR",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_COUNT_INTERVAL_S",
        number(0, 7 * 86400),
        "60",
        "seconds between periodic writes of the count file (0: only on shutdown and request)",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_COUNT_TRACE_TOKENS",
        integer(0, 10_000_000),
        "0",
        "with the count file: also record the router's picks of the first N decode tokens "
        "(device memory N x layers x top_k x 2 bytes; 0: off)",
        "vLLM",
    ),
    Setting(
        "VLLM_EXPERT_METRICS_DIR",
        path("folder"),
        "",
        "folder where each worker rank writes its offload numbers for /metrics; vllm serve "
        "makes one when an offload path is set",
        "vLLM",
    ),
    _flag(
        "VLLM_EXPERT_PREFILL_STAGING",
        "0",
        "1: prefill chunks of at least VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS tokens run each "
        "layer's host experts from a VRAM copy made one layer ahead (two VRAM slots)",
        "vLLM",
        "prefill staging",
        "no staging",
    ),
    Setting(
        "VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS",
        integer(1, 1 << 24),
        "2048",
        "the fewest tokens of a forward that prefill staging copies the host experts for",
        "vLLM",
    ),
    _flag(
        "VLLM_EXPERT_DECODE_PREFETCH",
        "0",
        "1 (experimental, with one table and prefill staging): decode steps copy the next "
        "layer's host experts, guessed through its router, into its staging slot while this "
        "layer computes, so kernels read host experts from VRAM",
        "vLLM",
        "decode prefetch",
        "UVA reads in decode",
    ),
    Setting(
        "VLLM_EXPERT_DECODE_PREFETCH_PROGRAMS",
        integer(1, 4096),
        "16",
        "decode prefetch: programs of the guess's copy kernel (the SMs it may take from the "
        "compute it overlaps)",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_TABLE",
        choice(("gpu", "host", "file", "auto")),
        "gpu",
        "Qwen4Exp: where each PLE layer's n-gram table lives (95.37 GiB BF16): gpu (VRAM, "
        "upstream), host (page-locked host memory read through UVA), file (left in the "
        "checkpoint's safetensors files, read through the page cache) or auto (host where "
        "the host's free memory covers it with a margin, else file; the compose files' "
        "default); lower case only, as vLLM reads it",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_TABLE_RESOLVED",
        derived("from the preflight's decision for VLLM_PLE_TABLE=auto"),
        "",
        "what VLLM_PLE_TABLE=auto was decided to be (host or file): the start passes the "
        "preflight's decision to vLLM so that both count the same memory; set "
        "VLLM_PLE_TABLE=host or file to choose",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_PREFETCH_THREADS",
        integer(0, 256),
        "8",
        "VLLM_PLE_TABLE=file: threads reading a new request's n-gram rows into the page cache "
        "before its prefill (0: none)",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_AUTO_RESERVE_GB",
        number(0, 1_000_000),
        "8",
        "VLLM_PLE_TABLE=auto: host memory (GiB) kept for vLLM's processes before the tables "
        "are pinned",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_AUTO_HOST_EXPERTS_GB",
        number(0, 1_000_000),
        "",
        "VLLM_PLE_TABLE=auto: host memory (GiB) the host experts take (unset: "
        "EO_HOST_BUDGET_GIB x GPUs)",
        "vLLM",
    ),
    Setting(
        "VLLM_PLE_MIN_READS_PER_S",
        number(0, 100_000_000),
        "2000",
        "VLLM_PLE_TABLE=file: warn at start-up when the table's drive gives fewer random "
        "4 KiB reads per second",
        "vLLM",
    ),
    _flag(
        "VLLM_PLE_FILE_EVICT",
        "0",
        "measurements only: 1 drops the table's pages from the page cache when it is opened",
        "vLLM",
        "a cold start",
        "keep the page cache",
    ),
    Setting(
        "VLLM_EXPERT_VMM_FAIL_AT",
        names(None, r"cu[A-Za-z]+(\[[a-z]+\])?"),
        "",
        "tests only: VMM driver calls that fail on purpose, by label (cuMemCreate[host], "
        "cuMemMap[device], ...) or bare name",
        "vLLM",
        "name driver calls such as cuMemCreate[host] or cuMemMap",
    ),
    Setting(
        "VLLM_PP_LAYER_PARTITION",
        partition(),
        "",
        "vLLM's own: layers per pipeline stage, one count per stage summing to the model's "
        "layers (unset: vLLM's even split); budget-start and the preflight split the same way",
        "vLLM",
        "give one layer count per pipeline stage, such as 24,24",
    ),
    Setting(
        "VLLM_API_KEY",
        secret(),
        "",
        "vLLM's own: the key clients must send (Authorization: Bearer KEY); unset: read from "
        "VLLM_API_KEY_FILE",
        "vLLM",
        "set the key without spaces or line breaks around it",
        secret=True,
    ),
    # read by the image's start program
    Setting(
        "VLLM_API_KEY_FILE",
        path("file"),
        DEFAULT_API_KEY_FILE,
        "where the start reads the API key when VLLM_API_KEY is unset (a Docker secret); a "
        "regular file of at most 4 KiB, surrounding white space stripped; the default may be "
        "missing, a file named here must exist",
        "start",
    ),
    _flag(
        "EO_ALLOW_NO_API_KEY",
        "0",
        "1: serve without an API key (anyone who reaches the port can use the model)",
        "start",
        "serve without a key",
        "a key is required",
    ),
    Setting(
        "EO_HOST_BUDGET_GIB",
        number(0, MAX_BUDGET_GIB, low_open=True),
        "",
        "budget-only start, when VLLM_EXPERT_COLD_FILE is unset or empty: GiB of routed "
        "experts per card in host memory; writes a cold file and learns usage across "
        "restarts (budget-start --help)",
        "start",
        f"give the GiB of routed experts per card on host, e.g. 7.6 (at most {MAX_BUDGET_GIB:g})",
    ),
    Setting(
        "EO_STATE_DIR",
        path("folder"),
        "/state",
        "where a budget-only start keeps what it learned (mount a volume there)",
        "start",
    ),
    _flag(
        "EO_SKIP_PREFLIGHT",
        "0",
        "1: start vLLM without the preflight",
        "start",
        "no preflight",
        "run the preflight",
    ),
    Setting(
        "EO_PREFLIGHT_SKIP",
        names(PREFLIGHT_CHECKS),
        "",
        "comma-separated preflight checks to skip",
        "start",
    ),
    Setting(
        "EO_TOPOLOGY",
        choice((*TOPOLOGY_NAMES, "any")),
        "any",
        "the hardware the preflight checks against (the image's TOPOLOGY build argument)",
        "start",
    ),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def read(environ: Mapping[str, str], only: Iterable[str] | None = None) -> dict[str, Any]:
    """Every setting's value (its default's where unset or empty), in table order;
    SettingError for the first that is refused."""
    wanted = set(only) if only is not None else None
    return {
        s.name: s.read(environ.get(s.name)) for s in SETTINGS if wanted is None or s.name in wanted
    }


def empty_settings(environ: Mapping[str, str]) -> list[str]:
    """Settings of the table that are set but empty (to be unset before vLLM starts)."""
    return [s.name for s in SETTINGS if s.name in environ and not environ[s.name]]


def _row(s: Setting) -> tuple[str, ...]:
    default = f"`{s.default}`" if s.default else "unset"
    return (f"`{s.name}`", s.kind.type, s.kind.range, default, s.what)


def markdown(reader: str) -> str:
    """The table's rows read by `reader` as a Markdown table (docs/configuration.md)."""
    head = "| setting | type | range | default | what it does |\n|---|---|---|---|---|\n"
    return head + "".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in _row(s)) + " |\n"
        for s in SETTINGS
        if s.reader == reader
    )


def text_table(width: int = 96) -> str:
    """The table for --help: one block per setting."""
    import textwrap

    out = []
    for s in SETTINGS:
        default = s.default or "unset"
        out.append(f"  {s.name}  [{s.kind.type}: {s.kind.range}; default {default}]")
        out += textwrap.wrap(s.what, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(out)


if __name__ == "__main__":  # python3 -m eotools.settings: the tables of docs/configuration.md
    for who in ("vLLM", "start"):
        sys.stdout.write(f"<!-- settings read by {who} -->\n{markdown(who)}\n")
