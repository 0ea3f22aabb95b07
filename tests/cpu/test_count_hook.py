# SPDX-License-Identifier: Apache-2.0
"""The usage counting hook (VLLM_EXPERT_COUNT_FILE) inside the patched vLLM on the CPU: exact
counts by prefill and decode through the router, nothing when off, atomic and periodic
writes, answers to a request file; and the tools' side: merging rank files, snapshot
differences, and `count-experts --source server` against a fake server.

    scripts/test tests/cpu/test_count_hook.py
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import test_offload_layers as offload_layers
import torch
from test_offload_layers import HIDDEN, E, K


# ---- the hook inside vLLM ----------------------------------------------------------------------
@pytest.fixture()
def hook(monkeypatch, tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_offload import planner, usage_counts

    for var in ("VLLM_EXPERT_COLD_FILE", "VLLM_EXPERT_HOST_LAYERS", "VLLM_EXPERT_COUNT_FILE"):
        monkeypatch.delenv(var, raising=False)
    planner.reset_planner()
    usage_counts.reset_counters()
    yield usage_counts
    usage_counts.reset_counters()
    planner.reset_planner()


def build(layer: int, count_file: str | None = None):
    env = {"VLLM_EXPERT_COUNT_FILE": count_file} if count_file is not None else {}
    return offload_layers.build(layer, **env)


def route(runner, topk_ids: torch.Tensor):
    """Run the router's select_experts with fixed picks (the CPU wheel lacks topk_softmax)."""
    router = runner.router
    router._compute_routing = lambda h, logits, dtype, input_ids=None: (
        torch.full(topk_ids.shape, 1.0 / K),
        topk_ids,
    )
    n = topk_ids.shape[0]
    return router.select_experts(torch.zeros(n, HIDDEN), torch.zeros(n, E), torch.int32)


def test_off_allocates_nothing(vllm_cpu, hook):
    runner = build(1)
    assert runner.router.count_fn is None
    assert hook.get_counters() is None


def test_counts_picks_exactly_by_prefill_and_decode(vllm_cpu, hook, tmp_path):
    runner = build(3, str(tmp_path / "counts.json"))
    counters = hook.get_counters()
    assert counters is not None and list(counters.layers) == [3]
    assert counters.counts(3).shape == (E, 2) and int(counters.counts(3).sum()) == 0

    # request 0 prefills 3 prompt tokens, requests 1 and 2 decode one token each; row 5 is
    # CUDA-graph padding
    counters.prepare_step(np.array([0, 3, 4, 5]), np.array([True, False, False]))
    ids = torch.tensor(
        [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5, 6, 7], [0, 1, 8, 9], [9, 10, 11, 15], [15, 14, 13, 12]],
        dtype=torch.int32,
    )
    _, out_ids = route(runner, ids)
    assert torch.equal(out_ids, ids)  # counting changes nothing the kernel sees
    want = np.zeros((E, 2), np.int64)
    for row, phase in zip(ids[:5].tolist(), [0, 0, 0, 1, 1], strict=True):
        for e in row:
            want[e, phase] += 1
    assert np.array_equal(counters.counts(3).numpy(), want)
    assert counters.tokens == {"prefill": 3, "decode": 2}

    # a dummy / warm-up run counts nothing, and the next step's padding is not stale
    counters.prepare_step(None, None)
    route(runner, ids)
    counters.prepare_step(np.array([0, 1]), np.array([False]))
    route(runner, ids[:2])
    want[[0, 1, 2, 3], 1] += 1
    assert np.array_equal(counters.counts(3).numpy(), want)
    assert counters.tokens == {"prefill": 3, "decode": 3}


