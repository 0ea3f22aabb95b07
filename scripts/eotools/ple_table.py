# SPDX-License-Identifier: Apache-2.0
"""The bytes of Qwen4Exp's PLE n-gram tables, from a model's config.json alone.

Each PLE layer (``ple_layer_ids``, 1-based) owns one table. Its rows follow vLLM 0.29.0's
``Qwen4ExpNGramEmbedding._make_vocab_layout`` (models/qwen4_exp/nvidia/ple_layer.py): one
vocabulary per n-gram head, (ngram_size - 1) x heads_per_ngram heads per layer, numbered
across layers; head g's vocabulary is the (g + 1)-th prime above ngram_vocab_size_base - 1;
the layer's rows are the sum of its heads' vocabularies, padded to a multiple of
make_ngram_vocab_size_divisible_by. The width is ple_embed_dim (default hidden_size) over
the number of heads; the element is 1 byte for an FP8 checkpoint (quant_method fp8), else
the model dtype's. At the defaults (ngram_size 3, heads_per_ngram 8, base 20,000,000,
hidden 2560): 320,001,536 rows x 160 x 2 bytes = 95.37 GiB per PLE layer.

Where the table lives is VLLM_PLE_TABLE's: ``gpu`` (upstream), ``host`` (page-locked),
``file`` (read through the page cache from the checkpoint's safetensors files; nothing
locked) or ``auto`` (``host`` when the host has room, else ``file``: ``choose_placement``,
the rule the series' vLLM applies at start-up, qwen4_exp/common/ple_file.py).
"""

from __future__ import annotations

import mmap
import pathlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .selection import safetensors_header_at

GiB = 1 << 30
PAGE = 4096
AUTO_MARGIN = 0.1  # auto pins only with 10% to spare

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


