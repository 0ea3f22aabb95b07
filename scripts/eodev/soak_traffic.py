# SPDX-License-Identifier: Apache-2.0
"""scripts/soak's client side: the prompts, one streamed request (with or without hanging up
early), the probe set, the traffic's worker threads and the sampler of VRAM, the server's
host RSS and /metrics. Only the standard library (the GPU host may lack aiohttp)."""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import pathlib
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from . import soak_report as rep
from .bench import prom
from .nvsmi import query

GiB = 1 << 30
PROBE_TOKENS = 32
MAX_GEN = (16, 256)
# the mix: (kind, share, shortest and longest prompt in tokens); very_long is capped
# at --long-tokens
KINDS = (
    ("short", 0.50, 64, 512),
    ("long", 0.20, 2048, 8192),
    ("very_long", 0.05, 16384, 32768),
    ("random", 0.25, 64, 2048),
)
CANCEL_SHARE, CANCEL_TOKENS = 0.15, (1, 20)
# the first concurrency targets: from one stream to the server's 16 and back, with abrupt
# jumps both ways; later phases draw from the seeded generator
OPENING = (1, 4, 16, 8, 2, 16, 12, 1)


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- host memory and VRAM ----------------------------------------------------------------


def process_tree(root: int, proc: pathlib.Path = pathlib.Path("/proc")) -> list[int]:
    """`root` and all its descendants, from every process's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # it exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(tree)


def tree_rss_bytes(root: int, proc: pathlib.Path = pathlib.Path("/proc")) -> int:
    """Host RSS of a process tree: the sum of VmRSS over `root` and its descendants (vLLM's
    API server, engine core and helpers), which is where pinned host experts live."""
    total = 0
    for pid in process_tree(root, proc):
        try:
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024  # kB
    return total


def vram_used_gib() -> float | None:
    """VRAM used on the GPU the server runs on (the first visible one), by nvidia-smi."""
    rows = query("--query-gpu=memory.used", timeout=20)
    if not rows:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = int(visible) if visible.isdigit() and int(visible) < len(rows) else 0
    return float(rows[index][0]) / 1024  # MiB


# -- prompts and requests ----------------------------------------------------------------


class Prompts(Protocol):
    def domain(self, length: int, rng: random.Random) -> list[int]: ...
    def random(self, length: int, rng: random.Random) -> list[int]: ...


class PlanPrompts:
    """Prompts of a make-test-model checkpoint, as token ids: held-out conversations of its
    planted domains (routing the cold file was chosen for) and uniformly random words
    (routing it was not)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.domains = list(plan.planting.domains)

    def domain(self, length: int, rng: random.Random) -> list[int]:
        return self.domain_of(rng.choice(self.domains), length, rng)

    def domain_of(self, domain: str, length: int, rng: random.Random) -> list[int]:
        from .testmodel.data import conversations

        seed = rng.randrange(1 << 30)
        return list(next(conversations(self.plan, domain, "heldout", 1, length, seed)).token_ids)

    def random(self, length: int, rng: random.Random) -> list[int]:
        lo, hi = self.plan.first_word_id, self.plan.geometry.vocab_size
        return [rng.randrange(lo, hi) for _ in range(length)]

    def probes(self, seed: int) -> list[tuple[str, list[int]]]:
        """The fixed probe set: five domains' prompts of 256 words and one of random words."""
        rng = random.Random(seed)
        out = [(d, self.domain_of(d, 256, rng)) for d in self.domains[:5]]
        return [*out, ("random", self.random(256, rng))]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request of the traffic: what kind of prompt, how long, how many tokens, and
    after how many received tokens the client hangs up (None: never)."""

    kind: str
    prompt_len: int
    max_tokens: int
    cancel_after: int | None


def pick(rng: random.Random, long_tokens: int) -> Spec:
    """A request drawn from the issue's mix."""
    x = rng.random()
    kind, _, lo, hi = KINDS[-1]
    for name, share, a, b in KINDS:
        if x < share:
            kind, lo, hi = name, a, b
            break
        x -= share
    hi = min(hi, long_tokens)
    lo = min(lo, hi // 2) if kind == "very_long" else min(lo, hi)
    max_tokens = rng.randint(*MAX_GEN)
    cancel = rng.randint(*CANCEL_TOKENS) if rng.random() < CANCEL_SHARE else None
    return Spec(kind, rng.randint(lo, hi), max_tokens, cancel)


def request_body(model: str, prompt: list[int], max_tokens: int, probe: bool) -> dict:
    """A streaming completion of token ids with the generated ids returned; probes greedy
    with their logprobs, traffic sampled (seeded per request by the caller's prompt)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
        "temperature": 0.0 if probe else 0.8,
    }
    if probe:
        body["logprobs"] = 1
    return body


@dataclasses.dataclass
class Outcome:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False


def _events(resp: http.client.HTTPResponse) -> Iterator[dict | None]:
    """Server-sent events' JSON payloads; None for `[DONE]`."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                yield None
                return
            yield json.loads(data)


def _take(out: Outcome, event: dict) -> str | None:
    """Add one event's tokens to `out`; an error message when the event is an error or has
    text without token ids (nothing to count)."""
    if "error" in event and not event.get("choices"):
        return f"stream error: {json.dumps(event['error'])[:300]}"
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        if ids is None and choice.get("text"):
            return "a chunk has text but no token_ids"
        out.token_ids.extend(ids or [])
        out.logprobs.extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return None


def stream(base_url: str, body: dict, cancel_after: int | None, timeout: float = 900) -> Outcome:
    """Send one streaming completion; with `cancel_after`, close the connection once that
    many tokens arrived (the server aborts the request). Any HTTP error, broken or
    unfinished stream is an error."""
    out = Outcome()
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "localhost", url.port or 80, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return out
        for event in _events(resp):
            if event is None:
                if out.finish_reason is None:
                    out.error = "the stream ended without a finish reason"
                return out
            out.error = _take(out, event)
            if out.error:
                return out
            if cancel_after is not None and len(out.token_ids) >= cancel_after:
                out.cancelled = True
                return out
        out.error = "the stream broke off before [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def record(spec: Spec, o: Outcome, t: float, s: float) -> dict:
    """One request as the report counts it (t: sent, s: seconds it took)."""
    return {
        "t": round(t, 3),
        "s": round(s, 3),
        "kind": spec.kind,
        "prompt_tokens": spec.prompt_len,
        "max_tokens": spec.max_tokens,
        "cancel_after": spec.cancel_after,
        "generated": len(o.token_ids),
        "cancelled": o.cancelled,
        "completed": o.error is None and not o.cancelled,
        "error": o.error,
    }


def run_probes(
    base_url: str,
    model: str,
    probes: list[tuple[str, list[int]]],
    clock: Callable[[], float],
    salt: str,
) -> tuple[list[dict], list[dict]]:
    """The probe set, one request at a time: answers (ids, logprobs) and request records.
    Each round has its own cache salt, so that the end's prefill is computed as the start's
    was, not taken from the prefix cache."""
    answers, records = [], []
    for name, ids in probes:
        t = clock()
        body = request_body(model, ids, PROBE_TOKENS, probe=True)
        o = stream(base_url, {**body, "cache_salt": f"soak-probe-{salt}"}, None)
        answers.append({"name": name, "token_ids": o.token_ids, "logprobs": o.logprobs})
        answers[-1]["error"] = o.error
        records.append(record(Spec("probe", len(ids), PROBE_TOKENS, None), o, t, clock() - t))
    return answers, records


# -- traffic -----------------------------------------------------------------------------


def concurrency_schedule(seed: int, max_c: int, phases: int) -> list[int]:
    """Targets for consecutive phases: the opening sequence (capped at max_c), then seeded
    draws over 1..max_c."""
    rng = random.Random(seed * 31 + 7)
    out = [min(c, max_c) for c in OPENING]
    while len(out) < phases:
        out.append(rng.randint(1, max_c))
    return out[:phases]


class Traffic:
    """Worker threads, of which the first `target` keep one request each in flight, the
    target changing every phase; each request's record is kept."""

    def __init__(
        self, base_url: str, model: str, prompts: Prompts, args: argparse.Namespace
    ) -> None:
        self.base_url, self.model, self.prompts = base_url, model, prompts
        self.max_c, self.seed, self.long_tokens = args.max_concurrency, args.seed, args.long_tokens
        self.records: list[dict] = []
        self.target = self.inflight = self.peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def run(
        self,
        duration_s: float,
        phase_s: float,
        clock: Callable[[], float],
        progress_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> float:
        """Traffic for `duration_s` (less if the server dies: `alive`), then wait for the
        requests in flight; its seconds."""
        targets = concurrency_schedule(self.seed, self.max_c, math.ceil(duration_s / phase_s) + 1)
        workers = [
            threading.Thread(target=self._worker, args=(i, clock), daemon=True)
            for i in range(self.max_c)
        ]
        t0 = time.monotonic()
        self.target = targets[0]
        for w in workers:
            w.start()
        next_line = progress_s
        while (el := time.monotonic() - t0) < duration_s:
            if not alive():
                log(f"the server died after {el:.0f} s of traffic")
                break
            self.target = targets[int(el // phase_s)]
            if el >= next_line:
                self.progress(el, duration_s)
                next_line += progress_s
            self._stop.wait(min(0.2, duration_s - el))
        self._stop.set()
        for w in workers:
            w.join()
        self.target = 0
        return time.monotonic() - t0

    def snapshot(self) -> list[dict]:
        """The records so far (workers append while others read)."""
        with self._lock:
            return list(self.records)

    def progress(self, elapsed: float, total: float) -> None:
        records = self.snapshot()
        done, errors = len(records), sum(r["error"] is not None for r in records)
        log(
            f"{elapsed:.0f}/{total:.0f} s: {done} requests done ({errors} errors), "
            f"concurrency target {self.target}, {self.inflight} in flight"
        )

    def _worker(self, i: int, clock: Callable[[], float]) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        while not self._stop.is_set():
            if i >= self.target:
                self._stop.wait(0.05)
                continue
            spec = pick(rng, self.long_tokens)
            with self._lock:
                self.inflight += 1
                self.peak = max(self.peak, self.inflight)
            t = clock()
            try:
                o = self._send(spec, rng)
            except Exception as e:  # a worker that died would silently lower the load
                o = Outcome(error=f"client: {type(e).__name__}: {e}")
            rec = record(spec, o, t, clock() - t)
            with self._lock:
                self.inflight -= 1
                self.records.append(rec)
            if o.error:
                self._stop.wait(1.0)  # a server that refuses everything is not hammered

    def _send(self, spec: Spec, rng: random.Random) -> Outcome:
        make = self.prompts.random if spec.kind == "random" else self.prompts.domain
        prompt = make(spec.prompt_len, rng)
        body = request_body(self.model, prompt, spec.max_tokens, probe=False)
        return stream(self.base_url, body, spec.cancel_after)


# -- sampling ----------------------------------------------------------------------------


class Sampler:
    """A thread that takes a sample every `interval_s` and hands each to `on_sample`."""

    def __init__(
        self, interval_s: float, take: Callable[[], dict], on_sample: Callable[[], None]
    ) -> None:
        self.interval_s, self.take, self.on_sample = interval_s, take, on_sample
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the last one, after everything

    def _sample(self) -> None:
        """One sample; a failure is logged and skipped, never the end of sampling."""
        try:
            self.samples.append(self.take())
            self.on_sample()
        except Exception as e:
            log(f"sample failed: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return


def scrape(base_url: str) -> prom.Snapshot | None:
    try:
        return prom.scrape(base_url)
    except (OSError, ValueError):
        return None


def sample_fn(
    clock: Callable[[], float], pid: int, base_url: str, traffic: Traffic, phase: list[str]
) -> Callable[[], dict]:
    """What one sample holds: time, VRAM, the server tree's RSS, the concurrency and the
    watched /metrics counters."""

    def take() -> dict:
        vram, rss = vram_used_gib(), tree_rss_bytes(pid)
        s = {"t": round(clock(), 2), "phase": phase[0], "vram_gib": vram}
        s.update(rss_gib=rss / GiB if rss else None, target=traffic.target)
        s.update(inflight=traffic.inflight, requests_done=len(traffic.records))
        return {**s, **rep.watched(scrape(base_url))}

    return take