def test_the_workers_warm_up_requests_are_not_counted(vllm_cpu, hook, tmp_path, monkeypatch):
    """The V2 worker warms its kernels up with requests that reach the step hook with a real
    query layout (patch 0016): inside `uncounted_steps` they count nothing, after it the
    same step counts as usual."""
    from vllm.model_executor.layers.fused_moe import expert_offload

    path = str(tmp_path / "counts.json")
    runner = build(2, path)
    monkeypatch.setenv("VLLM_EXPERT_COUNT_FILE", path)
    counters = hook.get_counters()
    layout = (np.array([0, 2, 4, 5]), np.array([True, True, False]))
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 4], [8, 9, 10, 11], [1, 2, 3, 4]])
    with expert_offload.uncounted_steps(), expert_offload.uncounted_steps():
        expert_offload.prepare_step(*layout)
        route(runner, ids.int())
    assert counters.tokens == {"prefill": 0, "decode": 0} and counters.steps == 0
    assert int(counters.counts(2).sum()) == 0
    expert_offload.prepare_step(*layout)
    route(runner, ids.int())
    assert counters.tokens == {"prefill": 4, "decode": 1} and counters.steps == 1
    assert int(counters.counts(2).sum()) == 5 * K


def test_the_worker_runs_both_warm_ups_uncounted(vllm_cpu):
    """Both of the worker's warm-ups that send requests through execute_model (the V2
    runner's warmup_kernels, and kernel_warmup's mixed prefill/decode steps) run inside
    expert_offload.uncounted_steps() in the patched worker."""
    import ast
    import inspect

    from vllm.v1.worker import gpu_worker

    tree = ast.parse(inspect.getsource(gpu_worker))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            ast.unparse(item.context_expr) == "expert_offload.uncounted_steps()"
            for item in node.items
        ):
            guarded |= {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
    calls = [
        ast.unparse(c.func)
        for c in ast.walk(tree)
        if isinstance(c, ast.Call) and ast.unparse(c.func) in ("warmup_kernels", "kernel_warmup")
    ]
    assert sorted(calls) == ["kernel_warmup", "warmup_kernels"]
    assert {"kernel_warmup", "warmup_kernels"} <= guarded


def test_a_step_like_the_one_before_is_counted_without_a_copy(
    vllm_cpu, hook, tmp_path, monkeypatch
):
    runner = build(1, str(tmp_path / "counts.json"))
    counters = hook.get_counters()
    copies = []
    real_copy = counters._staging.copy
    monkeypatch.setattr(counters._staging, "copy", lambda d, s: (copies.append(1), real_copy(d, s)))
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    for _ in range(4):  # two requests decoding, step after step
        counters.prepare_step(np.array([0, 1, 2]), np.array([False, False]))
        route(runner, ids)
    assert len(copies) == 1
    assert counters.tokens == {"prefill": 0, "decode": 8} and counters.steps == 4
    assert counters.counts(1)[:, 1].tolist() == [4] * 8 + [0] * (E - 8)
    counters.prepare_step(np.array([0, 2]), np.array([True]))  # a new layout is copied
    route(runner, ids)
    assert len(copies) == 2 and counters.tokens == {"prefill": 2, "decode": 8}
    assert counters.counts(1)[:, 0].tolist() == [1] * 8 + [0] * (E - 8)


def test_the_written_file_is_what_the_tools_read(vllm_cpu, hook, tmp_path):
    from eotools.counts import load_counts

    path = tmp_path / "counts.json"
    runners = [build(layer, str(path)) for layer in (0, 2)]
    counters = hook.get_counters()
    # a second layer with the same number (a drafter's) is left alone, not an error
    assert build(2, str(path)).router.count_fn is None
    counters.prepare_step(np.array([0, 2]), np.array([True]))
    route(runners[1], torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]], dtype=torch.int32))
    counters.write()
    c = load_counts(path)
    assert c.extra["layers"] == [0, 2] and c.extra["rank"]["pp_size"] == 1
    assert c.prefill.shape == (3, E) and c.model["num_experts"] == E and c.top_k == K
    assert c.prefill[2].tolist() == [0, 2, 2, 2, 1, 1] + [0] * (E - 6)
    assert c.prefill[0].sum() == 0 and c.decode.sum() == 0
    assert c.tokens("prefill") == 2