@dataclass(frozen=True)
class PLETable:
    layer_id: int  # 1-based, as in ple_layer_ids
    rows: int
    width: int
    element_bytes: int
    heads: int = 16  # n-gram heads: rows a token reads

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.element_bytes


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in (2, 325, 9375, 28178, 450775, 9780504, 1795265022):
        if a % n == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes strictly greater than `start`."""
    out: list[int] = []
    n = start
    while len(out) < count:
        n += 1
        if _is_prime(n):
            out.append(n)
    return out


def _element_bytes(cfg: dict[str, Any], text: dict[str, Any]) -> int:
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return 1
    dtype = text.get("torch_dtype") or cfg.get("torch_dtype") or text.get("dtype")
    dtype = dtype or cfg.get("dtype") or "bfloat16"
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)


def ple_tables(cfg: dict[str, Any]) -> list[PLETable]:
    """One entry per PLE layer of a Qwen4Exp config.json (empty for other models)."""
    text = cfg.get("text_config", cfg)
    layer_ids = sorted({int(i) for i in text.get("ple_layer_ids") or []})
    if not layer_ids:
        return []
    ngram_size = int(text.get("ngram_size", 3))
    heads = (ngram_size - 1) * int(text.get("heads_per_ngram", 8))
    base = int(text.get("ngram_vocab_size_base", 20_000_000))
    divisor = int(text.get("make_ngram_vocab_size_divisible_by", 128))
    embed_dim = int(text.get("ple_embed_dim") or text["hidden_size"])
    if heads <= 0 or embed_dim % heads:
        raise ValueError(
            f"ple_embed_dim {embed_dim} is not divisible by the {heads} n-gram heads "
            "(ngram_size - 1) x heads_per_ngram; vLLM refuses this config"
        )
    element = _element_bytes(cfg, text)
    primes = _primes_after(base - 1, heads * len(layer_ids))
    out = []
    for dense, layer_id in enumerate(layer_ids):
        total = sum(primes[dense * heads : (dense + 1) * heads])
        rows = (total + divisor - 1) // divisor * divisor
        out.append(PLETable(layer_id, rows, embed_dim // heads, element, heads))
    return out


def page_cache_wanted(tables: Sequence[PLETable], max_model_len: int) -> int:
    """Page cache VLLM_PLE_TABLE=file wants to run at the speed of a pinned table: the
    pages of one max-length prompt's rows (read ahead of its prefill at its arrival; a
    token's rows are random, one 4 KiB page each), per PLE layer, at most the table. It
    is not locked: the kernel may take it back, which costs reads, not a failed start."""
    return sum(min(t.nbytes, max_model_len * t.heads * PAGE) for t in tables)


def choose_placement(
    room: int, table_bytes: int, host_expert_bytes: int, reserve_bytes: int
) -> tuple[str, int]:
    """VLLM_PLE_TABLE=auto: ("host", need) when `room` (the smaller of MemAvailable and
    the container's room) covers the tables, the host experts and the reserve with
    AUTO_MARGIN to spare, else ("file", need)."""
    need = int((table_bytes + host_expert_bytes + reserve_bytes) * (1 + AUTO_MARGIN))
    return ("host" if need <= room else "file"), need


# --- the table's bytes in the checkpoint (VLLM_PLE_TABLE=file) ---------------------------

_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1}
_TABLE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\..*\.ngram_embedding\.(?:shard_(\d+)\.)?weight$")
_FIX = (
    "re-download or re-convert the checkpoint (its safetensors files must hold the whole "
    "n-gram table), or set VLLM_PLE_TABLE=host"
)
_MAP_FIX = "copy the checkpoint to a local drive, or set VLLM_PLE_TABLE=host"


def table_file_problems(
    model_dir: pathlib.Path, cfg: dict[str, Any], files: Sequence[pathlib.Path] | None = None
) -> list[tuple[str, str]]:
    """What keeps VLLM_PLE_TABLE=file from reading each PLE layer's table from the
    checkpoint's safetensors files (headers and file sizes only; each file is mapped, not
    read): a table missing, of another dtype or shape, rows not covered, a file cut short or
    that cannot be mapped, each as (problem naming the file, fix). Empty: vLLM can serve
    the tables from the files."""
    tables = ple_tables(cfg)
    if not tables:
        return []
    text = cfg.get("text_config", cfg)
    parts = int(text.get("split_ngram_parts", 512))
    paths = list(files) if files is not None else sorted(model_dir.glob("*.safetensors"))
    if not paths:
        return [(f"{model_dir}: no .safetensors file to read the n-gram tables from", _FIX)]
    problems: list[tuple[str, str]] = []
    found: dict[int, list[tuple[pathlib.Path, str, dict[str, Any], int]]] = {}
    for path in paths:
        try:
            base, header = safetensors_header_at(path)
        except (OSError, ValueError) as e:
            problems.append((str(e) if isinstance(e, ValueError) else f"{path}: {e}", _FIX))
            continue
        for name, info in header.items():
            m = _TABLE_RE.search(name)
            if m and not name.startswith("mtp."):
                found.setdefault(int(m.group(1)) + 1, []).append((path, name, info, base))
    for t in tables:
        entries = found.get(t.layer_id, [])
        if not entries:
            problems.append(
                (
                    f"{model_dir}: no n-gram table of PLE layer {t.layer_id} (no tensor "
                    f"layers.{t.layer_id - 1}.*.ngram_embedding.weight or .shard_K.weight)",
                    _FIX,
                )
            )
            continue
        shard = (t.rows + parts - 1) // parts
        covered, before = 0, len(problems)
        for path, name, info, base in entries:
            m = _TABLE_RE.search(name)
            rows = t.rows if m.group(2) is None else min(shard, t.rows - int(m.group(2)) * shard)
            problem = _tensor_problem(path, name, info, base, rows, t)
            if problem:
                problems.append(problem)
            else:
                covered += rows
        if covered < t.rows and len(problems) == before:
            problems.append(
                (
                    f"{model_dir}: the n-gram table of PLE layer {t.layer_id} has {covered} "
                    f"of {t.rows} rows (a shard file is missing?)",
                    _FIX,
                )
            )
    return problems


def _tensor_problem(
    path: pathlib.Path, name: str, info: dict[str, Any], base: int, rows: int, t: PLETable
) -> tuple[str, str] | None:
    """What is wrong with one tensor of a table, or None."""
    if _ST_BYTES.get(info.get("dtype")) != t.element_bytes:
        return (
            f"{path}: {name} is {info.get('dtype')}, vLLM reads this table with "
            f"{t.element_bytes}-byte elements",
            _FIX,
        )
    if list(info.get("shape", [])) != [rows, t.width]:
        return (
            f"{path}: {name} has shape {info.get('shape')}, the config wants "
            f"[{rows}, {t.width}] (a checkpoint of another config?)",
            _FIX,
        )
    end = base + int(info["data_offsets"][1])
    size = path.stat().st_size
    if size < end:
        return f"{path}: the file is truncated ({size} bytes; {name} ends at byte {end})", _FIX
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
            pass
    except (OSError, ValueError) as e:
        return (
            f"{path}: cannot be memory-mapped ({e}); VLLM_PLE_TABLE=file reads the table "
            "through a mapping",
            _MAP_FIX,
        )
    return None
