# SPDX-License-Identifier: Apache-2.0
"""The compose files: valid against the Compose Specification (the pinned schema of
eodev/schemas.py), the reference serving settings (the 2x32GB article), what every service
needs (GPUs, shared memory, page-locking, health check), and the tiny service's first-start
model."""

from __future__ import annotations

import copy
import http.server
import json
import pathlib
import subprocess
import sys
import threading

import pytest
from eodev import schemas
from eotools import coldcheck
from eotools import preflight as pf
from eotools.envsubst import substitute
from eotools.topologies import TOPOLOGIES

FILES = sorted(pathlib.Path(__file__).resolve().parents[2].glob("compose/*.yml"))

# the 2x32GB article's serving settings, exactly as it lists them
SPEC_2X32GB_TEXT = (
    "--pipeline-parallel-size 2 --tensor-parallel-size 1 --max-model-len 262144 --max-num-seqs 2 "
    "--max-num-batched-tokens 2048 --kv-cache-memory-bytes 360000000 --enable-prefix-caching "
    "--mamba-cache-mode align"
)
SPEC_2X32GB = SPEC_2X32GB_TEXT.split()
# What the compose files change from those settings, for vLLM 0.29.0 plus the series to start
# Qwen3.8-Flash-Next (compose/README.md, scripts/memory-plan): QSA keeps its K/V in VRAM, so
# one 262,144-token request needs ~3.1 GiB per card at PP=2 (2.1 at PP=3), not the article's
# 360/550 MB; and a short model name for clients.
SERVED_NAME = "${SERVED_MODEL_NAME:-Qwen3.8-Flash-Next-INT4}"
CHANGED_2X32GB = {"--kv-cache-memory-bytes": "3600000000", "--served-model-name": SERVED_NAME}
# the other topologies: what the reference settings change from 2x32GB, and the KV each needs
SPEC_OTHERS = {
    "3x24GB": {"--pipeline-parallel-size": "3", "--kv-cache-memory-bytes": "2400000000"},
    "2x24GB": {"--pipeline-parallel-size": "2", "--max-num-batched-tokens": "512"},
}
# routed experts per card on host: what each card needs with that KV and the default path's
# prefill staging slots (memory-plan), plus a margin for the estimate
HOST_BUDGET_GIB = {"2x32GB": "7.6", "3x24GB": "4.0", "2x24GB": "14"}
# the default path: one table with the runtime swap everywhere; prefill staging where the
# prefill chunk reaches its 2048-token minimum (2x24GB's 512-token chunks never do)
DEFAULT_STAGING = {"2x32GB": "1", "3x24GB": "1", "2x24GB": "0"}


@pytest.fixture(scope="session")
def compose_schema() -> dict:
    return schemas.load_schema("compose")


def service(path: pathlib.Path) -> dict:
    doc = schemas.load_yaml(path)
    [svc] = doc["services"].values()
    return svc