def test_write_is_atomic(vllm_cpu, hook, tmp_path, monkeypatch):
    path = tmp_path / "counts.json"
    build(0, str(path))
    counters = hook.get_counters()
    counters.write()
    before = path.read_text()

    def crash(src, dst):
        raise OSError("simulated crash between write and rename")

    counters.tokens["prefill"] = 99
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        counters.write()
    monkeypatch.undo()
    assert path.read_text() == before  # the old file, whole
    assert json.loads(before)["data"]["tokens"]["prefill"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["counts.json"]  # no temporary left


def test_periodic_writer_and_request_file(vllm_cpu, hook, tmp_path, monkeypatch):
    path = tmp_path / "counts.json"
    monkeypatch.setattr(hook, "POLL_S", 0.02)
    runner = build(1, str(path))
    counters = hook.get_counters()
    counters.interval_s = 0.1
    assert counters._thread is None  # not before the first real step (CUDA graph capture)
    counters.prepare_step(np.array([0, 1]), np.array([False]))
    route(runner, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32))
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    first = json.loads(path.read_text())
    assert first["decode"][1][1] == 1 and first["snapshot"]["request"] is None

    counters.interval_s = 0  # from now on only on request
    (tmp_path / "counts.json.request").write_text("nonce-1\n")
    while json.loads(path.read_text())["snapshot"]["request"] != "nonce-1":
        assert time.monotonic() < deadline, "the writer did not answer the request"
        time.sleep(0.02)
    seq = json.loads(path.read_text())["snapshot"]["seq"]
    time.sleep(0.2)  # an answered request is not answered again
    assert json.loads(path.read_text())["snapshot"]["seq"] == seq

    counters.close()  # shutdown: stops the thread, writes the final counts
    assert not counters._thread.is_alive()
    assert json.loads(path.read_text())["snapshot"]["seq"] == seq + 1


def test_rank_file_names():
    from vllm.model_executor.layers.fused_moe.expert_offload.usage_counts import rank_file_path

    assert rank_file_path("/c/counts.json", 0, 1) == "/c/counts.json"
    assert rank_file_path("/c/counts.json", 1, 2) == "/c/counts.pp1.json"
    assert rank_file_path("/c/counts.json", 1, 2, 3, 4) == "/c/counts.dp3.pp1.json"


# ---- merging and differences (scripts/eotools/counts.py) ----------------------------------------
MODEL = {"name": "m", "architecture": "Qwen3MoeForCausalLM", "num_layers": 4, "num_experts": E}


def rank_counts(layers, pp_rank, pp_size=2, model=MODEL, tokens=(10, 5), seed=0, **snap):
    from eotools.counts import Counts

    rng = np.random.default_rng(seed + pp_rank)
    prefill = np.zeros((model["num_layers"], model["num_experts"]), np.int64)
    decode = np.zeros_like(prefill)
    for layer in layers:
        prefill[layer] = rng.integers(0, 50, model["num_experts"])
        decode[layer] = rng.integers(0, 50, model["num_experts"])
    return Counts(
        dict(model),
        {"name": "served", "tokens": {"prefill": tokens[0], "decode": tokens[1]}},
        prefill,
        decode,
        K,
        "hook",
        {
            "layers": list(layers),
            "rank": {"pp_rank": pp_rank, "pp_size": pp_size, "dp_rank": 0, "dp_size": 1},
            "snapshot": snap or None,
        },
    )


def test_merge_unions_pipeline_ranks(tmp_path):
    from eotools.counts import load_counts, merge_ranks

    a, b = rank_counts([0, 1], 0), rank_counts([2, 3], 1)
    a.save(tmp_path / "c.pp0.json")
    b.save(tmp_path / "c.pp1.json")
    m = merge_ranks([load_counts(tmp_path / "c.pp1.json"), load_counts(tmp_path / "c.pp0.json")])
    assert m.extra["layers"] == [0, 1, 2, 3]
    assert np.array_equal(m.prefill[:2], a.prefill[:2]) and np.array_equal(
        m.decode[2:], b.decode[2:]
    )
    assert m.tokens("prefill") == 10 and m.tokens("decode") == 5  # the same tokens, not twice


