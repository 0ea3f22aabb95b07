# SPDX-License-Identifier: Apache-2.0
"""scripts/soak without a GPU: its traffic driver, probes, sampling and shutdown against a fake
`vllm serve` that streams token ids as vLLM 0.29 does and keeps Prometheus counters, and every
conclusion of its report (self-check lines, probe differences, growth, /metrics consistency,
usage counts) on planted data that must pass or fail.

    scripts/test tests/cpu/test_soak.py

This file is also the fake server's program: `python3 test_soak.py PORT` serves until SIGTERM,
then writes the usage counts where VLLM_EXPERT_COUNT_FILE says, as the patched vLLM does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.server
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "scripts"))

from eodev import soak, soak_traffic  # noqa: E402
from eodev import soak_report as rep  # noqa: E402
from eodev.bench import prom  # noqa: E402

PASSED_LINE = (
    "(EngineCore pid=4242) INFO 12-04 10:00:00 [swap_runtime.py:422] Expert offload: runtime "
    "swap self-check passed after {} swaps (24 layers, every row of every weight and scale "
    "tensor, and the routing map)."
)
FAILED_LINE = (
    "(EngineCore pid=4242) ERROR 12-04 10:00:00 [swap_runtime.py:414] Expert offload: runtime "
    "swap self-check FAILED after 77 swaps: rows whose data is not the expert row_to_expert "
    "names, or whose expert expert_to_row sends elsewhere (layer, first rows, count): [...]"
)


# -- the fake server ---------------------------------------------------------------------


class FakeState:
    """The fake server's counters (far from zero, as a server that ran before) and faults."""

    def __init__(self, fail_every: int = 0, token_delay: float = 0.0002) -> None:
        self.fail_every, self.token_delay = fail_every, token_delay
        self.lock = threading.Lock()
        self.posts = self.inflight = self.max_inflight = self.aborts = 0
        self.c = {"prompt": 5000.0, "gen": 7000.0, "reads": 900.0, "swaps": 40.0, "dec": 9.0}
        self.success = {"stop": 3.0, "length": 11.0, "abort": 2.0}
        self.backwards = False
        self.salts: list[str | None] = []

    def metrics(self) -> str:
        c, s = self.c, self.success
        lab = 'engine="0",model_name="fake"'
        lines = ["# TYPE vllm:request_success_total counter"]
        lines += [
            f'vllm:request_success_total{{{lab},finished_reason="{k}"}} {v}' for k, v in s.items()
        ]
        for name, key in (
            ("vllm:prompt_tokens_total", "prompt"),
            ("vllm:generation_tokens_total", "gen"),
            ("vllm:expert_offload_host_reads_total", "reads"),
            ("vllm:expert_offload_swaps_total", "swaps"),
            ("vllm:expert_offload_swap_decisions_total", "dec"),
        ):
            value = c[key] - (1000 if self.backwards and key == "gen" else 0)
            lines += [f"# TYPE {name} counter", f'{name}{{rank="dp0_pp0_tp0"}} {value}']
        lines += [
            "# TYPE vllm:expert_offload_host_bytes gauge",
            "vllm:expert_offload_host_bytes 1e9",
        ]
        return "\n".join(lines) + "\n"


def tokens_for(prompt: list[int], n: int) -> list[int]:
    """Deterministic 'greedy' tokens: the same prompt always gets the same answer."""
    return [(sum(prompt) * 7 + i * 13) % 4000 + 40 for i in range(n)]


