# SPDX-License-Identifier: Apache-2.0
"""Timing metrics exactly as docs/benchmarks.md defines them, from per-token arrival times.

t0 is when the request was sent, t_i the arrival time of the chunk that carried token i (a chunk
with several tokens gives all of them its arrival time), N the number of generated tokens:

    TTFT = t1 - t0;  TPOT = (tN - t1) / (N - 1);  decode speed = (N - 1) / (tN - t1)
    ITL  = t_{i+1} - t_i for every consecutive pair of tokens

Tokens are counted from token ids (or logprob entries), never from SSE events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy default)"


def token_times(chunks: Iterable[tuple[float, int]]) -> list[float]:
    """Per-token arrival times from (arrival time, tokens in the chunk) pairs."""
    out: list[float] = []
    for t, n in chunks:
        out.extend([t] * n)
    return out


def request_metrics(t0: float, times: Sequence[float]) -> dict:
    """TTFT/TPOT/decode speed (seconds-based inputs, ms and tok/s outputs) of one request.
    Values that need two tokens (or two distinct arrival times) are None when not defined."""
    n = len(times)
    out: dict = {"tokens": n, "ttft_ms": None, "tpot_ms": None, "decode_tok_s": None}
    out["itl_ms"] = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
    if n == 0:
        return out
    out["ttft_ms"] = (times[0] - t0) * 1e3
    if n >= 2:
        span = times[-1] - times[0]
        out["tpot_ms"] = span / (n - 1) * 1e3
        out["decode_tok_s"] = (n - 1) / span if span > 0 else None
    return out


def percentiles(values: Iterable[float | None], ps: Sequence[int] = PERCENTILES) -> dict:
    """{"p50": .., "p90": .., "p99": .., "n": sample count}; None values are left out."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    out: dict = {f"p{p}": (float(np.percentile(xs, p)) if xs.size else None) for p in ps}
    out["n"] = int(xs.size)
    return out


def decode_speed(requests: Sequence[dict]) -> float | None:
    """Decode speed of a group of requests: sum(N - 1) / sum(tN - t1), one denominator for all
    (the per-stream speed; with concurrent streams it is not the server's throughput)."""
    num = den = 0.0
    for r in requests:
        if r["tokens"] >= 2 and r["tpot_ms"] is not None:
            num += r["tokens"] - 1
            den += r["tpot_ms"] * (r["tokens"] - 1) / 1e3
    return num / den if den > 0 else None


def throughput(requests: Sequence[dict]) -> float | None:
    """Generated tokens of a group of requests over its wall time (first send to last token)."""
    started = [r["t0"] for r in requests]
    ended = [r["t_last"] for r in requests if r.get("t_last") is not None]
    tokens = sum(r["tokens"] for r in requests)
    if not ended or not tokens:
        return None
    span = max(ended) - min(started)
    return tokens / span if span > 0 else None
