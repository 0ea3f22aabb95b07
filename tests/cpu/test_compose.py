# SPDX-License-Identifier: Apache-2.0
"""The compose files: valid against the Compose Specification (the pinned schema of
eodev/schemas.py), the topology files' shared base, the reference serving settings (the 2x32GB
article), what every service needs (GPUs, shared memory, page-locking, health check), and the
tiny service's first-start model. Each service is read as Compose starts it: with the service
it extends merged in (eotools/compose.py)."""

from __future__ import annotations

import copy
import http.server
import json
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest
from eodev import schemas
from eotools import coldcheck
from eotools import compose as cf
from eotools import preflight as pf
from eotools.envsubst import substitute
from eotools.memory_plan.serving import read_compose
from eotools.topologies import TOPOLOGIES

COMPOSE = pathlib.Path(__file__).resolve().parents[2] / "compose"
# what the topology files extend; not a file to start on its own
BASE = COMPOSE / "base.yml"
FILES = sorted(p for p in COMPOSE.glob("*.yml") if p != BASE)
QWEN = ["2x32GB", "3x24GB", "2x24GB"]  # the files that extend BASE

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
    """The file's one service as Compose starts it: `extends` merged in."""
    return cf.load_service(path)


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


@pytest.mark.parametrize("path", [*FILES, BASE], ids=lambda p: p.name)
def test_compose_file_is_valid(path, compose_schema):
    # the file as written, and its service with the base merged in
    assert schemas.validate(schemas.load_yaml(path), compose_schema) == []
    assert schemas.validate(cf.load_document(path), compose_schema) == []


