# SPDX-License-Identifier: Apache-2.0
"""scripts/bench-vllm without a GPU: the `vllm serve` and `vllm bench serve` command lines
(checked against vLLM 0.29.0's own parsers), the servers' environments, vLLM's real client
against a server stand-in, reading a saved vLLM result, ratios, the comparison with
bench-offload's figures, the suite JSON against
bench/results/suite.schema.json, and whole runs against fake_vllm_cli.py put in fake site
folders: a server that never answers /health, one that dies, a client that fails, one that
dies at start-up once, lost requests.
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest
from eodev import bench_vllm, schemas
from eodev import bench_vllm_report as rep

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCHEMA = ROOT / "bench/results/suite.schema.json"
DEFAULT24 = ROOT / "bench/results/2026-12-04-default24-h200.json"


# -- fixtures ----------------------------------------------------------------------------


def fake_tree(folder: pathlib.Path, patched: bool) -> pathlib.Path:
    """A site folder whose vllm/entrypoints/cli/main.py runs fake_vllm_cli.py."""
    pkg = folder / "vllm"
    (pkg / "entrypoints" / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"PATCHED = {patched}\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.29.0'\n")
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "cli" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "cli" / "main.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "import fake_vllm_cli\nfake_vllm_cli.main()\n"
    )
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A checkpoint folder, a cold file, fake unpatched and patched vLLMs, a log of every
    fake start, and the caller's environment holding settings the tool must not pass on."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_experts": 512}))
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"layers": {str(i): list(range(128)) for i in range(4)}}))
    site = fake_tree(tmp_path / "site", patched=False)
    patched = fake_tree(tmp_path / "patched", patched=True)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(calls))
    monkeypatch.setenv("VLLM_EXPERT_SWAP", "0")  # a stray setting of the caller's shell
    monkeypatch.setattr(bench_vllm, "RETRY_PAUSE_S", 0.0)
    monkeypatch.setattr(bench_vllm, "gpu_name", lambda: "fake GPU")
    base = ["--model", str(model), "--cold", str(cold), "--out", str(tmp_path / "out")]
    base += ["--vllm-site", str(site), "--vllm-patched", str(patched)]
    base += ["--port", str(free_port()), "--health-timeout-s", "60"]
    return {"tmp": tmp_path, "args": base, "calls": calls, "out": tmp_path / "out"}


def fake_calls(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def suite(out: pathlib.Path, name: str = "vllm-client") -> dict:
    return json.loads((out / f"{name}.json").read_text())


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# -- command lines -----------------------------------------------------------------------


def parsed(setup, *more: str):
    args, extra = bench_vllm.parse_args([*setup["args"], *more])
    return args, extra


def test_client_command_flags(setup):
    args, _ = parsed(setup, "--seed", "7")
    folder = setup["out"] / "unpatched"
    by_c = {c: bench_vllm.client_command(args, "unpatched", c, 2, folder) for c in (1, 4, 16)}
    cmd = by_c[4]
    assert cmd[:6] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
    ]
    assert flag(cmd, "--dataset-name") == "random"
    assert flag(cmd, "--random-input-len") == "256" and flag(cmd, "--random-output-len") == "128"
    assert flag(cmd, "--random-range-ratio") == "0" and "--ignore-eos" in cmd
    assert flag(cmd, "--temperature") == "0"
    assert flag(cmd, "--seed") == "9"  # seed + repeat
    assert flag(cmd, "--max-concurrency") == "4" and flag(cmd, "--num-warmups") == "4"
    assert flag(cmd, "--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert flag(cmd, "--metric-percentiles") == "50,90,99"
    assert "--save-result" in cmd and flag(cmd, "--result-dir") == str(folder)
    assert flag(cmd, "--result-filename") == "c4-r2.json"
    assert flag(cmd, "--base-url") == f"http://127.0.0.1:{args.port}"
    assert flag(cmd, "--model") == flag(cmd, "--tokenizer") == str(args.model.resolve())
    # enough requests for a stable figure: 10 per slot, 32 at least
    assert [flag(by_c[c], "--num-prompts") for c in (1, 4, 16)] == ["32", "40", "160"]


def test_server_command_and_extra_arguments(setup):
    args, extra = parsed(setup, "--", "--kv-cache-memory-bytes", "4294967296")
    cmd = bench_vllm.server_command(args, extra)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(args.model.resolve())]
    assert flag(cmd, "--max-num-seqs") == "16" and flag(cmd, "--max-model-len") == "2048"
    assert "--no-enable-prefix-caching" in cmd
    assert cmd[-2:] == ["--kv-cache-memory-bytes", "4294967296"]  # last, so they win
    args, extra = parsed(setup, "--concurrency", "32,1", "--", "--max-model-len", "4096")
    cmd = bench_vllm.server_command(args, extra)
    assert flag(cmd, "--max-num-seqs") == "32" and cmd.count("--max-model-len") == 1
    assert args.concurrency == [1, 32]


def test_server_and_client_environments(setup):
    args, _ = parsed(setup)
    cold = pathlib.Path("/c/cold.json")
    env, own = bench_vllm.server_env("unpatched", args, cold)
    scripts = str(ROOT / "scripts")
    assert env["PYTHONPATH"] == os.pathsep.join([scripts, str(args.vllm_site.resolve())])
    assert env["EO_ALLOW_NO_API_KEY"] == "1"
    assert not [k for k in env if k.startswith("VLLM_EXPERT_")]  # the caller's SWAP=0 too
    env, own = bench_vllm.server_env("offload-03-swap", args, cold)
    assert env["PYTHONPATH"].split(os.pathsep) == [
        scripts,
        str(args.vllm_patched.resolve()),
        str(args.vllm_site.resolve()),
    ]
    assert {k: v for k, v in env.items() if k.startswith("VLLM_EXPERT_")} == {
        "VLLM_EXPERT_COLD_FILE": str(cold),
        "VLLM_EXPERT_ONE_TABLE": "1",
        "VLLM_EXPERT_PREFILL_STAGING": "1",
    }
    assert own["EO_ALLOW_NO_API_KEY"] == "1" and "FAKE_VLLM_LOG" not in own
    client = bench_vllm.client_env(args)
    assert client["PYTHONPATH"] == os.pathsep.join([scripts, str(args.vllm_site.resolve())])
    assert client["VLLM_USE_RUST_BENCH"] == "0"
    assert not [k for k in client if k.startswith("VLLM_EXPERT_")]


def vllm_cli_args(monkeypatch, argv: list[str]):
    """`argv` (after `-m vllm.entrypoints.cli.main`) through the parser vLLM 0.29.0's CLI
    builds, and its subcommand's check."""
    import vllm.entrypoints.cli.benchmark.main as bench_main
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(sys, "argv", ["vllm", *argv])
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    cmds = {}
    for mod in (serve, bench_main):
        for cmd in mod.cmd_init():
            cmd.subparser_init(sub)
            cmds[cmd.name] = cmd
    args = parser.parse_args(argv)
    cmds[args.subparser].validate(args)
    return args