def test_merge_errors():
    from eotools.counts import CountsError, merge_ranks

    with pytest.raises(CountsError, match="layer 1 is counted by pipeline ranks 0 and 1"):
        merge_ranks([rank_counts([0, 1], 0), rank_counts([1, 2, 3], 1)])
    with pytest.raises(CountsError, match="missing or given twice"):
        merge_ranks([rank_counts([0, 1], 0)])
    other = {**MODEL, "num_experts": 8}
    with pytest.raises(CountsError, match="different models"):
        merge_ranks([rank_counts([0, 1], 0), rank_counts([2, 3], 1, model=other)])
    with pytest.raises(CountsError, match="different models"):
        merge_ranks([rank_counts([0, 1], 0), rank_counts([2, 3], 1, model={**MODEL, "name": "x"})])


def test_subtract_and_restart_detection():
    from eotools.counts import CountsError, merge_ranks, subtract

    before = merge_ranks([rank_counts([0, 1], 0), rank_counts([2, 3], 1)])
    after = merge_ranks(
        [rank_counts([0, 1], 0, tokens=(30, 9)), rank_counts([2, 3], 1, tokens=(30, 9))]
    )
    after.prefill = after.prefill + before.prefill
    after.decode = after.decode + 1
    d = subtract(after, before)
    assert d.tokens("prefill") == 20 and d.tokens("decode") == 4
    assert np.array_equal(d.prefill, after.prefill - before.prefill)
    with pytest.raises(CountsError, match="restarted"):
        subtract(before, after)
    with pytest.raises(CountsError, match="different models"):
        subtract(after, rank_counts([0, 1], 0, pp_size=1, model={**MODEL, "num_layers": 5}))