def handler(state: FakeState) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # streams in chunked transfer encoding, as uvicorn's

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "fake"}]}))
            elif self.path == "/metrics":
                self._send(200, state.metrics(), "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.posts += 1
                state.salts.append(body.get("cache_salt"))
                fail = state.fail_every and state.posts % state.fail_every == 0
            if fail:
                self._send(500, json.dumps({"error": "planted failure"}))
                return
            with state.lock:
                state.inflight += 1
                state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                self._stream(body)
            finally:
                with state.lock:
                    state.inflight -= 1

        def _stream(self, body: dict) -> None:
            assert body["stream"] and body["return_token_ids"], body
            ids = tokens_for(body["prompt"], body["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with state.lock:
                state.c["prompt"] += len(body["prompt"])
                state.c.update(swaps=state.c["swaps"] + 2, dec=state.c["dec"] + 1)
                state.c["reads"] += 5
            try:
                for i, t in enumerate(ids):
                    choice = {"index": 0, "text": f" w{t}", "token_ids": [t]}
                    choice["finish_reason"] = "length" if i == len(ids) - 1 else None
                    if body.get("logprobs") is not None:
                        choice["logprobs"] = {"token_logprobs": [-0.1 - t / 1e4], "tokens": ["x"]}
                    self._event({"choices": [choice]})
                    with state.lock:
                        state.c["gen"] += 1
                    time.sleep(state.token_delay)
                self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"])}})
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
                with state.lock:
                    state.success["length"] += 1
            except (BrokenPipeError, ConnectionResetError):
                with state.lock:
                    state.aborts += 1
                    state.success["abort"] += 1

        def _event(self, event: dict) -> None:
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())

        def _chunk(self, data: bytes) -> None:
            """One chunk of the chunked body (empty: the last)."""
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def log_message(self, *args):
            pass

    return Handler


class FakeServer:
    """The fake in a thread of this process."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(state))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_main(port: int) -> None:
    """The fake as `vllm serve`: start-up lines with the self-check, then serve; SIGTERM
    writes the usage counts (FAKE_SELF_CHECK_FAIL=1 logs a failed self-check too)."""
    state = FakeState()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler(state))
    httpd.daemon_threads = True
    counts_file = pathlib.Path(os.environ["VLLM_EXPERT_COUNT_FILE"])
    counts_file.with_name("fake-server.pid").write_text(str(os.getpid()))  # for cleanup
    print(PASSED_LINE.format(0), flush=True)
    if os.environ.get("FAKE_SELF_CHECK_FAIL") == "1":
        print(FAILED_LINE, flush=True)

    def stop(*_):
        counts = {
            "format": "vllm-expert-offload/expert-counts",
            "version": 1,
            "model": {"name": "fake", "num_layers": 2, "num_experts": 4},
            "data": {"name": "served", "kind": "served", "tokens": {"prefill": 9, "decode": 5}},
            "top_k": 2,
            "prefill": [[3, 0, 5, 10], [1, 1, 1, 15]],
            "decode": [[2, 2, 2, 4], [0, 0, 5, 5]],
        }
        counts_file.write_text(json.dumps(counts))
        print(PASSED_LINE.format(int(state.c["swaps"])), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    httpd.serve_forever()


class FakePrompts:
    """Prompts of exactly the asked length, as the traffic needs them."""

    def domain(self, length: int, rng: random.Random) -> list[int]:
        return [rng.randrange(40, 1000) for _ in range(length)]

    def random(self, length: int, rng: random.Random) -> list[int]:
        return [rng.randrange(1000, 4000) for _ in range(length)]

    def probes(self, seed: int) -> list[tuple[str, list[int]]]:
        return [("code", [40, 41, 42]), ("story", [50] * 8), ("random", [3000, 3999])]


# -- traffic -----------------------------------------------------------------------------


def run_traffic(state: FakeState, seconds: float = 1.5, max_c: int = 4) -> list[dict]:
    with FakeServer(state) as srv:
        args = argparse.Namespace(max_concurrency=max_c, seed=3, long_tokens=300)
        traffic = soak_traffic.Traffic(srv.url, "fake", FakePrompts(), args)
        t0 = time.monotonic()
        took = traffic.run(seconds, 0.3, lambda: time.monotonic() - t0, 0.5)
        assert seconds <= took < seconds + 5
        assert 2 <= traffic.peak <= max_c  # the schedule's targets, capped at max_c
        return traffic.snapshot()


def test_traffic_counts_completions_and_cancellations():
    state = FakeState()
    records = run_traffic(state)
    totals = rep.traffic_totals(records)
    assert totals["requests"] >= 30, totals
    assert totals["errors"] == 0, totals["first_errors"]
    assert totals["cancelled"] > 0 and totals["completed"] > 0
    assert totals["completed"] + totals["cancelled"] == totals["requests"]
    for r in records:
        if r["cancelled"]:
            assert r["generated"] == r["cancel_after"] < r["max_tokens"], r
        else:
            assert r["generated"] == r["max_tokens"], r
        assert 16 <= r["max_tokens"] <= 256
    assert set(totals["by_kind"]) >= {"short", "random"}
    # the server saw every hang-up as one (possibly after the request finished meanwhile)
    time.sleep(0.2)
    assert state.aborts + state.success["length"] - 11 == totals["requests"]
    assert state.max_inflight >= 2


def test_traffic_counts_server_errors_and_the_check_fails():
    records = run_traffic(FakeState(fail_every=4), seconds=1.0)
    totals = rep.traffic_totals(records)
    assert totals["errors"] >= totals["requests"] // 5 > 0
    assert all("HTTP 500" in e for e in totals["first_errors"])
    assert sum(k["errors"] for k in totals["by_kind"].values()) == totals["errors"]


def test_traffic_stops_when_the_server_dies():
    with FakeServer(FakeState()) as srv:
        args = argparse.Namespace(max_concurrency=2, seed=0, long_tokens=300)
        traffic = soak_traffic.Traffic(srv.url, "fake", FakePrompts(), args)
        t0 = time.monotonic()
        took = traffic.run(30.0, 0.3, time.monotonic, 10.0, lambda: time.monotonic() - t0 < 0.5)
    assert 0.5 <= took < 3 and traffic.snapshot()


def test_a_stream_that_breaks_off_is_an_error():
    class Broken(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()
            choice = {"index": 0, "text": " a", "token_ids": [7], "finish_reason": None}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        out = soak_traffic.stream(url, {"prompt": [1]}, None, timeout=10)
    finally:
        httpd.shutdown()
    assert out.token_ids == [7] and "broke off" in out.error


def test_request_mix_and_concurrency_schedule():
    rng = random.Random(1)
    specs = [soak_traffic.pick(rng, 32768) for _ in range(20000)]
    share = {k: sum(s.kind == k for s in specs) / len(specs) for k, *_ in soak_traffic.KINDS}
    assert share == pytest.approx(
        {"short": 0.5, "long": 0.2, "very_long": 0.05, "random": 0.25}, abs=0.015
    )
    assert sum(s.cancel_after is not None for s in specs) / len(specs) == pytest.approx(
        0.15, abs=0.01
    )
    for s in specs:
        lo, hi = {k: (a, b) for k, _, a, b in soak_traffic.KINDS}[s.kind]
        assert lo <= s.prompt_len <= hi and 16 <= s.max_tokens <= 256
        assert s.cancel_after is None or 1 <= s.cancel_after <= 20
    assert max(s.prompt_len for s in specs) > 30000
    small = [soak_traffic.pick(rng, 1000) for _ in range(2000)]
    assert max(s.prompt_len for s in small) <= 1000
    sched = soak_traffic.concurrency_schedule(0, 16, 40)
    assert sched[:8] == [1, 4, 16, 8, 2, 16, 12, 1] and set(sched) <= set(range(1, 17))
    assert (
        sched
        == soak_traffic.concurrency_schedule(0, 16, 40)
        != soak_traffic.concurrency_schedule(1, 16, 40)
    )
    assert max(soak_traffic.concurrency_schedule(0, 4, 40)) == 4


def test_plan_prompts_are_the_planted_domains_and_random_words():
    from eodev.testmodel.cli import PRESETS
    from eodev.testmodel.plant import Plan

    prompts = soak_traffic.PlanPrompts(Plan(PRESETS["tiny"]))
    rng = random.Random(0)
    ids = prompts.domain(300, rng)
    assert len(ids) == 300 and min(ids) >= prompts.plan.first_word_id
    noise = prompts.random(100, rng)
    assert len(noise) == 100 and max(noise) < 4096 and len(set(noise)) > 80
    probes = prompts.probes(0)
    assert [n for n, _ in probes][-1] == "random" and len(probes) == 6
    assert probes == prompts.probes(0)  # fixed: the same set at start and end


# -- probes ------------------------------------------------------------------------------


def test_probes_identical_on_a_deterministic_server():
    probes, state = FakePrompts().probes(0), FakeState()
    with FakeServer(state) as srv:
        a, recs = soak_traffic.run_probes(srv.url, "fake", probes, time.monotonic, "start")
        b, _ = soak_traffic.run_probes(srv.url, "fake", probes, time.monotonic, "end")
    # no prefix-cache hits between the two rounds: each has its own salt
    assert state.salts == ["soak-probe-start"] * 3 + ["soak-probe-end"] * 3
    assert [len(x["token_ids"]) for x in a] == [32, 32, 32]
    assert all(len(x["logprobs"]) == 32 for x in a)
    assert all(r["completed"] and r["kind"] == "probe" for r in recs)
    assert all(p["identical"] for p in rep.compare_probes(a, b))


def test_probe_difference_names_position_tokens_and_logprobs():
    a = [{"name": "code", "token_ids": [1, 2, 3, 4, 5, 6], "logprobs": [-0.1] * 6, "error": None}]
    b = [dict(a[0], token_ids=[1, 2, 3, 4, 5, 9], logprobs=[-0.1] * 5 + [-0.25])]
    (row,) = rep.compare_probes(a, b)
    assert not row["identical"] and row["first_diff"] == 5
    assert row["start"] == {"token": 6, "logprob": -0.1}
    assert row["end"] == {"token": 9, "logprob": -0.25}
    (short,) = rep.compare_probes(a, [dict(a[0], token_ids=[1, 2])])
    assert short["first_diff"] == 2 and short["end"]["token"] is None
    (err,) = rep.compare_probes(a, [dict(a[0], error="HTTP 500")])
    assert not err["identical"] and err["error"] == "HTTP 500"


# -- growth, self-check, metrics, counts -------------------------------------------------


def series(values: list[float], step: float = 10.0) -> list[dict]:
    return [{"t": i * step, "v": v} for i, v in enumerate(values)]


def test_growth_after_warmup():
    # warm-up (first 120 s) may grow; after it flat within noise
    flat = series([10, 20, 30] + [40.0, 40.1, 39.9] * 20)
    g = rep.growth(flat, "v", 0.0, 120.0, 10_000.0)
    assert g["at_warmup_end"] == 40.0 and g["pct"] == pytest.approx(0.25)
    assert (g["first"], g["min"], g["max"]) == (10, 10, 40.1)
    grows = series([10, 20, 30] + [40.0] * 10 + [40 + 0.8 * i / 50 for i in range(1, 51)])
    assert rep.growth(grows, "v", 0.0, 120.0, 10_000.0)["pct"] == pytest.approx(2.0)
    # samples outside the traffic window do not count
    late = [*flat, {"t": 99_999.0, "v": 80.0}]
    assert rep.growth(late, "v", 0.0, 120.0, 10_000.0)["pct"] == pytest.approx(0.25)
    few = rep.growth(series([1, 2, 3]), "v", 0.0, 25.0, 100.0)
    assert few["pct"] is None and "fewer" in few["reason"]


def test_self_check_lines_in_the_patch_format(repo_root):
    series = (repo_root / "patches").glob("*.patch")
    patch = "".join(p.read_text() for p in sorted(series))
    formats = re.findall(r'^\+.*"(Expert offload: runtime swap self-check [^"]*)"', patch, re.M)
    assert len(formats) == 2, formats
    passed = next(f for f in formats if "passed" in f)
    failed = next(f for f in formats if "FAILED" in f)
    assert passed.startswith(rep.SELF_CHECK_PASSED) and failed.startswith(rep.SELF_CHECK_FAILED)
    log = "\n".join(
        [
            "INFO starting",
            PASSED_LINE.format(10),
            f"(EngineCore pid=1) INFO [x.py:1] {passed % (20, 24)}",
            "WARNING something else about a self-check",
            FAILED_LINE,
            PASSED_LINE.format(30),
        ]
    )
    got = rep.count_self_checks(log)
    assert (got["passes"], got["failures"]) == (3, 1)
    assert got["failure_lines"] == [FAILED_LINE]
    assert rep.count_self_checks("INFO nothing\n") == {
        "passes": 0,
        "failures": 0,
        "failure_lines": [],
    }


def snapshots(state: FakeState, change) -> tuple[prom.Snapshot, prom.Snapshot]:
    first = prom.parse(state.metrics())
    change(state)
    return first, prom.parse(state.metrics())


CLIENT = {
    "requests": 12,
    "completed": 10,
    "cancelled": 2,
    "errors": 0,
    "prompt_tokens_sent": 1200,
    "prompt_tokens_answered": 1200,
    "generated": 500,
    "max_tokens": 600,
}


def served(state: FakeState) -> None:
    state.success["length"] += 10
    state.success["abort"] += 2
    state.c.update(prompt=state.c["prompt"] + 1200, gen=state.c["gen"] + 530)
    state.c.update(swaps=state.c["swaps"] + 8, dec=state.c["dec"] + 2, reads=state.c["reads"] + 3)


def checks_by_name(first, last, samples=()) -> dict[str, dict]:
    s = [{"t": 0, **rep.watched(first)}, *samples, {"t": 9, **rep.watched(last)}]
    return {c["name"]: c for c in rep.metrics_checks(first, last, s, CLIENT)}


def test_metrics_consistent_with_the_client():
    got = checks_by_name(*snapshots(FakeState(), served))
    assert all(c["passed"] for c in got.values()), got
    assert got["request_success"]["server_finished"] == 10
    assert got["generation_tokens"]["server"] == 530
    assert got["swaps_advanced"]["swaps"] == 8


def test_metrics_inconsistencies_fail():
    def fewer_tokens(state):
        served(state)
        state.c["gen"] -= 100  # the server generated less than the client received

    got = checks_by_name(*snapshots(FakeState(), fewer_tokens))
    assert not got["generation_tokens"]["passed"] and got["request_success"]["passed"]

    def no_swaps(state):
        served(state)
        state.c["swaps"] -= 8

    assert not checks_by_name(*snapshots(FakeState(), no_swaps))["swaps_advanced"]["passed"]


def test_a_counter_going_backwards_fails():
    state = FakeState()
    first = prom.parse(state.metrics())
    served(state)
    middle = prom.parse(state.metrics())
    state.backwards = True  # generation tokens 1000 lower than before
    served(state)
    last = prom.parse(state.metrics())
    got = checks_by_name(first, last, [{"t": 5, **rep.watched(middle)}])
    mono = got["counters_non_decreasing"]
    assert not mono["passed"] and list(mono["went_down"]) == ["vllm:generation_tokens_total"]
    assert mono["went_down"]["vllm:generation_tokens_total"]["t"] == 9


def test_usage_counts_file(tmp_path):
    counts = {
        "format": "vllm-expert-offload/expert-counts",
        "version": 1,
        "model": {"num_experts": 2},
        "data": {"tokens": {"prefill": 3, "decode": 1}},
        "top_k": 1,
        "prefill": [[1, 2]],
        "decode": [[0, 1]],
    }
    base = tmp_path / "counts.json"
    assert "no " in rep.check_counts_file(base)["error"]
    # one pipeline rank of several: vLLM writes counts.pp0.json (patches/0003)
    (tmp_path / "counts.pp0.json").write_text(json.dumps(counts))
    got = rep.check_counts_file(base)
    assert got["passed"] and (got["decode_picks"], got["prefill_picks"]) == (1, 3)
    base.write_text(json.dumps(dict(counts, decode=[[0, 0]])))
    assert not rep.check_counts_file(base)["passed"]  # the exact path wins; nothing decoded
    base.write_text("{not json")
    bad = rep.check_counts_file(base)
    assert not bad["passed"] and "not a readable counts file" in bad["error"]


def test_rss_of_a_process_tree_on_a_fake_proc(tmp_path):
    procs = {  # pid: (ppid, comm, VmRSS kB)
        100: (1, "python3", 1000),
        101: (100, "VLLM::EngineCore (x) y", 5000),
        102: (100, "python3", 200),
        103: (101, "pt_main_thread", 30),
        200: (1, "other", 999999),
        201: (200, "child of other", 77),
    }
    for pid, (ppid, comm, rss) in procs.items():
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
        (d / "status").write_text(f"Name:\t{comm}\nVmPeak:\t 99 kB\nVmRSS:\t {rss} kB\n")
    (tmp_path / "self").mkdir()  # not a pid
    assert soak_traffic.process_tree(100, tmp_path) == [100, 101, 102, 103]
    assert soak_traffic.tree_rss_bytes(100, tmp_path) == (1000 + 5000 + 200 + 30) * 1024
    (tmp_path / "103" / "status").unlink()  # exited between the two reads
    assert soak_traffic.tree_rss_bytes(100, tmp_path) == 6200 * 1024
    assert soak_traffic.tree_rss_bytes(os.getpid()) > 1 << 20  # the real /proc


# -- the whole tool ----------------------------------------------------------------------


def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    from eodev.testmodel.cli import PRESETS
    from eodev.testmodel.plant import Planting

    planted = {"geometry": PRESETS["tiny"], "planting": Planting()}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    desc = {k: dataclasses.asdict(v) for k, v in planted.items()}
    (model / "synthetic_model.json").write_text(json.dumps(desc))
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"layers": {str(i): [1, 2, 3] for i in range(4)}}))
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_soak(tmp_path, monkeypatch, *more: str) -> tuple[int, dict, str]:
    """soak.main against the fake server as a process of its own; VRAM and RSS made flat
    (the fake's own RSS is not what is measured here)."""
    port = free_port()
    monkeypatch.setattr(soak, "server_command", lambda a, e: [sys.executable, str(HERE), str(port)])
    monkeypatch.setattr(soak, "SETTLE_S", 0.2)
    monkeypatch.setattr(soak_traffic, "vram_used_gib", lambda: 20.0)
    monkeypatch.setattr(soak_traffic, "tree_rss_bytes", lambda pid: 8 << 30)
    monkeypatch.setattr(soak, "PlanPrompts", lambda plan: FakePrompts())
    model, out = model_dir(tmp_path), tmp_path / "out"
    args = ["--model", str(model), "--out", str(out), "--cold", str(tmp_path / "cold.json")]
    args += ["--duration-s", "2.5", "--warmup-s", "0.5", "--port", str(port), "--phase-s", "0.5"]
    args += [
        "--sample-s",
        "0.2",
        "--progress-s",
        "1",
        "--long-tokens",
        "400",
        "--max-concurrency",
        "4",
    ]
    rc = soak.main([*args, *more, "--", "--max-model-len", "4096"])
    return rc, json.loads((out / "soak.json").read_text()), (out / "soak.md").read_text()


def test_soak_end_to_end_passes(tmp_path, monkeypatch):
    rc, doc, md = run_soak(tmp_path, monkeypatch)
    assert rc == 0, (doc["checks"], doc["metrics_checks"])
    for key in [
        "suite",
        "date",
        "gpu",
        "command",
        "model",
        "settings",
        "duration_s",
        "warmup_s",
        "self_check_failures",
        "self_check_passes",
        "probes",
        "traffic",
        "samples",
        "growth",
        "metrics_checks",
        "shutdown",
        "checks",
        "passed",
    ]:
        assert key in doc, key
    assert doc["suite"] == "soak" and doc["complete"] and doc["passed"]
    assert doc["model"] == {
        "path": str(tmp_path / "model"),
        "layers": 4,
        "host_experts_per_layer": 3,
    }
    assert 2.5 <= doc["duration_s"] < 6
    assert (doc["self_check_passes"], doc["self_check_failures"]) == (2, 0)
    assert doc["settings"]["env"]["VLLM_EXPERT_SWAP_SELF_CHECK"] == "16"
    assert doc["settings"]["env"]["VLLM_EXPERT_ONE_TABLE"] == "1"
    assert doc["settings"]["args"]["vllm_args"] == ["--max-model-len", "4096"]
    t = doc["traffic"]
    assert set(t) >= {"requests", "completed", "cancelled", "errors", "prompt_tokens"}
    assert set(t) >= {"generated_tokens", "by_kind"} and t["requests"] > 10 and t["errors"] == 0
    assert len(doc["probes"]["compare"]) == 3 and all(
        p["identical"] for p in doc["probes"]["compare"]
    )
    assert len(doc["samples"]) >= 10
    assert {"t", "vram_gib", "rss_gib", "target", "inflight"} <= set(doc["samples"][0])
    assert {s["phase"] for s in doc["samples"]} >= {"traffic", "shutdown"}
    assert doc["growth"]["rss"]["pct"] == 0.0 and doc["growth"]["vram"]["last"] == 20.0
    assert doc["shutdown"]["exit_code"] == 0 and doc["shutdown"]["counts"]["decode_picks"] == 20
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == t["requests"] + 6
    assert "# Soak: PASSED" in md and "Failed checks" not in md
    assert "scripts/soak --model" in md


def test_soak_names_a_failed_self_check(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SELF_CHECK_FAIL", "1")
    rc, doc, md = run_soak(tmp_path, monkeypatch)
    assert rc == 1 and not doc["passed"]
    assert doc["self_check_failures"] == 1 and doc["checks"]["self_check_no_failures"] is False
    assert [k for k, v in doc["checks"].items() if not v] == ["self_check_no_failures"]
    assert "# Soak: FAILED" in md and "Failed checks: self_check_no_failures." in md
    assert "| self_check_no_failures | **FAIL** | 1 failures |" in md


DRIVER = """
import sys
sys.path[:0] = [{tests!r}, {scripts!r}]
import test_soak
from eodev import soak, soak_traffic
soak.server_command = lambda a, e: [sys.executable, {me!r}, {port!r}]
soak.PlanPrompts = lambda plan: test_soak.FakePrompts()
soak_traffic.vram_used_gib = lambda: 1.0
sys.exit(soak.main(sys.argv[1:]))
"""


def test_sigterm_stops_the_server_too(tmp_path):
    """Killed by `timeout` mid-traffic: the soak leaves through its cleanup, so the server
    (in a session of its own) does not outlive it, and soak.json says it is incomplete."""
    port = free_port()
    code = DRIVER.format(
        tests=str(HERE.parent),
        scripts=str(HERE.parents[2] / "scripts"),
        me=str(HERE),
        port=str(port),
    )
    model, out = model_dir(tmp_path), tmp_path / "out"
    args = ["--model", str(model), "--out", str(out), "--cold", str(tmp_path / "cold.json")]
    args += ["--duration-s", "60", "--warmup-s", "1", "--port", str(port), "--sample-s", "0.2"]
    args += ["--long-tokens", "400", "--max-concurrency", "2"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            doc = (
                json.loads((out / "soak.json").read_text()) if (out / "soak.json").exists() else {}
            )
            if any(s.get("phase") == "traffic" for s in doc.get("samples", [])):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1, proc.stderr.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        proc.kill()
        kill_fake(out)
    doc = json.loads((out / "soak.json").read_text())
    assert doc["complete"] is False and doc["samples"] and doc["traffic"]["requests"] > 0


def kill_fake(out: pathlib.Path) -> None:
    """A fake server a failed test left behind (it runs in a session of its own)."""
    pid_file = out / "fake-server.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_soak_exit_3_when_the_server_does_not_start(tmp_path, monkeypatch, capsys):
    model, out = model_dir(tmp_path), tmp_path / "out"
    cmd = [sys.executable, "-c", "print('Traceback: no GPU here'); raise SystemExit(1)"]
    monkeypatch.setattr(soak, "server_command", lambda a, e: cmd)
    args = ["--model", str(model), "--out", str(out), "--cold", str(tmp_path / "cold.json")]
    assert soak.main([*args, "--duration-s", "5", "--warmup-s", "1"]) == 3
    assert "no GPU here" in capsys.readouterr().err
    doc = json.loads((out / "soak.json").read_text())
    assert not doc["complete"] and "did not start" in doc["error"]


def test_markdown_names_every_failure():
    doc = {
        "date": "d",
        "gpu": "g",
        "model": {"path": "m", "layers": 24, "host_experts_per_layer": 123},
        "duration_s": 900.0,
        "warmup_s": 120.0,
        "command": ["scripts/soak"],
        "settings": {"args": {"duration_s": 900.0}},
        "self_check_passes": 0,
        "self_check_failures": 0,
        "probes": {"compare": [{"name": "code", "identical": True, "tokens": 32, "error": None}]},
        "traffic": rep.traffic_totals([]),
        "growth": {
            "vram": {"pct": 0.1, "first": 1.0},
            "rss": {"pct": 2.0, "first": 1.0, "at_warmup_end": 1.0, "tail_max": 1.02, "last": 1.0},
        },
        "metrics_checks": [{"name": "prompt_tokens", "passed": False, "server": 5}],
        "shutdown": {"exit_code": 0, "killed": False, "counts": {"passed": True}},
    }
    doc["checks"] = rep.checks(doc)
    failed = {k for k, v in doc["checks"].items() if not v}
    # no self-check pass means the check never ran; no requests is no traffic
    assert failed == {"self_check_ran", "rss_flat", "metrics_consistent", "no_request_errors"}
    md = rep.markdown(dict(doc, passed=False))
    for name in failed:
        assert f"| {name} | **FAIL** |" in md
    assert "| prompt_tokens | **FAIL** | server 5 |" in md and "2.000 %" in md


@pytest.mark.parametrize(
    "args,code,says",
    [
        (["--help"], 0, "Exit codes"),
        ([], 2, "required"),
        (["--model", "MODEL", "--out", "O"], 2, "one of the arguments"),
        (
            ["--model", "MODEL", "--out", "O", "--cold", "C", "--host-experts-per-layer", "5"],
            2,
            "not allowed",
        ),
        (
            ["--model", "/nonexistent", "--out", "O", "--host-experts-per-layer", "5"],
            2,
            "synthetic_model.json",
        ),
        (["--model", "MODEL", "--out", "O", "--cold", "C", "--warmup-s", "900"], 2, "--warmup-s"),
        (
            ["--model", "MODEL", "--out", "O", "--cold", "C", "--", "--max-model-len", "8192"],
            2,
            "33024",
        ),
    ],
)
def test_entry_script_usage(repo_root, tmp_path, args, code, says):
    model_dir(tmp_path)
    paths = {"MODEL": str(tmp_path / "model"), "C": str(tmp_path / "cold.json")}
    cmd = [sys.executable, str(repo_root / "scripts/soak"), *(paths.get(a, a) for a in args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == code, r.stderr
    assert says in r.stdout + r.stderr
    assert not (tmp_path / "O").exists()


if __name__ == "__main__":
    serve_main(int(sys.argv[1]))


def test_report_judges_a_run_that_stopped_early(tmp_path):
    """`soak --report OUT` after the host was taken away mid-traffic: what the samples and the
    server log hold is judged (self-checks, errors, growth up to the last sample), the checks
    the run never reached fail, and the document stays incomplete."""
    out = tmp_path / "out"
    out.mkdir()
    samples = [{"t": 0.0, "phase": "probes-start", "vram_gib": 20.0, "rss_gib": 3.0}]
    for i in range(1, 31):
        rss = 3.0 + (0.5 if i > 25 else 0.0)  # +16.7% near the end: fails the flatness check
        samples.append({"t": i * 10.0, "phase": "traffic", "vram_gib": 20.0, "rss_gib": rss})
    doc = {
        "suite": "soak",
        "complete": False,
        "date": "2026-12-04T20:27:18Z",
        "gpu": "NVIDIA H200",
        "command": ["scripts/soak", "--model", "m"],
        "model": {"path": "m", "layers": 24, "host_experts_per_layer": 134},
        "settings": {"args": {"duration_s": 600.0}},
        "warmup_s": 120.0,
        "duration_s": 0.0,
        "samples": samples,
        "window": {"traffic_start": 10.0, "warmup_end": 130.0},
        "traffic": rep.traffic_totals([]) | {"requests": 40, "completed": 36, "cancelled": 4},
    }
    (out / "soak.json").write_text(json.dumps(doc))
    (out / "server.log").write_text(PASSED_LINE.format(5) + "\n" + PASSED_LINE.format(9) + "\n")
    rc = soak.main(["--report", str(out)])
    judged = json.loads((out / "soak.json").read_text())
    assert rc == soak.EXIT_FAILED
    assert judged["interrupted"] and not judged["complete"] and not judged["passed"]
    assert judged["duration_s"] == 290.0  # from the first to the last traffic sample
    assert (judged["self_check_passes"], judged["self_check_failures"]) == (2, 0)
    c = judged["checks"]
    assert c["self_check_ran"] and c["self_check_no_failures"] and c["no_request_errors"]
    assert c["vram_flat"] and not c["rss_flat"]
    for unreached in ("probes_identical", "duration_reached", "clean_shutdown"):
        assert not c[unreached], unreached
    md = (out / "soak.md").read_text()
    assert md.startswith("# Soak: INTERRUPTED") and "rss_flat" in md
    # a finished run, or a folder without a soak.json, is a usage error
    judged["complete"] = True
    (out / "soak.json").write_text(json.dumps(judged))
    assert soak.main(["--report", str(out)]) == soak.EXIT_USAGE
    assert soak.main(["--report", str(tmp_path / "nothing")]) == soak.EXIT_USAGE