def test_real_vllm_parses_both_commands(setup, monkeypatch):
    args, extra = parsed(setup, "--", "--kv-cache-memory-bytes", "4294967296")
    client = bench_vllm.client_command(args, "unpatched", 4, 1, setup["out"])
    got = vllm_cli_args(monkeypatch, client[3:])
    assert (got.dataset_name, got.random_input_len, got.random_output_len) == ("random", 256, 128)
    assert got.ignore_eos and got.temperature == 0.0 and got.seed == 1
    assert got.max_concurrency == 4 and got.num_warmups == 4 and got.num_prompts == 40
    assert got.save_result and got.result_filename == "c4-r1.json"
    assert got.percentile_metrics == "ttft,tpot,itl,e2el" and got.metric_percentiles == "50,90,99"
    server = bench_vllm.server_command(args, extra)
    got = vllm_cli_args(monkeypatch, server[3:])
    assert got.model_tag == str(args.model.resolve()) and got.port == args.port
    assert got.enable_prefix_caching is False and got.max_num_seqs == 16
    assert got.max_model_len == 2048 and got.kv_cache_memory_bytes == 4294967296


class StreamingCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions as vLLM streams it (SSE chunks, a usage chunk, [DONE]), one word a
    millisecond; /tokenize unknown, as on servers without it."""

    protocol_version = "HTTP/1.1"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "text": " w"}]}] * n
        events.append({"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": n}})
        for e in events:
            time.sleep(0.001)
            self._chunk(f"data: {json.dumps(e)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def log_message(self, *a):
        pass


def test_the_real_client_writes_what_the_report_reads(tiny_model, tmp_path):
    """vLLM 0.29.0's own `vllm bench serve`, started as the tool starts it, against a stand-in
    that streams completions: its saved result has every field the report reads."""
    import vllm

    site = pathlib.Path(vllm.__file__).parents[1]
    cold = tmp_path / "cold.json"
    cold.write_text("{}")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StreamingCompletions)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        args, _ = bench_vllm.parse_args(
            ["--model", str(tiny_model), "--cold", str(cold), "--out", str(tmp_path)]
            + ["--vllm-site", str(site), "--vllm-patched", str(site)]
            + ["--port", str(httpd.server_address[1]), "--input-len", "64", "--output-len", "8"]
            + ["--min-prompts", "8", "--prompts-per-stream", "2"]
        )
        cmd = bench_vllm.client_command(args, "unpatched", 4, 0, tmp_path)
        result, log = tmp_path / "c4-r0.json", tmp_path / "client.log"
        res = bench_vllm.run_client(cmd, bench_vllm.client_env(args), result, log, 300)
    finally:
        httpd.shutdown()
    figs = rep.repeat_figures(res)
    assert (figs["completed"], figs["failed"], figs["prompts"]) == (8, 0, 8)
    assert figs["output_tokens"] == 64 and figs["output_tok_s"] > 0
    assert res["max_concurrency"] == 4 and res["config"] == "unpatched" and res["repeat"] == "0"
    assert log.read_text().count("$ ") == 1  # not started twice


# -- reading results, ratios -------------------------------------------------------------


def vllm_result(speed: float, tpot: float, ttft: float, failed: int = 0) -> dict:
    """A result file as vLLM 0.29.0's serve.py saves it (--save-result, no --save-detailed)
    with --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99."""
    doc = {
        "date": "20261204-220000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": "unpatched",
        "model_id": "/m",
        "tokenizer_id": "/m",
        "num_prompts": 40,
        "config": "unpatched",
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 4,
        "duration": 12.5,
        "completed": 40 - failed,
        "failed": failed,
        "total_input_tokens": 10240,
        "total_output_tokens": 5120,
        "request_throughput": 3.2,
        "request_goodput": None,
        "output_throughput": speed,
        "total_token_throughput": speed * 3,
        "max_output_tokens_per_s": speed * 1.1,
        "max_concurrent_requests": 4,
        "rtfx": 0.0,
    }
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", 300.0)):
        doc.update({f"mean_{name}_ms": v, f"median_{name}_ms": v, f"std_{name}_ms": 0.1})
        doc.update({f"p50_{name}_ms": v, f"p90_{name}_ms": v * 1.5, f"p99_{name}_ms": v * 2})
    return doc


def test_read_result_and_its_figures(tmp_path):
    path = tmp_path / "c4-r0.json"
    path.write_text(json.dumps(vllm_result(409.6, 9.5, 31.0, failed=1)))
    figs = rep.repeat_figures(rep.read_result(path))
    assert figs["output_tok_s"] == 409.6 and figs["total_tok_s"] == pytest.approx(1228.8)
    assert (figs["tpot_ms_p50"], figs["tpot_ms_p90"]) == (9.5, 14.25)
    assert (figs["ttft_ms"], figs["ttft_ms_p90"], figs["itl_ms_p50"]) == (31.0, 46.5, 9.5)
    assert (figs["completed"], figs["failed"], figs["prompts"]) == (39, 1, 40)


def test_a_result_without_the_percentiles_names_the_flags(tmp_path):
    doc = vllm_result(1.0, 1.0, 1.0)
    del doc["p90_tpot_ms"], doc["p50_itl_ms"]  # the client's default --metric-percentiles 99
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(rep.ResultError, match=r"lacks p90_tpot_ms, p50_itl_ms .*50,90,99"):
        rep.read_result(path)
    path.write_text("{not json")
    with pytest.raises(rep.ResultError, match="not a readable vLLM result"):
        rep.read_result(path)


def entry(config: str, c: int, speeds: list[float], tpot: float, ttft: float) -> dict:
    repeats = [
        {"figures": rep.repeat_figures(vllm_result(s, tpot, ttft)), "raw": f"{config}/c{c}-r{k}"}
        for k, s in enumerate(speeds)
    ]
    return rep.run_entry(
        config=config,
        staging=config != "unpatched",
        concurrency=c,
        host_fraction=0.0 if config == "unpatched" else 0.25,
        repeats=repeats,
        server={"startup_s": 10.0},
    )


def test_ratios_against_unpatched_at_the_same_concurrency():
    doc = {
        "runs": [
            entry("unpatched", 1, [100.0, 110.0, 90.0], 10.0, 20.0),
            entry("unpatched", 4, [400.0, 400.0], 10.0, 40.0),
            entry("offload-03-swap", 1, [80.0, 90.0, 85.0], 12.0, 30.0),
            entry("offload-03-swap", 4, [200.0, 220.0], 20.0, 50.0),
        ]
    }
    rep.add_ratios(doc)
    one, four = doc["runs"][2], doc["runs"][3]
    assert one["variant"] == "offload-03-swap+stage" and one["prefill_staging"] is True
    assert one["decode_vs_unpatched"] == pytest.approx(85 / 100)
    assert one["decode_vs_unpatched_range"] == pytest.approx([80 / 110, 90 / 90])
    assert one["tpot_p50_vs_unpatched"] == pytest.approx(1.2)
    assert one["ttft_vs_unpatched"] == pytest.approx(1.5)
    assert four["decode_vs_unpatched"] == pytest.approx(210 / 400)
    assert doc["runs"][0]["decode_vs_unpatched"] == 1.0


def test_per_token_counters():
    reps = [
        {"counters": {"generation_tokens": 100.0, "host_reads": 500.0, "swaps": 10.0}},
        {"counters": {"generation_tokens": 300.0, "host_reads": 1500.0, "swaps": 30.0}},
    ]
    assert rep.per_token(reps, "host_reads") == 5.0 and rep.per_token(reps, "swaps") == 0.1
    unpatched = [{"counters": {"generation_tokens": 100.0, "host_reads": None, "swaps": None}}]
    assert rep.per_token(unpatched, "host_reads") is None
    assert rep.per_token([{"counters": None}], "swaps") is None


def test_other_client_ratios_from_bench_offload():
    other = json.loads(DEFAULT24.read_text())
    got = rep.other_client_ratios(other)
    assert sorted(got) == [1, 4, 16]
    assert got[1]["ratio"] == pytest.approx(0.8548, abs=1e-4)
    assert got[4]["ratio"] == pytest.approx(0.3636, abs=1e-4)
    assert got[16]["ratio"] == pytest.approx(0.2926, abs=1e-4)
    lo, hi = got[16]["range"]
    assert lo < 0.2926 < hi
    # the single-prompt decode (the 0.983x headline) rides along at one stream
    assert got[1]["single_prompt"]["ratio"] == pytest.approx(0.9832, abs=1e-4)
    # scripts/bench's fresh runs, which know their concurrency but not the staging
    bench = {
        "suite": "bench",
        "runs": [
            {"config": "offload-03-swap", "workload": "fresh", "concurrency": 2,
             "decode_vs_unpatched": 0.9, "decode_vs_unpatched_range": [0.85, 0.95]},
            {"config": "offload-02", "workload": "fresh", "concurrency": 2,
             "decode_vs_unpatched": 0.5, "decode_vs_unpatched_range": [0.4, 0.6]},
        ],
    }  # fmt: skip
    assert rep.other_client_ratios(bench) == {
        2: {
            "ratio": 0.9,
            "range": [0.85, 0.95],
            "what": "decode tok/s per stream (scripts/bench)",
            "host_reads_per_token": None,
        }
    }


def test_comparison_says_where_the_clients_disagree():
    doc = {
        "runs": [
            entry("unpatched", 1, [100.0, 100.0], 10.0, 20.0),
            entry("unpatched", 16, [1000.0, 1000.0], 10.0, 20.0),
            entry("offload-03-swap", 1, [84.0, 86.0], 10.0, 20.0),
            entry("offload-03-swap", 16, [600.0, 610.0], 10.0, 20.0),
        ]
    }
    comp = rep.comparison(rep.add_ratios(doc), json.loads(DEFAULT24.read_text()), "d24.json")
    rows = {r["concurrency"]: r for r in comp["rows"]}
    assert comp["project_client"] == "bench-offload" and set(rows) == {1, 16}
    assert rows[1]["agree"] is True  # 0.84-0.86 meets bench-offload's 0.85x range
    assert rows[16]["agree"] is False and rows[16]["difference"] > 1.0  # 0.6x against 0.29x
    assert rows[16]["project_client_host_reads_per_token"] == pytest.approx(16.52, abs=0.01)
    md = rep.comparison_lines(comp)
    assert any("| 16 |" in x and "**no**" in x and "| - / 16.52 |" in x for x in md)
    assert any("random-token prompts" in x for x in md)


# -- the suite format ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite_schema() -> dict:
    return json.loads(SCHEMA.read_text())


def test_the_references_in_bench_results_follow_the_schema(suite_schema):
    docs = [json.loads(p.read_text()) for p in sorted((ROOT / "bench/results").glob("20*.json"))]
    with_runs = [d for d in docs if "runs" in d]
    assert len(with_runs) >= 5
    for d in with_runs:
        assert schemas.validate(d, suite_schema) == []


def test_the_schema_catches_mistakes(suite_schema):
    good = json.loads(DEFAULT24.read_text())
    for change, where in (
        (lambda d: d["runs"][0].update(config="offload-04"), "runs.0.config"),
        (lambda d: d["runs"][1].pop("decode_tok_s"), "runs.1"),
        (lambda d: d.pop("gpu"), "(top)"),
        (lambda d: d["runs"][2].update(host_fraction=1.5), "runs.2.host_fraction"),
    ):
        doc = json.loads(json.dumps(good))
        change(doc)
        errors = schemas.validate(doc, suite_schema)
        assert errors and errors[0].startswith(where), errors


# -- whole runs against the fakes ----------------------------------------------------------


def run(setup, *more: str) -> int:
    return bench_vllm.main([*setup["args"], "--concurrency", "1,4", "--repeats", "2", *more])


def test_a_whole_run(setup, suite_schema):
    rc = run(setup, "--suite", "vllm-client24", "--", "--kv-cache-memory-bytes", "4294967296")
    assert rc == 0
    doc = suite(setup["out"], "vllm-client24")
    assert schemas.validate(doc, suite_schema) == []
    assert doc["complete"] and not doc["failed"] and doc["gpu"] == "fake GPU"
    assert doc["client"]["vllm_version"] == "0.29.0"
    assert doc["model"]["host_experts_per_layer"] == 128 and doc["model"]["layers"] == 4
    runs = {(r["variant"], r["concurrency"]): r for r in doc["runs"]}
    assert set(runs) == {(v, c) for v in ("unpatched", "offload-03-swap+stage") for c in (1, 4)}
    for c in (1, 4):
        base, mine = runs["unpatched", c], runs["offload-03-swap+stage", c]
        assert base["decode_tok_s"] == pytest.approx([100.0 * c, 101.0 * c])  # seed + repeat
        assert mine["decode_vs_unpatched"] == pytest.approx(0.8)
        assert mine["workload"] == "fresh" and "random dataset" in mine["prompts"]
        assert mine["config"] == "offload-03-swap" and mine["prefill_staging"] is True
        assert mine["host_fraction"] == pytest.approx(128 / 512) and base["host_fraction"] == 0
        assert mine["host_reads_per_token"] == pytest.approx(5.0)
        assert mine["swaps_per_token"] == pytest.approx(0.5)
        assert base["host_reads_per_token"] is None
        assert mine["startup_s"] is not None and mine["failed"] == 0
        for raw in mine["raw"]:  # vLLM's own files kept beside the suite
            assert "output_throughput" in json.loads((setup["out"] / raw).read_text())
    md = (setup["out"] / "vllm-client24.md").read_text()
    assert "| offload-03-swap+stage | 4 |" in md and "0.800x" in md
    calls = fake_calls(setup["calls"])
    servers = [x for x in calls if x["argv"][0] == "serve"]
    clients = [x for x in calls if x["argv"][0] == "bench"]
    assert [s["patched"] for s in servers] == [False, True]
    assert all(s["env"]["EO_ALLOW_NO_API_KEY"] == "1" for s in servers)
    assert "VLLM_EXPERT_COLD_FILE" not in servers[0]["env"]
    assert servers[1]["env"]["VLLM_EXPERT_PREFILL_STAGING"] == "1"
    assert "VLLM_EXPERT_SWAP" not in servers[1]["env"]  # the caller's stray setting
    assert servers[1]["argv"][-2:] == ["--kv-cache-memory-bytes", "4294967296"]
    assert len(clients) == 8 and not any(c["patched"] for c in clients)
    assert [flag(c["argv"], "--seed") for c in clients[:4]] == ["0", "1", "0", "1"]


def test_compare_with_at_run_time_and_report_again(setup):
    other = setup["tmp"] / "default24.json"
    other.write_text(DEFAULT24.read_text())
    assert run(setup, "--compare-with", str(other)) == 0
    doc = suite(setup["out"])
    rows = {r["concurrency"]: r for r in doc["comparison"]["rows"]}
    assert set(rows) == {1, 4}
    assert rows[4]["vllm_client"] == pytest.approx(0.8)
    assert rows[4]["project_client"] == pytest.approx(0.3636, abs=1e-4)
    assert rows[4]["agree"] is False
    md_path = setup["out"] / "vllm-client.md"
    assert "## Beside bench-offload" in md_path.read_text()
    # later: the comparison again from the finished run (e.g. after a new default24)
    md_path.unlink()
    path = setup["out"] / "vllm-client.json"
    assert bench_vllm.main(["--report", str(path), "--compare-with", str(other)]) == 0
    assert "## Beside bench-offload" in md_path.read_text()
    assert suite(setup["out"])["comparison"]["rows"] == doc["comparison"]["rows"]
    assert bench_vllm.main(["--report", str(other)]) == 2  # not a bench-vllm suite


def test_a_server_that_never_answers(setup, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SERVE", "no-health")
    args = [a if a != "60" else "3" for a in setup["args"]]  # --health-timeout-s 3
    rc = bench_vllm.main([*args, "--concurrency", "1", "--repeats", "1"])
    assert rc == bench_vllm.EXIT_NO_SERVER == 3
    err = capsys.readouterr().err
    assert "unpatched: the server did not start or died: no answer on http://127.0.0.1:" in err
    assert "starting the fake vLLM API server" in err  # the log's tail
    doc = suite(setup["out"])
    assert not doc["complete"] and "no answer" in doc["failed"][0]
    # it stopped there: no client ran, the default path was not started, nothing left running
    calls = fake_calls(setup["calls"])
    assert [c["argv"][0] for c in calls] == ["serve"]
    assert "shutdown" in doc["servers"]["unpatched"]
    assert doc["servers"]["unpatched"]["shutdown"]["killed"] is False


def test_a_server_that_dies_at_start_up(setup, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SERVE", "exit")
    assert run(setup) == 3
    err = capsys.readouterr().err
    assert "the server exited (1)" in err and "RuntimeError: no GPU here" in err


def test_a_client_that_fails(setup, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_BENCH", "fail")
    rc = bench_vllm.main([*setup["args"], "--concurrency", "1", "--repeats", "1"])
    assert rc == bench_vllm.EXIT_FAILED == 1
    doc = suite(setup["out"])
    assert doc["complete"] and len(doc["failed"]) == 2  # both configurations, each named
    assert doc["failed"][0].startswith("unpatched at concurrency 1: 0 of 1 client runs")
    assert "vllm bench serve exited 1" in doc["failed"][0]
    log = (setup["out"] / "unpatched" / "client.log").read_text()
    assert log.count("$ ") == 2 and "Initial test run failed" in log  # started once more
    assert "starting it once more" in capsys.readouterr().err


def test_a_client_that_dies_once_at_start_up_is_started_again(setup, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH", "mkl-once")
    rc = bench_vllm.main([*setup["args"], "--concurrency", "1", "--repeats", "1"])
    assert rc == 0
    log = (setup["out"] / "unpatched" / "client.log").read_text()
    assert "oneMKL FATAL ERROR" in log and log.count("$ ") == 2
    assert all(r["repeats"] == 1 for r in suite(setup["out"])["runs"])


def test_lost_requests_fail_the_run(setup, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH", "lose-requests")
    rc = bench_vllm.main([*setup["args"], "--concurrency", "4", "--repeats", "1"])
    assert rc == 1
    doc = suite(setup["out"])
    assert all(r["failed"] == 2 for r in doc["runs"])
    assert "2 failed requests" in doc["failed"][0]


def test_host_experts_per_layer_makes_the_cold_file(setup, monkeypatch):
    model = setup["tmp"] / "model"
    (model / "synthetic_model.json").write_text("{}")
    made = []

    def fake_cold(model_dir, out, per_layer):
        made.append((model_dir, per_layer))
        out.write_text(json.dumps({"layers": {"0": list(range(per_layer))}}))

    monkeypatch.setattr("eodev.synthetic_cold.synthetic_cold_file", fake_cold)
    args = [a for a in setup["args"]]
    i = args.index("--cold")
    args[i : i + 2] = ["--host-experts-per-layer", "134"]
    assert bench_vllm.main([*args, "--concurrency", "1", "--repeats", "1"]) == 0
    doc = suite(setup["out"])
    assert made == [(model, 134)]
    assert doc["model"]["host_experts_per_layer"] == 134
    assert doc["model"]["cold_file"] == str((setup["out"] / "cold-134.json").resolve())
    runs = [r for r in doc["runs"] if r["config"] != "unpatched"]
    assert runs[0]["host_fraction"] == pytest.approx(134 / 512)


# -- the launcher --------------------------------------------------------------------------


def launcher(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench-vllm"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_help_says_the_exit_codes():
    r = launcher("--help")
    assert r.returncode == 0
    assert "vllm.entrypoints.cli.main bench serve" in r.stdout
    assert "Exit codes: 0 every client run passed" in r.stdout and "--compare-with" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "need --model DIR and --out DIR"),
        (["--model", "/nonexistent", "--out", "OUT", "--cold", "COLD"], "no config.json"),
        (["--model", "MODEL", "--out", "OUT"], "need --cold FILE or --host-experts-per-layer N"),
        (["--model", "MODEL", "--out", "OUT", "--host-experts-per-layer", "8"], "make-test-model"),
        (["--model", "MODEL", "--out", "OUT", "--cold", "/nonexistent"], "no such file"),
        (["--model", "MODEL", "--out", "OUT", "--cold", "COLD", "--vllm-site", "/nonexistent"],
         "no vllm/ there (set EO_VLLM_SITE)"),
        (["--model", "MODEL", "--out", "OUT", "--cold", "COLD", "--concurrency", "0"],
         "concurrencies must be 1 or more"),
        (["--model", "MODEL", "--out", "OUT", "--cold", "COLD", "--", "--max-model-len", "300"],
         "--max-model-len 300 is below"),
        (["--report", "/nonexistent.json"], "--report /nonexistent.json: no such file"),
        (["--report", "COLD", "--compare-with", "/etc/hostname"], "not readable JSON"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2_with_one_line(setup, args, message):
    model, cold = setup["tmp"] / "model", setup["tmp"] / "cold.json"
    args = [
        {"MODEL": str(model), "OUT": str(setup["out"]), "COLD": str(cold)}.get(a, a) for a in args
    ]
    site = [
        "--vllm-site",
        str(setup["tmp"] / "site"),
        "--vllm-patched",
        str(setup["tmp"] / "patched"),
    ]
    if "--vllm-site" in args or not args or args[0] == "--report":
        site = []
    if "--" in args:
        i = args.index("--")
        args = [*args[:i], *site, *args[i:]]
    else:
        args = [*args, *site]
    r = launcher(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
