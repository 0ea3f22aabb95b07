# SPDX-License-Identifier: Apache-2.0
"""Scrape a server's Prometheus /metrics and take differences of its counters.

A snapshot keeps counters (counter samples, and the cumulative _bucket/_count/_sum samples of
histograms and summaries) apart from gauges (everything else). A run reports counter
differences (after - before) and gauge values after the run, never counter totals.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# The series' offload counters (vLLM naming: `vllm:` prefix, counters end in _total). Host reads
# and swaps per token are these counters' differences over the tokens the client counted.
HOST_READS = "vllm:expert_offload_host_reads_total"
SWAPS = "vllm:expert_offload_swaps_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
HOST_BYTES = "vllm:expert_offload_host_bytes"
DEVICE_BYTES = "vllm:expert_offload_device_bytes"

_CUMULATIVE = {
    "counter": ("_total", ""),
    "histogram": ("_bucket", "_count", "_sum"),
    "gaugehistogram": (),
    "summary": ("_count", "_sum"),
}


@dataclass
class Snapshot:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def key_name(key: str) -> str:
    return key.split("{", 1)[0]


def parse(text: str) -> Snapshot:
    snap = Snapshot()
    for fam in text_string_to_metric_families(text):
        suffixes = _CUMULATIVE.get(fam.type)
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue  # creation timestamps are neither totals nor levels
            key = sample_key(s.name, s.labels)
            cumulative = suffixes is not None and any(s.name == fam.name + suf for suf in suffixes)
            (snap.counters if cumulative else snap.gauges)[key] = float(s.value)
    return snap


def scrape(base_url: str, timeout: float = 10.0) -> Snapshot:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode())


def diff(before: Snapshot, after: Snapshot, keep_zero: bool = False) -> dict:
    """{"counters": after - before for every counter (a counter new in `after` counts from 0;
    zero differences left out unless keep_zero), "gauges": the after-values}."""
    counters = {}
    for key, value in after.counters.items():
        d = value - before.counters.get(key, 0.0)
        if d or keep_zero:
            counters[key] = d
    return {"counters": counters, "gauges": dict(after.gauges)}


def total(counters: dict[str, float], name: str) -> float | None:
    """Sum of one counter over all its label sets (ranks, engines); None if never exposed."""
    vals = [v for k, v in counters.items() if key_name(k) == name]
    return sum(vals) if vals else None


def exposed(snap: Snapshot, name: str) -> bool:
    return any(key_name(k) == name for k in (*snap.counters, *snap.gauges))
