# SPDX-License-Identifier: Apache-2.0
"""scripts/bench and scripts/compare-logprobs against fake OpenAI-compatible servers.

The fake server streams chunks on a known schedule (multi-token chunks, an empty chunk, a final
usage chunk) and serves a Prometheus /metrics whose counters start far from zero and also move
during warm-up, so only correct per-token counting and before/after differences pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import sys
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from eodev.bench import cli, client, compare, prom, report
from eodev.bench import metrics as m
from eodev.testmodel.cli import PRESETS
from eodev.testmodel.plant import Planting

# (delay before the event in s, tokens in it): 8 tokens in 6 events, one of them empty
SCHEDULE = [(0.30, 1), (0.06, 1), (0.06, 3), (0.06, 0), (0.06, 1), (0.06, 2)]
READS_PER_TOKEN, SWAPS_PER_TOKEN = 2.0, 0.25


class FakeServer:
    """An aiohttp OpenAI-compatible server in its own thread and event loop."""

    def __init__(
        self,
        schedule=SCHEDULE,
        token_ids: bool = True,
        fail_from: int | None = None,
        lp_offset=lambda i: 0.0,
        gen_shift: int = 0,
        api_key: str = "",
    ):
        self.schedule, self.token_ids, self.fail_from = schedule, token_ids, fail_from
        self.api_key = api_key  # set: /v1/ answers 401 without it, as vLLM does
        self.lp_offset, self.gen_shift = lp_offset, gen_shift
        self.bodies: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.reads, self.swaps, self.gen = 1000.0, 500.0, 7000.0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()

        @web.middleware
        async def check_key(request, handler):
            guarded = self.api_key and request.path.startswith("/v1")
            if guarded and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[check_key])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, request):
        return web.Response(text="ok")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _metrics(self, request):
        text = (
            "# HELP vllm:expert_offload_host_reads_total Host expert reads.\n"
            "# TYPE vllm:expert_offload_host_reads_total counter\n"
            f'vllm:expert_offload_host_reads_total{{rank="0"}} {self.reads * 0.75}\n'
            f'vllm:expert_offload_host_reads_total{{rank="1"}} {self.reads * 0.25}\n'
            "# TYPE vllm:expert_offload_swaps_total counter\n"
            f"vllm:expert_offload_swaps_total {self.swaps}\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="fake-model"}} {self.gen}\n'
            "# TYPE vllm:generation_tokens_created gauge\n"
            'vllm:generation_tokens_created{model_name="fake-model"} 1.7e9\n'
            "# TYPE vllm:expert_offload_host_bytes gauge\n"
            "vllm:expert_offload_host_bytes 1000.0\n"
            "# TYPE vllm:expert_offload_device_bytes gauge\n"
            "vllm:expert_offload_device_bytes 9000.0\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running {self.inflight}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    @staticmethod
    def _prompt_ids(prompt) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return [sum(map(ord, w)) % 1000 for w in prompt.split()][:64] or [1]

    def _gen_ids(self, prompt_ids: list[int], n: int) -> list[int]:
        return [(prompt_ids[-1] + 1 + k + self.gen_shift * (k >= 2)) % 1000 for k in range(n)]

    def logprob(self, i: int, tok: int) -> float:
        return -0.5 - (i % 7) * 0.1 - (tok % 5) * 0.01 + self.lp_offset(i)

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.fail_from is not None and len(self.bodies) > self.fail_from:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        prompt_ids = self._prompt_ids(body["prompt"])
        if not body.get("stream"):
            return self._complete(body, prompt_ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        want, sent, k = body["max_tokens"], 0, 0
        gen = self._gen_ids(prompt_ids, want)
        while sent < want:
            delay, n = self.schedule[k % len(self.schedule)]
            delay = delay if k < len(self.schedule) else self.schedule[1][0]
            n = min(n, want - sent)
            await asyncio.sleep(delay)
            ids = gen[sent : sent + n]
            choice = {"index": 0, "text": "".join(f" w{t}" for t in ids), "finish_reason": None}
            if self.token_ids and body.get("return_token_ids"):
                choice["token_ids"] = ids
                if k == 0:
                    choice["prompt_token_ids"] = prompt_ids
            if body.get("logprobs") is not None:
                choice["logprobs"] = {
                    "tokens": [f" w{t}" for t in ids],
                    "token_logprobs": [-0.1] * n,
                    "top_logprobs": [None] * n,
                    "text_offset": [0] * n,
                }
            sent += n
            k += 1
            if sent == want:
                choice["finish_reason"] = "length"
            self.reads += READS_PER_TOKEN * n
            self.swaps += SWAPS_PER_TOKEN * n
            self.gen += n
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": want}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.inflight -= 1
        await resp.write_eof()
        return resp

    def _complete(self, body: dict, prompt_ids: list[int]):
        if body.get("echo"):
            plp = [None] + [
                {str(t): {"logprob": self.logprob(i, t), "rank": 1, "decoded_token": f"w{t}"}}
                for i, t in enumerate(prompt_ids)
                if i > 0
            ]
            choice = {"index": 0, "text": "", "prompt_logprobs": plp, "token_ids": [0]}
        else:
            gen = self._gen_ids(prompt_ids, body["max_tokens"])
            choice = {"index": 0, "text": "", "token_ids": gen, "prompt_token_ids": prompt_ids}
        return web.json_response({"choices": [choice], "usage": {}})


def _stream(url: str, count_via: str, max_tokens: int = 8) -> dict:
    async def go():
        async with aiohttp.ClientSession() as s:
            body = client.completion_body("fake-model", [5, 6, 7], max_tokens, 0, count_via)
            return await client.stream_completion(s, url, body, count_via)

    return asyncio.run(go())


def _expected():
    """Per-token arrival offsets (s) of SCHEDULE, and its event count."""
    t, times = 0.0, []
    for delay, n in SCHEDULE:
        t += delay
        times += [t] * n
    return times


# ---- pure functions -----------------------------------------------------------------------


def test_request_metrics_follow_spec_definitions():
    times = _expected()
    got = m.request_metrics(0.0, m.token_times([(t, 1) for t in times]))
    assert got["tokens"] == 8
    assert got["ttft_ms"] == pytest.approx(300.0)
    assert got["tpot_ms"] == pytest.approx(300.0 / 7)
    assert got["decode_tok_s"] == pytest.approx(7 / 0.3)
    assert len(got["itl_ms"]) == 7 and sum(x == 0 for x in got["itl_ms"]) == 3
    one = m.request_metrics(1.0, [1.5])
    assert one["ttft_ms"] == pytest.approx(500.0) and one["tpot_ms"] is None
    assert m.request_metrics(0.0, [1.0, 1.0])["decode_tok_s"] is None  # one chunk: undefined


def test_percentiles_report_sample_counts_and_skip_missing():
    p = m.percentiles([*range(1, 101), None])
    assert p == {"p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01), "n": 100}
    assert m.percentiles([]) == {"p50": None, "p90": None, "p99": None, "n": 0}


def test_decode_speed_uses_one_denominator():
    reqs = [
        {"tokens": 11, "tpot_ms": 10.0},  # 10 gaps in 0.1 s
        {"tokens": 31, "tpot_ms": 20.0},  # 30 gaps in 0.6 s
    ]
    assert m.decode_speed(reqs) == pytest.approx(40 / 0.7)  # not the mean of 100 and 50


def test_prometheus_counters_diff_gauges_after():
    before = prom.parse(
        '# TYPE a_total counter\na_total{x="1"} 10\na_total{x="2"} 5\n'
        "# TYPE a_created gauge\na_created 1.7e9\n"
        '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 3\nh_count 3\nh_sum 4\n'
        "# TYPE g gauge\ng 7\n"
    )
    after = prom.parse(
        '# TYPE a_total counter\na_total{x="1"} 13\na_total{x="2"} 5\n'
        '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 5\nh_count 5\nh_sum 9\n'
        "# TYPE g gauge\ng 1\n# TYPE new_total counter\nnew_total 4\n"
    )
    d = prom.diff(before, after)
    assert d["counters"] == {
        'a_total{x="1"}': 3.0,
        'h_bucket{le="+Inf"}': 2.0,
        "h_count": 2.0,
        "h_sum": 5.0,
        "new_total": 4.0,
    }
    assert d["gauges"] == {"g": 1.0}
    assert prom.total(prom.diff(before, after, keep_zero=True)["counters"], "a_total") == 3.0
    assert prom.total(d["counters"], "missing_total") is None


# ---- the streaming client -----------------------------------------------------------------


def _check_timing(rec: dict) -> None:
    times = m.token_times(rec["chunks"])
    got = m.request_metrics(rec["t0"], times)
    exp = _expected()
    assert got["tokens"] == 8 == rec["usage"]["completion_tokens"]
    assert rec["events"] == 7  # 6 token chunks (one empty) + the usage chunk
    # a scheduled sleep can only be late; allow 60 ms of scheduling jitter either way
    assert 300 - 5 <= got["ttft_ms"] <= 300 + 60
    # counted per SSE event instead, TPOT would be 0.3/4 = 75 ms or 0.3/5 = 60 ms
    assert got["tpot_ms"] == pytest.approx((exp[-1] - exp[0]) / 7 * 1e3, rel=0.2)
    assert got["decode_tok_s"] == pytest.approx(7 / 0.3, rel=0.2)
    assert sum(x < 1.0 for x in got["itl_ms"]) == 3  # the tokens sharing a chunk


def test_stream_counts_token_ids_not_events():
    with FakeServer() as srv:
        rec = _stream(srv.url, "token_ids")
    assert rec["error"] is None and rec["count_via"] == "token_ids"
    assert rec["token_ids"] == [(7 + 1 + k) % 1000 for k in range(8)]
    assert rec["prompt_tokens"] == 3
    assert srv.bodies[0]["return_token_ids"] is True and srv.bodies[0]["ignore_eos"] is True
    assert srv.bodies[0]["temperature"] == 0.0 and "logprobs" not in srv.bodies[0]
    _check_timing(rec)


def test_stream_falls_back_to_logprobs_without_token_ids():
    with FakeServer(token_ids=False) as srv:

        async def probe():
            async with aiohttp.ClientSession() as s:
                return await client.probe_count_mode(s, srv.url, "fake-model", [5, 6, 7])

        assert asyncio.run(probe()) == "logprobs"
        assert _stream(srv.url, "token_ids")["error"].startswith("a chunk has text but no")
        rec = _stream(srv.url, "logprobs")
    assert rec["error"] is None and rec["count_via"] == "logprobs"
    assert srv.bodies[-1]["logprobs"] == 0
    _check_timing(rec)


# ---- scripts/bench end to end -------------------------------------------------------------

FAST = [(0.02, 1), (0.005, 1), (0.005, 3), (0.005, 0), (0.005, 1), (0.005, 2)]
PROJECT_RUN_KEYS = {
    "config",
    "workload",
    "host_fraction",
    "decode_tok_s",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "ttft_ms",
    "host_reads_per_token",
    "swaps_per_token",
    "startup_s",
    "peak_vram_gib",
    "peak_host_gib",
}


def _prompt_file(tmp_path, n: int = 4):
    f = tmp_path / "prompts.jsonl"
    rows = [
        {"domain": d, "prompt": f"{d} prompt number {i} " * 3}
        for i in range(n)
        for d in ("code", "chat")
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _bench(url: str, tmp_path, *extra: str, name: str = "suite.json") -> tuple[int, dict]:
    out = tmp_path / name
    argv = ["--url", url, "--out", str(out), "--gpu", "test", "--max-tokens", "8"]
    rc = cli.main(argv + list(extra))
    return rc, (json.loads(out.read_text()) if out.exists() else {})


def test_bench_suite_json_markdown_plot_and_metric_diffs(tmp_path):
    prompts = _prompt_file(tmp_path, n=8)
    with FakeServer(schedule=FAST) as srv:
        rc, doc = _bench(
            srv.url,
            tmp_path,
            "--config", "offload-03-swap",
            "--prompts", str(prompts),
            "--workloads", "fresh,repeat",
            "--concurrency", "1,2",
            "--per-domain", "2",
            "--startup-s", "42",
        )  # fmt: skip
        max_inflight = srv.max_inflight
    assert rc == 0
    assert {"suite", "date", "gpu", "command", "model", "runs"} <= doc.keys()
    assert doc["gpu"] == "test" and doc["command"].startswith("scripts/bench --url")
    assert [(r["workload"], r["concurrency"]) for r in doc["runs"]] == [
        ("fresh", 1),
        ("fresh", 2),
        ("repeat", 1),
        ("repeat", 2),
    ]
    assert max_inflight == 2
    for r in doc["runs"]:
        assert r.keys() >= PROJECT_RUN_KEYS
        assert r["config"] == "offload-03-swap" and r["startup_s"] == 42
        assert len(r["decode_tok_s"]) == 3 and all(x > 0 for x in r["decode_tok_s"])
        assert r["token_count_source"] == "token_ids"
        # counters started at 1000/500 and moved in the warm-up too: only differences pass
        assert r["host_reads_per_token"] == pytest.approx(READS_PER_TOKEN)
        assert r["swaps_per_token"] == pytest.approx(SWAPS_PER_TOKEN)
        assert r["server_generation_tokens"] == r["generated_tokens"] == 3 * 4 * 8
        assert r["host_fraction"] == pytest.approx(0.1)
        assert r["tpot_samples"] == 12 and r["itl_samples"] == 12 * 7 and r["ttft_samples"] == 12
        assert r["tpot_ms_p50"] <= r["tpot_ms_p90"] <= r["tpot_ms_p99"]
        assert r["decode_vs_unpatched"] is None
        assert len(r["metrics"]) == 3
        for d in r["metrics"]:
            assert prom.total(d["counters"], prom.HOST_READS) == pytest.approx(2.0 * 4 * 8)
            assert d["gauges"]["vllm:expert_offload_host_bytes"] == 1000.0
            assert not any("_created" in k for k in d["counters"])
        raw = r["requests"]
        assert len(raw) == 4 * 4 and sum(x["warmup"] for x in raw) == 4
        assert all(x["tokens"] == 8 == x["usage_completion_tokens"] for x in raw)
        assert all(sum(n for _, n in x["chunks"]) == 8 for x in raw)
        ids = [x["prompt_id"] for x in raw]
        if r["workload"] == "fresh":
            assert len(set(ids)) == len(ids)  # every fresh prompt sent once in the run
        else:
            assert sorted(set(ids)) == ["chat-0", "code-0"]
    assert {x["stream"] for x in doc["runs"][1]["requests"]} == {0, 1}
    md = (tmp_path / "suite.md").read_text()
    assert md.count("| offload-03-swap |") == 4 and "TPOT p50 / p90 / p99 ms (n)" in md
    assert (tmp_path / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sends_the_api_key_from_vllm_api_key(tmp_path, monkeypatch, capsys):
    """A server started with an API key answers bench's requests only with the key, which
    bench takes from VLLM_API_KEY, as the server and the compose files do."""
    prompts = _prompt_file(tmp_path, n=2)
    args = ("--config", "offload-02", "--prompts", str(prompts), "--workloads", "fresh")
    args += ("--concurrency", "1")
    args += ("--per-domain", "1")
    with FakeServer(schedule=FAST, api_key="k-42") as srv:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        rc, _ = _bench(srv.url, tmp_path, *args, name="nokey.json")
        assert rc != 0 and "HTTP Error 401" in capsys.readouterr().err
        monkeypatch.setenv("VLLM_API_KEY", "k-42")
        rc, doc = _bench(srv.url, tmp_path, *args)
    assert rc == 0 and doc["runs"] and all(r["generated_tokens"] > 0 for r in doc["runs"])


def test_bench_long_workload_from_synthetic_model(tmp_path):
    model = tmp_path / "synth"
    model.mkdir()
    desc = {
        "geometry": dataclasses.asdict(PRESETS["tiny"]),
        "planting": dataclasses.asdict(Planting()),
    }
    (model / "synthetic_model.json").write_text(json.dumps(desc))
    with FakeServer(schedule=FAST) as srv:
        rc, doc = _bench(
            srv.url,
            tmp_path,
            "--config", "unpatched",
            "--synthetic-model", str(model),
            "--workloads", "long,fresh",
            "--concurrency", "2",
            "--per-domain", "1",
            "--prompt-tokens", "32",
            "--long-tokens", "1000",
            "--long-max-tokens", "4",
            "--no-metrics",
        )  # fmt: skip
        bodies = srv.bodies
    assert rc == 0
    long = [b for b in bodies if len(b["prompt"]) == 1000]
    assert len(long) == 2 * 4  # two streams, warm-up + 3 repeats
    assert len({tuple(b["prompt"]) for b in long}) == len(long)  # a new long prompt each time
    assert len({b["cache_salt"] for b in long}) == len(long)
    fresh = [b for b in bodies if len(b["prompt"]) == 32 and b["max_tokens"] == 8]
    assert len(bodies) == len(long) + len(fresh) + 1  # and the one probe (count mode)
    assert len(fresh) == 6 * 4 and len({tuple(b["prompt"]) for b in fresh}) == 24
    run = doc["runs"][0]
    assert run["workload"] == "long" and run["prompt_tokens"] == 1000 and run["max_tokens"] == 4
    assert run["host_reads_per_token"] is None and run["host_fraction"] == 0.0
    assert run["decode_vs_unpatched"] == 1.0


def test_bench_text_long_prompt_is_truncated_by_the_server(tmp_path):
    with FakeServer(schedule=FAST) as srv:
        rc, _ = _bench(
            srv.url,
            tmp_path,
            "--config", "offload-02",
            "--prompts", str(_prompt_file(tmp_path)),
            "--workloads", "long",
            "--concurrency", "1",
            "--long-tokens", "50",
            "--long-max-tokens", "3",
        )  # fmt: skip
    long = [b for b in srv.bodies if b.get("truncate_prompt_tokens")]
    assert rc == 0 and len(long) == 4
    assert all(b["truncate_prompt_tokens"] == 50 and len(b["prompt"].split()) >= 50 for b in long)


def test_bench_exit_1_when_requests_fail(tmp_path):
    prompts = _prompt_file(tmp_path)
    with FakeServer(schedule=FAST, fail_from=0) as srv:  # every request answers 500
        rc, doc = _bench(srv.url, tmp_path, "--config", "unpatched", "--prompts", str(prompts))
    assert rc == 1 and doc == {}
    with FakeServer(schedule=FAST, fail_from=5) as srv:  # fails mid-run: results still written
        rc, doc = _bench(
            srv.url,
            tmp_path,
            "--config", "unpatched",
            "--prompts", str(prompts),
            "--workloads", "fresh",
            "--concurrency", "1",
            "--count-via", "token_ids",
        )  # fmt: skip
    assert rc == 1
    assert doc["runs"][0]["errors"] > 0
    failed = [r for r in doc["runs"][0]["requests"] if r["error"]]
    assert failed and all(r["error"].startswith("HTTP 500") for r in failed)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--out", "x.json", "--config", "unpatched", "--prompts", "p.txt"],  # no --url
        ["--out", "x.json", "--url", "http://h", "--config", "nope", "--prompts", "p.txt"],
        ["--out", "x.json", "--url", "http://h", "--config", "unpatched"],  # no prompts
        ["--out", "x.json", "--url", "http://h", "--config", "unpatched", "--prompts", "p",
         "--repeats", "2"],
        ["--out", "x.json", "--merge", "does-not-exist.json"],
    ],
)  # fmt: skip
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


def _suite_doc(config: str, decode: list[float], tpot: float, ttft: float) -> dict:
    run = {k: None for k in PROJECT_RUN_KEYS}
    run.update(
        config=config,
        workload="fresh",
        concurrency=1,
        host_fraction=0.1,
        decode_tok_s=decode,
        tpot_ms_p50=tpot,
        tpot_ms_p90=tpot,
        ttft_ms=ttft,
    )
    return {"suite": "s", "date": "d", "gpu": "H200", "command": "c", "model": {}, "runs": [run]}


def test_merge_computes_ratios_against_unpatched(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_suite_doc("offload-03-swap", [95.0, 96.0, 97.0], 10.5, 30.0)))
    b.write_text(json.dumps(_suite_doc("unpatched", [100.0, 100.0, 100.0], 10.0, 20.0)))
    out = tmp_path / "merged.json"
    assert cli.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [s["configs"] for s in doc["sources"]] == [["offload-03-swap"], ["unpatched"]]
    swap, base = doc["runs"]
    assert swap["decode_vs_unpatched"] == pytest.approx(0.96)
    assert swap["decode_vs_unpatched_range"] == pytest.approx([0.95, 0.97])
    assert swap["tpot_p50_vs_unpatched"] == pytest.approx(1.05)
    assert swap["ttft_vs_unpatched"] == pytest.approx(1.5)
    assert base["decode_vs_unpatched"] == 1.0
    assert "0.960x (0.950-0.970)" in (tmp_path / "merged.md").read_text()
    assert (tmp_path / "merged.png").stat().st_size > 1000


# ---- scripts/compare-logprobs -------------------------------------------------------------


def test_compare_logprobs_against_baseline(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    rows = [{"domain": "d", "prompt": list(range(1 + k, 11 + k))} for k in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    off_b = lambda i: 0.01 * (i % 3)  # noqa: E731
    off_a2 = lambda i: 0.001 * (i % 2 == 0)  # noqa: E731
    with (
        FakeServer() as a,
        FakeServer(lp_offset=off_b, gen_shift=1) as b,
        FakeServer(lp_offset=off_a2) as a2,
    ):
        out = tmp_path / "lp.json"
        argv = ["--a", a.url, "--b", b.url, "--a2", a2.url, "--prompts", str(prompts)]
        rc = compare.main(argv + ["--per-domain", "3", "--max-tokens", "6", "--out", str(out)])
        score_bodies = [x for x in b.bodies if x.get("echo")]
    assert rc == 0
    doc = json.loads(out.read_text())
    # 10 prompt + 6 generated tokens, scored at positions 1..15 (position 0 has no logprob)
    pos = np.arange(1, 16)
    exp_b = np.array([off_b(i) for i in pos])
    exp_a2 = np.array([off_a2(i) for i in pos])
    assert doc["a_vs_b"]["tokens"] == 3 * 15
    assert doc["a_vs_b"]["mean"] == pytest.approx(exp_b.mean())
    assert doc["a_vs_b"]["max"] == pytest.approx(0.02)
    assert doc["a_vs_b"]["generated"]["mean"] == pytest.approx(exp_b[9:].mean())
    assert doc["a_vs_a2"]["mean"] == pytest.approx(exp_a2.mean())
    assert doc["mean_ratio_vs_baseline"] == pytest.approx(exp_b.mean() / exp_a2.mean())
    assert doc["logprob_source"] == ["prompt_logprobs"]
    # B generates differently from its third token on
    assert doc["greedy_identical"] == 0
    assert {r["first_divergence"] for r in doc["per_prompt"]} == {2}
    # B scored A's exact text: prompt ids + A's greedy ids, max_tokens 1
    assert score_bodies[0]["prompt"] == list(range(1, 11)) + [11, 12, 13, 14, 15, 16]
    assert score_bodies[0]["max_tokens"] == 1 and score_bodies[0]["prompt_logprobs"] == 0
    text = capsys.readouterr().out
    assert (
        "A vs B : mean" in text and "[baseline]" in text and "greedy tokens identical on 0" in text
    )


def test_compare_logprobs_same_server_baseline_and_failure(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("alpha beta gamma\n")
    with FakeServer() as a, FakeServer(lp_offset=lambda i: 0.5) as b:
        rc = compare.main(["--a", a.url, "--b", b.url, "--prompts", str(prompts)])
        assert rc == 0
        assert "A vs B mean / baseline mean: - (baseline is exactly 0)" in capsys.readouterr().out
    with FakeServer() as a, FakeServer(fail_from=0) as b:
        assert compare.main(["--a", a.url, "--b", b.url, "--prompts", str(prompts)]) == 1
    assert "HTTP 500" in capsys.readouterr().err


def test_add_ratios_leaves_other_workloads_alone():
    doc = {"runs": [_suite_doc("unpatched", [10.0], 1.0, 1.0)["runs"][0]]}
    other = dict(_suite_doc("offload-02", [5.0], 2.0, 2.0)["runs"][0], workload="long")
    doc["runs"].append(other)
    report.add_ratios(doc)
    assert doc["runs"][1]["decode_vs_unpatched"] is None
    assert not math.isnan(doc["runs"][0]["decode_vs_unpatched"])


def test_result_json_keeps_number_lists_on_one_line():
    doc = {"ids": [1, 2, 3], "chunks": [[0.5, 1], [1.5, 3]], "s": "a [1,  2]", "n": [None, 1.5]}
    text = report.dumps(doc)
    assert json.loads(text) == doc
    assert '"ids": [1, 2, 3]' in text and "  [1.5, 3]" in text


@pytest.mark.parametrize("script", ["bench", "compare-logprobs"])
def test_wrappers_help_and_usage_exit_codes(repo_root, script):
    exe = [sys.executable, str(repo_root / "scripts" / script)]
    ok = subprocess.run([*exe, "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "Exit status: 0 ok, 1 a request failed" in ok.stdout
    assert subprocess.run([*exe, "--bogus"], capture_output=True).returncode == 2
