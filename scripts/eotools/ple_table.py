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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


@dataclass(frozen=True)
class PLETable:
    layer_id: int  # 1-based, as in ple_layer_ids
    rows: int
    width: int
    element_bytes: int

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
        out.append(PLETable(layer_id, rows, embed_dim // heads, element))
    return out