# ---- count-experts --source server against a fake server and a fake hook ---------------------
class FakeServer:
    """An OpenAI completions server whose "model" picks expert (prompt length % E) in every
    layer for every prompt token, and a hook that writes two pipeline-rank files like
    vLLM's (layers 0-1 and 2-3) when the request file changes."""

    def __init__(self, counts_file: pathlib.Path):
        self.counts_file = counts_file
        self.prefill = np.zeros((4, E), np.int64)
        self.decode = np.zeros((4, E), np.int64)
        self.tokens = [0, 0]
        self.prompts: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.api_key = ""  # set: 401 without `Authorization: Bearer KEY`, as vLLM answers
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _refused(self) -> bool:
                if not fake.api_key or self.headers.get("Authorization") == (
                    f"Bearer {fake.api_key}"
                ):
                    return False
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def _send(self, doc):
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if not self._refused():
                    self._send({"data": [{"id": "fake-moe"}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                n = len(req["prompt"].split())
                gen = req["max_tokens"]
                with fake.lock:
                    fake.prompts.append((req["prompt"], gen))
                    fake.prefill[:, n % E] += n
                    fake.decode[:, (n + 1) % E] += gen - 1
                    fake.tokens[0] += n
                    fake.tokens[1] += gen - 1
                self._send({"usage": {"prompt_tokens": n, "completion_tokens": gen}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.threads = [
            threading.Thread(target=self.httpd.serve_forever, daemon=True),
            threading.Thread(target=self.hook, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def hook(self):
        from eotools.counts import Counts

        served = None
        request = pathlib.Path(str(self.counts_file) + ".request")
        while not self.stop.wait(0.02):
            nonce = request.read_text().strip() if request.exists() else None
            if nonce is None or nonce == served:
                continue
            with self.lock:
                for pp, layers in enumerate(([0, 1], [2, 3])):
                    keep = np.zeros((4, 1), np.int64)
                    keep[layers] = 1
                    Counts(
                        dict(MODEL, name="fake-moe"),
                        {
                            "name": "served",
                            "tokens": dict(zip(("prefill", "decode"), self.tokens, strict=True)),
                        },
                        self.prefill * keep,
                        self.decode * keep,
                        K,
                        "fake hook",
                        {
                            "layers": layers,
                            "rank": {"pp_rank": pp, "pp_size": 2, "dp_rank": 0, "dp_size": 1},
                            "snapshot": {"request": nonce},
                        },
                    ).save(self.counts_file.with_name(f"counts.pp{pp}.json"))
            served = nonce

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def fake_server(tmp_path):
    server = FakeServer(tmp_path / "hook" / "counts.json")
    (tmp_path / "hook").mkdir()
    yield server
    server.close()


def test_count_experts_server_saves_per_set_differences(fake_server, tmp_path):
    from eotools.count_experts import main
    from eotools.counts import load_counts

    (tmp_path / "code.txt").write_text("a b c\n\nd e f g h\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "x y"}) + "\n")
    args = ["--source", "server", "--url", fake_server.url, "--counts-file"]
    args += [str(fake_server.counts_file), "--out-dir", str(tmp_path / "out"), "--timeout", "10"]
    args += ["--data", f"code={tmp_path / 'code.txt'}", "--data", f"chat={tmp_path / 'chat.jsonl'}"]
    assert main(args + ["--decode-tokens", "4", "--kind", "chat=dialogue"]) == 0
    code = load_counts(tmp_path / "out" / "code.json")
    chat = load_counts(tmp_path / "out" / "chat.json")
    assert code.model["name"] == "fake-moe" and code.extra["layers"] == [0, 1, 2, 3]
    assert code.data["tokens"] == {"prefill": 8, "decode": 6}  # only this set's tokens
    assert code.prefill[:, 3].tolist() == [3] * 4 and code.prefill[:, 5].tolist() == [5] * 4
    assert code.decode.sum() == 4 * 6 and code.data["api_usage"]["completion_tokens"] == 8
    assert chat.data["kind"] == "dialogue" and chat.data["tokens"] == {"prefill": 2, "decode": 3}
    assert chat.prefill[:, 2].tolist() == [2] * 4 and chat.prefill.sum() == 8
    assert chat.data["server"]["served_model"] == "fake-moe" and chat.data["mode"] == "generate"

    assert main(args + ["--mode", "prefill"]) == 0  # prefill only: one token each
    assert all(gen == 1 for _, gen in fake_server.prompts[-3:])
    assert load_counts(tmp_path / "out" / "code.json").decode.sum() == 0


def test_count_experts_server_sends_the_api_key(fake_server, tmp_path, capsys, monkeypatch):
    """A server started with an API key (the compose files' default) is counted with the key
    from VLLM_API_KEY; without it the tool says which variable to set."""
    from eotools.count_experts import main

    fake_server.api_key = "k-7"
    (tmp_path / "t.txt").write_text("a b c\n")
    args = ["--source", "server", "--url", fake_server.url, "--out-dir", str(tmp_path / "o")]
    args += ["--counts-file", str(fake_server.counts_file), "--timeout", "10"]
    args += ["--data", f"t={tmp_path / 't.txt'}"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(args) == 1
    assert "401" in (err := capsys.readouterr().err) and "set VLLM_API_KEY" in err
    monkeypatch.setenv("VLLM_API_KEY", "wrong")
    assert main(args) == 1
    assert "VLLM_API_KEY is not the server's key" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", "k-7")
    assert main(args) == 0
    assert fake_server.prompts and (tmp_path / "o" / "t.json").is_file()


def test_count_experts_server_errors(fake_server, tmp_path, capsys):
    from eotools.count_experts import main

    (tmp_path / "empty.txt").write_text("\n\n")
    base = ["--source", "server", "--url", fake_server.url, "--out-dir", str(tmp_path / "o")]
    assert main(base + ["--data", f"e={tmp_path / 'empty.txt'}"]) == 2  # no --counts-file
    args = base + ["--counts-file", str(fake_server.counts_file), "--timeout", "5"]
    assert main(args + ["--data", f"e={tmp_path / 'empty.txt'}"]) == 1
    assert "holds no text" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("a b\n")
    lost = ["--counts-file", str(tmp_path / "elsewhere" / "counts.json"), "--timeout", "0.3"]
    assert main(base + lost + ["--data", f"t={tmp_path / 't.txt'}"]) == 1
    assert "does this machine see" in capsys.readouterr().err
    (tmp_path / "elsewhere").mkdir()
    assert main(base + lost + ["--data", f"t={tmp_path / 't.txt'}"]) == 1
    assert "did not answer" in capsys.readouterr().err
    assert (
        main(
            ["--source", "server", "--url", "http://127.0.0.1:9", "--counts-file", "x"]
            + ["--out-dir", str(tmp_path), "--data", f"t={tmp_path / 't.txt'}"]
        )
        == 1
    )


def test_count_experts_engine_drives_an_offline_engine(fake_server, tmp_path, monkeypatch):
    """--source engine: vllm.LLM in this process, started with the hook on, prefix caching
    off and the --engine-arg values; counts per set as with a server (the fake's hook)."""
    import types

    from eotools import count_experts
    from eotools.counts import load_counts

    made = {}

    class FakeLLM:  # picks like FakeServer: expert (words % E) per prompt token
        def __init__(self, model, **kwargs):
            made.update(model=model, kwargs=kwargs, env=os.environ["VLLM_EXPERT_COUNT_FILE"])

        def generate(self, prompts, params, use_tqdm=True):
            outs = []
            for prompt in prompts:
                n, gen = len(prompt.split()), params["max_tokens"]
                with fake_server.lock:
                    fake_server.prefill[:, n % E] += n
                    fake_server.decode[:, (n + 1) % E] += gen - 1
                    fake_server.tokens[0] += n
                    fake_server.tokens[1] += gen - 1
                outs.append(
                    types.SimpleNamespace(
                        prompt_token_ids=[0] * n,
                        outputs=[types.SimpleNamespace(token_ids=[0] * gen)],
                    )
                )
            return outs

    monkeypatch.setattr(
        count_experts,
        "make_engine_client",
        lambda model, counts_file, pairs: count_experts.EngineClient(
            model, counts_file, count_experts.engine_args(pairs), FakeLLM, dict
        ),
    )
    monkeypatch.setenv("VLLM_EXPERT_COUNT_FILE", "")  # restored after: the client sets it
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # and this one
    (tmp_path / "code.txt").write_text("a b c\n\nd e f g h\n")
    args = ["--source", "engine", "--model", "/models/m", "--counts-file"]
    args += [str(fake_server.counts_file), "--out-dir", str(tmp_path / "out"), "--timeout", "10"]
    args += ["--engine-arg", "tensor_parallel_size=2", "--engine-arg", "quantization=gptq"]
    assert count_experts.main(args + ["--data", f"code={tmp_path / 'code.txt'}"]) == 0
    assert made == {
        "model": "/models/m",
        "kwargs": {
            "enable_prefix_caching": False,
            "tensor_parallel_size": 2,
            "quantization": "gptq",
        },
        "env": str(fake_server.counts_file),
    }
    code = load_counts(tmp_path / "out" / "code.json")
    assert code.data["tokens"] == {"prefill": 8, "decode": 2 * 127}  # not the warm-up
    assert code.prefill[:, 3].tolist() == [3] * 4 and code.prefill[:, 5].tolist() == [5] * 4
    assert code.data["engine"]["served_model"] == "/models/m"
    assert code.tool.startswith("scripts/count-experts --source engine")
    assert code.data["api_usage"] == {"prompt_tokens": 8, "completion_tokens": 256}


def test_count_experts_engine_needs_a_model_and_vllm(tmp_path, capsys, monkeypatch):
    from eotools import count_experts

    (tmp_path / "t.txt").write_text("a b\n")
    base = ["--source", "engine", "--out-dir", str(tmp_path), "--data", f"t={tmp_path / 't.txt'}"]
    assert count_experts.main(base) == 2
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM on this machine
    monkeypatch.setenv("VLLM_EXPERT_COUNT_FILE", "")  # restored after: the client sets it
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # and this one
    assert count_experts.main(base + ["--model", "m"]) == 1
    assert "needs vLLM with the series applied" in capsys.readouterr().err
    assert count_experts.main(base + ["--model", "m", "--engine-arg", "novalue"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err


# ---- counting through one table (offload-03) ------------------------------------------------
@pytest.fixture()
def one_table_counted(vllm_cpu, hook, tmp_path, monkeypatch):
    """A merged one-table layer (COLD on host) whose router is counted."""
    from test_one_table import COLD
    from vllm.model_executor.layers.fused_moe.expert_offload import one_table

    monkeypatch.setitem(one_table.KERNEL_SETUP, "UnquantizedFusedMoEMethod", lambda m: None)
    cold = offload_layers.cold_file(tmp_path, {2: COLD})
    runner = offload_layers.build(
        2, VLLM_EXPERT_COLD_FILE=cold, VLLM_EXPERT_COUNT_FILE=str(tmp_path / "counts.json")
    )
    list(runner.load_weights(iter(offload_layers.checkpoint())))
    runner.gate = torch.nn.Linear(HIDDEN, E, bias=False)
    runner.gate.weight.data = torch.randn(E, HIDDEN).bfloat16()
    table = one_table.merge(runner.routed_experts, one_table.cpu_allocator)
    runner.routed_experts.__dict__["one_table"] = table
    counters = hook.get_counters()
    counters.prepare_step(np.array([0, 1, 2]), np.array([False, False]))  # two decode tokens
    return runner, table, counters


def test_one_table_counts_experts_not_rows_whatever_the_swap_does(one_table_counted, monkeypatch):
    """The router is untouched by one table: the count hook sees its expert ids, before
    the layer maps them to table rows (which the runtime swap keeps changing)."""
    from vllm.model_executor.layers.fused_moe.expert_offload import swap, swap_runtime

    runner, table, counters = one_table_counted
    module = runner.routed_experts
    ids = torch.tensor([[0, 1, 12, 13], [7, 13, 14, 8]], dtype=torch.int32)
    route(runner, ids)
    rows = table.rows_of(ids)
    assert not torch.equal(rows, ids)  # counting rows would have counted other experts
    want = np.bincount(ids.flatten().numpy(), minlength=E)
    assert np.array_equal(counters.counts(2)[:, 1].numpy(), want)

    # with the runtime swap on, its map moves an expert; the counts stay by id
    monkeypatch.setattr(swap, "route_picks", lambda state, i, ids, valid=None: ids)
    rt = swap_runtime.SwapRuntime(swap_runtime.SwapSettings(8, 512.0, 2.0), max_tokens=16)
    assert rt.register(module)
    module.__dict__["swap"] = rt
    rt.route(module, ids)  # the first forward makes the runtime's maps
    e2r = rt.state.expert_to_row[0]
    e2r[[0, 1]] = e2r[[1, 0]].clone()
    route(runner, ids)
    assert np.array_equal(counters.counts(2)[:, 1].numpy(), 2 * want)


# ---- the per-token pick trace (VLLM_EXPERT_COUNT_TRACE_TOKENS) ------------------------------
def test_the_trace_keeps_decode_picks_in_order(vllm_cpu, hook, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_EXPERT_COUNT_TRACE_TOKENS", "5")
    path = tmp_path / "counts.json"
    runners = [build(layer, str(path)) for layer in (1, 3)]
    counters = hook.get_counters()

    def step(qsl, prefilling, ids):
        counters.prepare_step(np.array(qsl), np.array(prefilling))
        for i, r in enumerate(runners):  # layer 3 picks differ from layer 1's: +1
            route(r, torch.tensor(ids, dtype=torch.int32) + i)

    # a prefill of 2 tokens and one decode token, then two decode tokens twice (the same
    # layout: the counting fast path), then a dummy run, then one more decode token
    step([0, 2, 3], [True, False], [[9, 9, 9, 9], [9, 9, 9, 9], [0, 1, 2, 3]])
    step([0, 1, 2], [False, False], [[4, 5, 6, 7], [8, 9, 10, 11]])
    step([0, 1, 2], [False, False], [[1, 2, 3, 4], [5, 6, 7, 8]])
    counters.prepare_step(None, None)
    route(runners[0], torch.full((2, K), 9, dtype=torch.int32))
    step([0, 1], [False], [[2, 4, 6, 8]])  # the trace is full after 5 tokens: not kept
    counters.write()
    trace = np.load(tmp_path / "counts.picks.npz")
    assert trace["layers"].tolist() == [1, 3]
    want = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert trace["picks"].shape == (5, 2, K)
    assert trace["picks"][:, 0].tolist() == want
    assert trace["picks"][:, 1].tolist() == [[x + 1 for x in row] for row in want]
    assert counters.tokens == {"prefill": 2, "decode": 6}  # counting itself goes on


def test_no_trace_without_the_setting(vllm_cpu, hook, tmp_path):
    path = tmp_path / "counts.json"
    runner = build(1, str(path))
    counters = hook.get_counters()
    counters.prepare_step(np.array([0, 1]), np.array([False]))
    route(runner, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32))
    counters.write()
    assert counters.trace is None and not (tmp_path / "counts.picks.npz").exists()


def test_simulate_swap_replays_a_serving_trace(vllm_cpu, hook, tmp_path, monkeypatch, repo_root):
    """The hook's trace of layers 1 and 3 of a 4-layer model goes straight into
    scripts/simulate-swap: host reads counted against the cold set of those layers."""
    monkeypatch.setenv("VLLM_EXPERT_COUNT_TRACE_TOKENS", "64")
    path = tmp_path / "counts.json"
    runners = {layer: build(layer, str(path)) for layer in (1, 3)}
    counters = hook.get_counters()
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    for _ in range(3):
        counters.prepare_step(np.array([0, 1, 2]), np.array([False, False]))
        for r in runners.values():
            route(r, ids)
    counters.write()
    cold = {
        "format": "vllm-expert-offload/cold-set",
        "version": 1,
        "model": {"name": "unit", "num_layers": 4, "num_experts": E},
        "layers": {"0": [0, 1, 2, 3], "1": [0, 1], "3": [5]},  # layer 0 is not in the trace
    }
    (tmp_path / "cold.json").write_text(json.dumps(cold))
    out = tmp_path / "sim.json"
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "scripts/simulate-swap"),
            "--cold",
            str(tmp_path / "cold.json"),
            "--picks",
            str(tmp_path / "counts.picks.npz"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    fixed = json.loads(out.read_text())["results"][0]
    assert fixed["policy"] is None and fixed["tokens"] == 6
    # each step: layer 1 reads experts 0 and 1 for the first token, layer 3 expert 5 for the second
    assert fixed["reads_per_token"] == pytest.approx((2 + 1) * 3 / 6)


def test_the_model_runner_builds_the_step_layout_only_when_used(vllm_cpu, monkeypatch):
    """Offload off: the V1 model runner's step skips building the hook's arguments."""
    from vllm.model_executor.layers.fused_moe import expert_offload

    for var in ("VLLM_EXPERT_COUNT_FILE", "VLLM_EXPERT_ONE_TABLE"):
        monkeypatch.delenv(var, raising=False)
    assert not expert_offload.needs_step_layout()
    monkeypatch.setenv("VLLM_EXPERT_ONE_TABLE", "1")
    assert expert_offload.needs_step_layout()
    monkeypatch.delenv("VLLM_EXPERT_ONE_TABLE")
    monkeypatch.setenv("VLLM_EXPERT_COUNT_FILE", "/tmp/counts.json")
    assert expert_offload.needs_step_layout()