def flags(command: list[str], environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """--flag value pairs of a vllm serve command (a flag without a value maps to None), each
    ${VAR:-default} taken from `environ` (None: left as written)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(command):
        if arg.startswith("--"):
            nxt = command[i + 1] if i + 1 < len(command) else None
            value = None if nxt is None or nxt.startswith("--") else nxt
            out[arg] = substitute(value, environ) if value and environ is not None else value
    return out


def defaults(settings: dict[str, str]) -> dict[str, str]:
    """Each value's ${VAR:-default} at its default, as an empty shell gives it."""
    return {k: substitute(v, {}) for k, v in settings.items()}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_compose_file_is_valid(path, compose_schema):
    assert schemas.validate(schemas.load_yaml(path), compose_schema) == []


def test_the_schema_catches_mistakes(compose_schema):
    good = schemas.load_yaml(FILES[0])
    mistakes = {
        "services.vllm.ipc": lambda s: s.update(ipc=["host"]),
        "services.vllm": lambda s: s.update(gpu_count=2),  # not a compose key
        "services.vllm.deploy.resources.reservations.devices.0": lambda s: s["deploy"]["resources"][
            "reservations"
        ]["devices"][0].update(capabilites=["gpu"]),
        "services.vllm.healthcheck.retries": lambda s: s["healthcheck"].update(retries=[3]),
    }
    for where, mistake in mistakes.items():
        doc = copy.deepcopy(good)
        mistake(doc["services"]["vllm"])
        errors = schemas.validate(doc, compose_schema)
        assert errors and any(e.startswith(where) for e in errors), (where, errors)


def test_validate_schemas_cli(repo_root, tmp_path):
    (tmp_path / "compose").mkdir()
    good = (repo_root / "compose/tiny.yml").read_text()
    (tmp_path / "compose/good.yml").write_text(good)
    (tmp_path / "compose/bad.yml").write_text(good.replace("ipc: host", "ipc: [host]"))
    r = subprocess.run(
        [sys.executable, str(repo_root / "scripts/validate-schemas"), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "compose/good.yml: valid" in r.stdout
    assert "compose/bad.yml: not valid" in r.stderr and "services.vllm.ipc" in r.stderr


def test_2x32GB_serves_the_spec_settings(repo_root):
    svc = service(repo_root / "compose/2x32GB.yml")
    model, *args = svc["command"]
    assert substitute(model, {}) == "/models/Qwen3.8-Flash-Next-INT4"
    assert substitute(model, {"MODEL_NAME": "other"}) == "/models/other"
    assert flags(args, {}) == flags(SPEC_2X32GB) | defaults(CHANGED_2X32GB)
    # the prefill chunk and staging: the reference settings unless the shell sets them
    longer = flags(args, {"MAX_NUM_BATCHED_TOKENS": "8192"})
    assert longer["--max-num-batched-tokens"] == "8192"
    # the SPEC's flags in the SPEC's order, the model name first
    assert [a for a in args if a.startswith("--")][1:] == [
        a for a in SPEC_2X32GB if a.startswith("--")
    ]
    cold = svc["environment"]["VLLM_EXPERT_COLD_FILE"]
    # unset by default: a budget-only start; a COLD_FILE that names no file stops the start
    assert substitute(cold, {}) == ""
    assert substitute(cold, {"COLD_FILE": "/cold/2GiB.json"}) == "/cold/2GiB.json"
    one_table = svc["environment"]["VLLM_EXPERT_ONE_TABLE"]  # offload-03 by default
    assert substitute(one_table, {}) == "1" and substitute(one_table, {"ONE_TABLE": "0"}) == "0"
    staging = svc["environment"]["VLLM_EXPERT_PREFILL_STAGING"]  # on by default here
    assert substitute(staging, {}) == "1"
    assert substitute(staging, {"PREFILL_STAGING": "0"}) == "0"


@pytest.mark.parametrize("name", list(SPEC_OTHERS))
def test_other_topologies_change_only_what_the_spec_says(repo_root, name):
    svc = service(repo_root / f"compose/{name}.yml")
    expected = flags(SPEC_2X32GB) | defaults(CHANGED_2X32GB) | SPEC_OTHERS[name]
    assert flags(svc["command"][1:], {}) == expected
    env = svc["environment"]
    assert substitute(env["VLLM_EXPERT_PREFILL_STAGING"], {}) == DEFAULT_STAGING[name]
    assert substitute(env["VLLM_EXPERT_ONE_TABLE"], {}) == "1"


@pytest.mark.parametrize("name", ["2x32GB", "3x24GB", "2x24GB"])
def test_the_default_path_fits_each_card_and_staging_only_where_chunks_reach_it(repo_root, name):
    """The defaults start one table with the runtime swap, and prefill staging only where the
    compose file's prefill chunk reaches staging's 2048-token minimum; memory-plan, reading the
    file as Compose does, finds that every card fits with the default host budget, which is
    at least what it says each card needs (slots and swap counters included) plus a margin."""
    from eotools import memory_plan as mp

    compose = repo_root / f"compose/{name}.yml"
    settings = mp.read_compose(compose)
    chunk = int(settings["flags"]["--max-num-batched-tokens"])
    staging = settings["env"]["VLLM_EXPERT_PREFILL_STAGING"]
    assert staging == ("1" if chunk >= 2048 else "0")
    rc, plan = run_memory_plan(repo_root, "--compose", str(compose), "--json")
    assert rc == 0, plan
    assert plan["serving"]["one_table"] is True
    assert plan["serving"]["prefill_staging"] is (staging == "1")
    budget = float(HOST_BUDGET_GIB[name])
    for card in plan["cards"]:
        assert card["min_host_gib"] + 0.25 <= budget <= card["min_host_gib"] + 0.5
        assert (card["staging"] > 0) is (staging == "1")
        assert 0 < card["swap"] < 1 << 20  # the swap's counters: under 1 MiB
        assert card["vram"] <= card["usable"] - 0.25 * 2**30
    assert any("one table with the runtime swap" in n for n in plan["notes"])


def run_memory_plan(repo_root: pathlib.Path, *args: str) -> tuple[int, dict]:
    model = repo_root / "tests/cpu/data/qwen3.8-flash-next-int4"
    r = subprocess.run(
        [sys.executable, str(repo_root / "scripts/memory-plan"), str(model), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    return r.returncode, json.loads(r.stdout) if r.stdout.startswith("{") else r.stderr


@pytest.mark.parametrize("name", ["2x32GB", "3x24GB", "2x24GB"])
def test_qwen4exp_services_keep_the_ple_table_on_host(repo_root, name):
    svc = service(repo_root / f"compose/{name}.yml")
    env = svc["environment"]
    assert env["VLLM_PLE_TABLE"] == "host"  # 95 GiB: no card holds it
    budget = HOST_BUDGET_GIB[name]
    assert substitute(env["EO_HOST_BUDGET_GIB"], {}) == budget
    assert substitute(env["VLLM_EXPERT_COLD_FILE"], {}) == ""  # a budget-only start
    name_arg = flags(svc["command"])["--served-model-name"]
    assert substitute(name_arg, {}) == "Qwen3.8-Flash-Next-INT4"
    assert substitute(name_arg, {"SERVED_MODEL_NAME": "qwen"}) == "qwen"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_service_has_what_serving_needs(path):
    svc = service(path)
    topo = TOPOLOGIES[path.stem]
    # the image of this topology, which the preflight checks the GPUs against
    assert svc["build"] == {"context": "..", "args": {"TOPOLOGY": topo.name}}
    assert svc["image"] == f"vllm-expert-offload:{topo.name}"
    _, pp, tp = pf.parse_serve_args(svc["command"])
    [gpu] = svc["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert gpu["count"] == pp * tp == topo.gpus == topo.pipeline_parallel_size * tp
    assert svc["ipc"] == "host"
    assert svc["ulimits"] == {"memlock": -1}
    assert svc["restart"].startswith("on-failure")
    assert "VLLM_EXPERT_COLD_FILE" in svc["environment"]  # the offload path is active
    volumes = [substitute(v, {}).split(":") for v in svc["volumes"]]
    mounts = {v[1]: v[0] for v in volumes}
    assert any(v.startswith("${MODEL_DIR:-") for v in svc["volumes"])  # a folder of yours
    assert "/models" in mounts
    assert substitute(svc["ports"][0], {}) == "8000:8000"
    hc = svc["healthcheck"]
    assert hc["test"][0] == "CMD" and "/health" in hc["test"][-1]
    if path.stem != "tiny":
        assert mounts == {
            "/models": "../models",
            "/cold": "../cold",
            "/root/.cache/huggingface": "~/.cache/huggingface",
            "/state": "../state",
        }
        assert any(v.startswith("${HF_CACHE:-") for v in svc["volumes"])
        # without a cold file at that path, the entrypoint makes a budget-only start
        env = svc["environment"]
        assert float(substitute(env["EO_HOST_BUDGET_GIB"], {})) > 0
        assert env["EO_STATE_DIR"] == "/state"
        assert any(v.startswith("${COLD_DIR:-") for v in svc["volumes"])


class Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (the http.server API)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_healthcheck(test: list[str], port: int) -> int:
    argv = [a.replace("localhost:8000", f"127.0.0.1:{port}") for a in test[1:]]
    argv[0] = sys.executable if argv[0] == "python3" else argv[0]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_healthcheck_command_asks_health(path):
    test = service(path)["healthcheck"]["test"]
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        Health.status = 200
        assert run_healthcheck(test, port) == 0
        Health.status = 503  # vLLM's answer while its engine is dead
        assert run_healthcheck(test, port) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert run_healthcheck(test, port) != 0  # nothing listening


def test_tiny_service_makes_its_model_and_cold_file(repo_root, tmp_path):
    svc = service(repo_root / "compose/tiny.yml")
    script = svc["entrypoint"][2]
    cold = svc["environment"]["VLLM_EXPERT_COLD_FILE"]
    model = svc["command"][0]
    prepare = "python3 /opt/expert-offload/scripts/prepare-tiny-model"
    assert f"{prepare} {model} {cold}" in script
    assert 'exec /opt/expert-offload/scripts/entrypoint.sh "$$@"' in script  # $$: compose's $
    assert flags(svc["command"])["--served-model-name"] == "tiny"

    # what that first start does, here on the CPU
    out_model, out_cold = tmp_path / "tiny", tmp_path / "tiny-cold.json"
    cmd = [sys.executable, str(repo_root / "scripts/prepare-tiny-model"), str(out_model)]
    r = subprocess.run([*cmd, str(out_cold)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out_cold.read_text())
    assert doc["model"]["num_layers"] == 4 and doc["model"]["num_experts"] == 512
    assert sorted(map(len, doc["layers"].values())) == [64] * 4
    # the preflight accepts the pair, with the expert size from the checkpoint's headers
    setup = pf.Setup(model=str(out_model), cold_file=str(out_cold))
    [ok] = pf.check_cold_file(setup)[0]
    assert ok.status == "ok", ok
    plan = coldcheck.plan_host_experts(
        coldcheck.load_cold_file(out_cold), coldcheck.read_model_config(str(out_model)), pp=1
    )
    assert plan.experts_per_rank == [256] and plan.bytes_per_expert > 0
    assert plan.source.startswith("the checkpoint")
    # a second start keeps both
    stamp = (out_model / "config.json").stat().st_mtime_ns, out_cold.stat().st_mtime_ns
    r = subprocess.run([*cmd, str(out_cold)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("is there") == 2
    assert stamp == ((out_model / "config.json").stat().st_mtime_ns, out_cold.stat().st_mtime_ns)