def test_the_schema_catches_mistakes(compose_schema):
    good = cf.load_document(FILES[0])
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
    (tmp_path / "compose/bad.yml").write_text(good.replace("shm_size: 2gb", "shm_size: [2gb]"))
    r = subprocess.run(
        [sys.executable, str(repo_root / "scripts/validate-schemas"), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "compose/good.yml: valid" in r.stdout
    assert "compose/bad.yml: not valid" in r.stderr and "services.vllm.shm_size" in r.stderr


# --- the shared base ---------------------------------------------------------------------

# what a topology file sets itself; the rest of its service is base.yml's
TOPOLOGY_KEYS = {"extends", "build", "image", "command", "environment", "ulimits", "volumes"}
TOPOLOGY_KEYS |= {"deploy"}
TOPOLOGY_ENV = {"EO_HOST_BUDGET_GIB", "VLLM_EXPERT_PREFILL_STAGING"}
# the service each topology starts, base merged in: its keys and its environment's
SERVICE_KEYS = TOPOLOGY_KEYS - {"extends"} | {"ports", "shm_size", "restart", "init"}
SERVICE_KEYS |= {"security_opt", "stop_grace_period", "healthcheck"}
SERVICE_ENV = TOPOLOGY_ENV | {"VLLM_EXPERT_COLD_FILE", "EO_STATE_DIR", "VLLM_PLE_TABLE"}
SERVICE_ENV |= {"VLLM_EXPERT_ONE_TABLE", "VLLM_API_KEY", "EO_ALLOW_NO_API_KEY", "HF_HUB_OFFLINE"}
# where each topology's service differs from 2x32GB's
DIFFERS_FROM_2X32GB = {
    "2x32GB": set(),
    "3x24GB": {"build.args.TOPOLOGY", "image", "command", "environment.EO_HOST_BUDGET_GIB"}
    | {"deploy.resources.reservations.devices"},
    "2x24GB": {"build.args.TOPOLOGY", "image", "command", "environment.EO_HOST_BUDGET_GIB"}
    | {"environment.VLLM_EXPERT_PREFILL_STAGING"},
}


def differences(a, b, where: tuple[str, ...] = ()) -> set[str]:
    """The dotted keys where two services differ (a sequence counts as one value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = a.keys() | b.keys()
        return set().union(*(differences(a.get(k), b.get(k), (*where, str(k))) for k in keys))
    return set() if a == b else {".".join(where)}


@pytest.mark.parametrize("name", QWEN)
def test_each_topology_extends_the_base_and_sets_what_differs(name):
    path = COMPOSE / f"{name}.yml"
    [own] = schemas.load_yaml(path)["services"].values()
    [base] = schemas.load_yaml(BASE)["services"].values()
    assert own["extends"] == {"file": "base.yml", "service": "vllm"}
    assert own.keys() == TOPOLOGY_KEYS and own["environment"].keys() == TOPOLOGY_ENV
    # only the environment is in both files, with keys of its own in each: Compose and
    # podman-compose merge every other key set twice in ways of their own
    assert own.keys() & base.keys() == {"environment"}
    assert not own["environment"].keys() & base["environment"].keys()
    svc = service(path)
    assert svc.keys() == SERVICE_KEYS and svc["environment"].keys() == SERVICE_ENV
    assert svc["healthcheck"] == base["healthcheck"] and svc["ports"] == base["ports"]
    assert svc["deploy"] == own["deploy"] and svc["command"] == own["command"]
    assert differences(service(COMPOSE / "2x32GB.yml"), svc) == DIFFERS_FROM_2X32GB[name]


def test_the_reader_merges_an_extended_service_as_compose_does(tmp_path):
    base = tmp_path / "base.yml"
    base.write_text(
        "services:\n  s:\n    command: [a, b]\n    environment: {A: '1', B: '2'}\n"
        "    healthcheck: {test: [CMD, x], interval: 30s}\n    ports: ['1:1']\n"
        "    restart: always\n"
    )
    top = tmp_path / "top.yml"
    top.write_text(
        "services:\n  t:\n    extends: {file: base.yml, service: s}\n    command: [c]\n"
        "    environment: {B: '3', C: '4'}\n    healthcheck: {test: [CMD, y]}\n"
        "    restart: 'no'\n    image: i\n"
    )
    assert cf.load_service(top) == {
        "command": ["c"],
        "environment": {"A": "1", "B": "3", "C": "4"},
        "healthcheck": {"test": ["CMD", "y"], "interval": "30s"},
        "ports": ["1:1"],
        "restart": "no",
        "image": "i",
    }
    assert cf.read_service(top, {}).environment == {"A": "1", "B": "3", "C": "4"}
    # what Compose implementations merge each their own way, or refuse
    refused = {
        "ports: ['2:2']": "services.t.ports is set both here and in the service it extends",
        "environment: [B=3]": "services.t.environment is set both here",
    }
    for line, message in refused.items():
        top.write_text(
            f"services:\n  t:\n    extends: {{file: base.yml, service: s}}\n    {line}\n"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            cf.load_service(top)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/base.yml").write_text(base.read_text())
    top.write_text("services:\n  t:\n    extends: {file: sub/base.yml, service: s}\n")
    with pytest.raises(ValueError, match="not in the same folder"):
        cf.load_service(top)
    base.write_text("services:\n  s:\n    depends_on: [db]\n  db:\n    image: d\n")
    top.write_text("services:\n  t:\n    extends: {file: base.yml, service: s}\n")
    with pytest.raises(ValueError, match="depends_on: a service with them cannot be extended"):
        cf.load_service(top)
    base.write_text("services:\n  s:\n    extends: {file: top.yml, service: t}\n")
    with pytest.raises(ValueError, match="extends itself"):
        cf.load_service(top)


def podman_compose_dry_run(repo_root, tmp_path, files: list[str], command: list[str]) -> str:
    """What podman-compose (the CI's Compose implementation) would run, from its dry run: a
    stand-in podman answers its queries, nothing is created."""
    exe = pathlib.Path(sys.executable).with_name("podman-compose")
    assert exe.exists(), "podman-compose is missing from the test environment (scripts/dev-env)"
    podman = tmp_path / "podman"
    podman.write_text("#!/bin/sh\necho '[]'\n")
    podman.chmod(0o755)
    key = tmp_path / "api-key"
    key.write_text("k\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "API_KEY_FILE": str(key)}
    argv = [str(exe), "--podman-path", str(podman), "--verbose", "--dry-run"]
    argv += [a for f in files for a in ("-f", f)] + command
    r = subprocess.run(argv, cwd=repo_root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.parametrize("no_gpu", [False, True], ids=["alone", "no-gpu+secret"])
@pytest.mark.parametrize("name", QWEN)
def test_podman_compose_starts_what_the_reader_reads(repo_root, tmp_path, name, no_gpu):
    """podman-compose 1.6 resolves `extends` itself, with merge rules and relative paths of its
    own: from the repository's root, as compose/README.md runs it, the container it would create
    has the service this reader reads (the base merged in), with the overrides applied."""
    files = [f"compose/{name}.yml"]
    if no_gpu:
        files += ["compose/overrides/no-gpu.yml", "compose/overrides/api-key-secret.yml"]
    svc = service(COMPOSE / f"{name}.yml")
    out = podman_compose_dry_run(repo_root, tmp_path, files, ["up", "--no-build", "-d"])
    [create] = [line for line in out.splitlines() if "/podman create --name=" in line]
    env = {f"{k}={substitute(v, {})}" for k, v in svc["environment"].items()}
    assert set(re.findall(r" -e (\S*)", create)) == env
    mounts = [substitute(v, {}).split(":") for v in svc["volumes"]]
    expected = [":".join([str((COMPOSE / s).resolve()), *rest]) for s, *rest in mounts]
    assert re.findall(r" -v (\S+)", create) == expected
    assert " -p 127.0.0.1:8000:8000 --shm-size 2gb " in create and " --init " in create
    assert " --health-start-period 30m " in create
    assert "/health" in create and "no-new-privileges:true" in create
    command = [substitute(a, {}) for a in svc["command"]]
    assert create.endswith(" ".join([svc["image"], *command]))
    # the override resets what a machine without a GPU cannot do, the base's keys included
    assert (" --ulimit memlock=-1 " in create) is not no_gpu
    assert (" --health-startup-interval 15s " in create) is not no_gpu
    assert (" --device nvidia.com/gpu=" in create) is not no_gpu
    assert (" --restart no " if no_gpu else " --restart on-failure:3 ") in create
    assert (":/run/secrets/vllm_api_key:ro" in create) is no_gpu
    out = podman_compose_dry_run(repo_root, tmp_path, files, ["build"])
    [build] = [line for line in out.splitlines() if "/podman build -f " in line]
    args = " ".join(f"--build-arg {k}={substitute(v, {})}" for k, v in svc["build"]["args"].items())
    assert f" build -f {repo_root}/Dockerfile -t {svc['image']} {args}" in build
    assert build.endswith(f" {repo_root}")  # the context: the repository, as `..` in compose/


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


@pytest.mark.parametrize("name", QWEN)
def test_the_default_path_fits_each_card_and_staging_only_where_chunks_reach_it(repo_root, name):
    """The defaults start one table with the runtime swap, and prefill staging only where the
    compose file's prefill chunk reaches staging's 2048-token minimum; memory-plan, reading the
    file as Compose does, finds that every card fits with the default host budget, which is
    at least what it says each card needs (slots and swap counters included) plus a margin."""
    compose = repo_root / f"compose/{name}.yml"
    settings = read_compose(compose)
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


@pytest.mark.parametrize("name", QWEN)
def test_qwen4exp_services_keep_the_ple_table_off_the_gpu(repo_root, name):
    svc = service(repo_root / f"compose/{name}.yml")
    env = svc["environment"]
    # 95 GiB: no card holds it; auto pins it where the host has room, else reads the files
    assert substitute(env["VLLM_PLE_TABLE"], {}) == "auto"
    assert substitute(env["VLLM_PLE_TABLE"], {"PLE_TABLE": "host"}) == "host"
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
    # the image of this topology, which the preflight checks the GPUs against, on the base
    # image of a digest when one is given (empty: vllm.pin's tag)
    digest = "${VLLM_IMAGE_DIGEST:-}"
    assert svc["build"] == {
        "context": "..",
        "args": {"TOPOLOGY": topo.name, "VLLM_IMAGE_DIGEST": digest},
    }
    assert svc["image"] == f"vllm-expert-offload:{topo.name}"
    _, pp, tp = pf.parse_serve_args(svc["command"])
    [gpu] = svc["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert gpu["count"] == pp * tp == topo.gpus == topo.pipeline_parallel_size * tp
    assert svc["ulimits"] == {"memlock": -1}
    assert svc["restart"].startswith("on-failure")
    assert "VLLM_EXPERT_COLD_FILE" in svc["environment"]  # the offload path is active
    volumes = [substitute(v, {}).split(":") for v in svc["volumes"]]
    mounts = {v[1]: v[0] for v in volumes}
    assert any(v.startswith("${MODEL_DIR:-") for v in svc["volumes"])  # a folder of yours
    assert "/models" in mounts
    assert substitute(svc["ports"][0], {}) == "127.0.0.1:8000:8000"
    hc = svc["healthcheck"]
    assert hc["test"][0] == "CMD" and "/health" in hc["test"][-1]
    if path.stem != "tiny":
        assert mounts == {"/models": "../models", "/cold": "../cold", "/state": "../state"}
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


# --- closed by default ----------------------------------------------------------------------

MIB = 1 << 20
# vLLM 0.29.0's shared-memory rings, which it sizes up front and checks against /dev/shm at
# start (distributed/device_communicators/shm_broadcast.py, v1/executor/multiproc_executor.py):
# the scheduler's broadcast to the workers (10 chunks of VLLM_MQ_MAX_CHUNK_BYTES_MB, 16 MiB)
# and one ring per worker for its outputs (10 x 24 MiB)
SHM_BROADCAST = 10 * 16 * MIB
SHM_PER_WORKER = 10 * 24 * MIB
# how long vLLM's own shutdown may take before it kills what is left: the engine process
# (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s), the workers (5 s), then 4 s after its SIGTERM
VLLM_SHUTDOWN_S = 5 + 5 + 4
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def size_bytes(value: str | int) -> int:
    """A Compose byte value (2gb, 512m, 1073741824) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([bkmg]?)i?b?", str(value).strip().lower())
    assert m, f"not a byte value: {value!r}"
    return int(m.group(1)) * _UNITS[m.group(2)]


def duration_s(value: str) -> float:
    """A Compose duration (60s, 1m30s, 2m) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def mounts_of(svc: dict) -> dict[str, tuple[str, str]]:
    """Each mount's target: (its source at the defaults, "ro" or "rw")."""
    out = {}
    for v in svc["volumes"]:
        source, target, *mode = substitute(v, {}).split(":")
        out[target] = (source, "ro" if mode == ["ro"] else "rw")
    return out


def test_the_helpers_read_compose_values():
    assert size_bytes("2gb") == size_bytes("2g") == 2 << 30 and size_bytes(512) == 512
    assert duration_s("60s") == 60 and duration_s("1m30s") == 90
    with pytest.raises(AssertionError):
        duration_s("60")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_service_is_closed_by_default(path):
    svc = service(path)
    env = svc["environment"]
    # the API on this host only, unless BIND_ADDRESS says otherwise
    [port] = svc["ports"]
    assert substitute(port, {}) == "127.0.0.1:8000:8000"
    assert substitute(port, {"BIND_ADDRESS": "0.0.0.0", "PORT": "9000"}) == "0.0.0.0:9000:8000"
    # the key from this shell or an env file (or the secret's file, the start's default path);
    # starting without one is an opt-in, off by default
    assert substitute(env["VLLM_API_KEY"], {}) == ""
    assert substitute(env["VLLM_API_KEY"], {"VLLM_API_KEY": "k"}) == "k"
    assert substitute(env["EO_ALLOW_NO_API_KEY"], {}) == "0"
    assert substitute(env["EO_ALLOW_NO_API_KEY"], {"EO_ALLOW_NO_API_KEY": "1"}) == "1"
    assert "VLLM_API_KEY_FILE" not in env  # the default, /run/secrets/vllm_api_key
    assert not [a for a in svc["command"] if a.startswith("--api-key")]  # ps would show it
    # shared memory of its own, room for vLLM's rings twice over, not the host's IPC namespace
    assert "ipc" not in svc
    _, pp, tp = pf.parse_serve_args(svc["command"])
    assert size_bytes(svc["shm_size"]) >= 2 * (SHM_BROADCAST + pp * tp * SHM_PER_WORKER)
    assert svc["init"] is True
    assert svc["security_opt"] == ["no-new-privileges:true"]
    # the image's non-root user, no extra rights
    assert not {"user", "privileged", "cap_add", "pid", "network_mode"} & svc.keys()
    # time for vLLM's shutdown, in which the workers write their usage counts, twice over
    assert duration_s(svc["stop_grace_period"]) >= 2 * VLLM_SHUTDOWN_S
    # no Hugging Face cache (nor its token): the model is a local folder, read offline
    assert env["HF_HUB_OFFLINE"] == "1"
    assert not {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HOME"} & env.keys()
    mounts = mounts_of(svc)
    assert not [t for t, (s, _) in mounts.items() if "huggingface" in s + t or ".cache" in s + t]
    writable = {t for t, (_, mode) in mounts.items() if mode == "rw"}
    # what the start writes: the tiny model made at its first start, or a budget-only start's
    # state; everything else read-only
    assert writable == ({"/models"} if path.stem == "tiny" else {"/state"})


def test_the_secret_override_mounts_the_key_file_where_the_start_reads_it(compose_schema):
    path = FILES[0].parent / "overrides/api-key-secret.yml"
    doc = schemas.load_yaml(path)
    assert schemas.validate(doc, compose_schema) == []
    # the short syntax: /run/secrets/<name>, the start's default VLLM_API_KEY_FILE
    assert doc["services"]["vllm"]["secrets"] == ["vllm_api_key"]
    source = doc["secrets"]["vllm_api_key"]["file"]
    assert source.startswith("${API_KEY_FILE:?") and source.endswith("}")  # no default path
    assert "environment" not in doc["services"]["vllm"]


class _Uvicorn:
    """An ASGI app served by uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


# routes upstream's key check left open (it guarded /v1, /v2, /inference, /cohere only)
GUARDED = ("/v1/models", "/invocations", "/pooling", "/score", "/tokenize", "/metrics", "/version")


def test_the_healthcheck_passes_with_a_key_set_and_the_api_needs_it():
    """vLLM's key check (the middleware `vllm serve` adds when a key is set; patch 0021 makes
    it guard every route but the health probes) leaves /health and /ping open: every compose
    file's healthcheck command passes against it without the key, while /v1, /invocations
    (SageMaker's chat and completions), /tokenize and /metrics refuse a request without it."""
    import urllib.error
    import urllib.request

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    app = Starlette(
        routes=[
            Route("/health", lambda request: Response(status_code=200)),
            Route("/ping", lambda request: Response(status_code=200)),
            *(
                Route(path, lambda request: JSONResponse({"data": []}), methods=["GET", "POST"])
                for path in GUARDED
            ),
        ]
    )
    app.add_middleware(AuthenticationMiddleware, tokens=["the-key"])
    with _Uvicorn(app) as srv:
        for path in FILES:
            assert run_healthcheck(service(path)["healthcheck"]["test"], srv.port) == 0, path
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/ping", timeout=10) as r:
            assert r.status == 200
        for path in GUARDED:
            url = f"http://127.0.0.1:{srv.port}{path}"
            for key in (None, "Bearer another-key"):
                headers = {"Authorization": key} if key else {}
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
                assert refused.value.code == 401, path
            keyed = urllib.request.Request(url, headers={"Authorization": "Bearer the-key"})
            with urllib.request.urlopen(keyed, timeout=10) as r:
                assert r.status == 200, path


def test_a_file_that_is_not_a_compose_file_is_a_message_not_a_traceback(tmp_path, repo_root):
    for text, problem in {
        "a: [unclosed\n": "not a YAML compose file (ParserError at line 2)",
        "- a list\n": "its top level is not a mapping",
    }.items():
        bad = tmp_path / "bad.yml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(problem)):
            cf.read_service(bad, {})
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "scripts/memory-plan"),
            str(repo_root / "tests/cpu/data/qwen3.8-flash-next-int4"),
            "--compose",
            str(repo_root / "compose/README.md"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "compose/README.md: not a YAML compose file (ScannerError at line" in r.stderr
