# SPDX-License-Identifier: Apache-2.0
"""The image built and run by a real container engine (podman, or docker with a daemon): on a
stand-in for the upstream base image (scripts/standin-base) where that cannot be pulled, every
topology's image from the Dockerfile (scripts/image-build), then what is inside it, the
preflight's stop without a GPU, a broken patch, and the compose files read and started by
podman-compose.

Without an engine these tests skip, with the reason; CI sets EO_REQUIRE_ENGINE=1 (.ci/run),
which turns that skip into a failure, so an image that was never built cannot pass CI.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOPOLOGIES = ("any", "2x32GB", "3x24GB", "2x24GB", "tiny")
TAG = "vllm-expert-offload-test"
EXIT_GPUS = 3  # eotools/preflight.py: EXIT_CODES["gpus"]
# The image's user (Dockerfile, EO_UID/EO_GID), and an API key for the starts below: the start
# refuses to serve without one (compose/README.md, "The API key").
IMAGE_USER = "2000:2000"
API_KEY = "image-test-key"

pytestmark = pytest.mark.image


@functools.cache
def engine() -> tuple[str, dict[str, str]]:
    """The engine's command and the environment its project settings need (engine.sh)."""
    r = subprocess.run(
        [
            "bash",
            "-c",
            f". {ROOT}/scripts/lib/pin.sh && . {ROOT}/scripts/lib/engine.sh && "
            'if find_engine; then echo "$ENGINE ${CONTAINERS_CONF:-}"; else '
            'echo "$ENGINE_MISSING" >&2; exit 1; fi',
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return "", {"why": r.stderr.strip()}
    name, _, conf = r.stdout.strip().partition(" ")
    env = {"CONTAINERS_CONF": conf} if conf else {"DOCKER_BUILDKIT": "0"}
    return name, env


def require_engine() -> tuple[str, dict[str, str]]:
    name, env = engine()
    if not name:
        why = env["why"]
        if os.environ.get("EO_REQUIRE_ENGINE") == "1":
            pytest.fail(f"EO_REQUIRE_ENGINE=1, but {why}")
        pytest.skip(f"{why}; set EO_REQUIRE_ENGINE=1 to make this a failure (CI does)")
    return name, {**os.environ, **env}


def run(cmd: list[str], env: dict[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def eng() -> tuple[str, dict[str, str]]:
    return require_engine()


def _image_ids(eng, *filters: str) -> set[str]:
    name, env = eng
    r = run([name, "images", "-a", "-q", "--no-trunc", *(f"--filter={f}" for f in filters)], env)
    return set(r.stdout.split())


@pytest.fixture(scope="module", autouse=True)
def leave_no_images(eng):
    """Remove what these tests build once they are done: every image tagged by them (the
    stand-in base stays, the cache of the next run) and the untagged images their builds
    left, but nothing that was there before."""
    name, env = eng
    before = _image_ids(eng)
    had_tiny = run([name, "image", "inspect", "vllm-expert-offload:tiny"], env).returncode == 0
    yield
    tags = [f"{t}:{x}" for t in (TAG, f"{TAG}-digest") for x in TOPOLOGIES]
    if not had_tiny:
        tags.append("vllm-expert-offload:tiny")
    for tag in tags:
        if run([name, "image", "inspect", tag], env).returncode == 0:
            run([name, "rmi", "-f", tag], env)
    left = _image_ids(eng, "dangling=true") - before
    if left:
        run([name, "rmi", "-f", *sorted(left)], env)


@pytest.fixture(scope="module")
def standin(eng) -> str:
    """The stand-in base image (built once per vllm.pin and requirements; reused after)."""
    _, env = eng
    r = run([str(ROOT / "scripts/standin-base")], env)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def images(eng, standin) -> dict[str, str]:
    """Every topology's image, built by scripts/image-build, which also checks each image's
    labels, EO_TOPOLOGY and recorded series digest against what it asked for."""
    _, env = eng
    r = run([str(ROOT / "scripts/image-build"), "--base", standin, "--tag", TAG, *TOPOLOGIES], env)
    assert r.returncode == 0, r.stderr[-6000:]
    names = r.stdout.split()
    assert names == [f"{TAG}:{t}" for t in TOPOLOGIES]
    return dict(zip(TOPOLOGIES, names, strict=True))


def series_digest(patches: pathlib.Path = ROOT / "patches") -> str:
    r = subprocess.run([str(ROOT / "scripts/series-digest"), str(patches)], capture_output=True)
    return r.stdout.decode().strip()


def config(eng, image: str) -> dict:
    name, env = eng
    r = run([name, "image", "inspect", image], env)
    assert r.returncode == 0, r.stderr
    [doc] = json.loads(r.stdout)
    return doc["Config"]


def in_container(
    eng, image: str, *cmd: str, entrypoint: str = "", options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    name, env = eng
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    return run([name, "run", "--rm", *ep, *options, image, *cmd], env, timeout=600)


def test_every_topology_says_what_it_was_built_for(eng, images, standin):
    """Labels and environment of each image match its own build (a layer cache that kept the
    previous topology's ENV and LABEL layers would fail here)."""
    digest = series_digest()
    for topology, image in images.items():
        cfg = config(eng, image)
        labels = cfg["Labels"]
        assert labels["io.vllm-expert-offload.topology"] == topology
        assert labels["io.vllm-expert-offload.series.sha256"] == digest
        assert labels["io.vllm-expert-offload.vllm-image"] == standin
        assert f"EO_TOPOLOGY={topology}" in cfg["Env"], cfg["Env"]
        assert cfg["Entrypoint"] == ["/opt/expert-offload/scripts/entrypoint.sh"]
        assert cfg["User"] == IMAGE_USER  # not root


def test_the_standin_has_the_upstream_layout(eng, standin):
    cfg = config(eng, standin)
    assert cfg["Entrypoint"] == ["vllm", "serve"]
    assert cfg["WorkingDir"] == "/vllm-workspace"
    code = "import sysconfig, vllm; print(vllm.__file__, sysconfig.get_paths()['purelib'])"
    r = in_container(eng, standin, "-c", code, entrypoint="python3")
    assert r.returncode == 0, r.stderr[-3000:]
    where, purelib = r.stdout.split()
    assert purelib.startswith("/usr/local/lib/python3.") and purelib.endswith("/dist-packages")
    assert where == f"{purelib}/vllm/__init__.py"


def test_the_series_is_applied_and_the_patched_vllm_imports(eng, images):
    image = images["any"]
    code = (
        "import pathlib, vllm, vllm.model_executor.layers.fused_moe.expert_offload as eo; "
        "print(vllm.__version__, pathlib.Path(vllm.__file__).parents[1], eo.__name__)"
    )
    r = in_container(eng, image, "-c", code, entrypoint="python3")
    assert r.returncode == 0, r.stderr[-3000:]
    version, site, module = r.stdout.strip().splitlines()[-1].split()  # after vLLM's log
    assert version == "0.29.0" and module.endswith("expert_offload")
    check = in_container(
        eng, image, "--check", site, entrypoint="/opt/expert-offload/scripts/apply-patches.sh"
    )
    n = len(
        [
            line
            for line in (ROOT / "patches/series").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
    )
    said = check.stdout + check.stderr
    assert check.returncode == 0, said
    assert f"already patched: {n} patches of" in said, said


def test_the_image_ships_eotools_and_its_tools_run(eng, images):
    """The image holds eotools and, of the development tools, only the test model's maker;
    each Python tool in it answers --help there (a tool shipped without what it imports
    would fail here)."""
    loop = (
        "cd /opt/expert-offload/scripts && test ! -e eodev/bench && test -d eotools && "
        'for t in *; do head -c 22 "$t" | grep -q python3 || continue; '
        'python3 "$t" --help > /dev/null || { echo "FAILED $t"; exit 1; }; '
        'echo "ran $t"; done'
    )
    r = in_container(eng, images["any"], "-c", loop, entrypoint="bash")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ran = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("ran ")}
    assert ran >= {"preflight", "budget-start", "count-experts", "prepare-tiny-model"}, ran


@pytest.mark.parametrize("topology", ["2x32GB", "tiny"])
def test_without_a_gpu_the_preflight_stops_the_container(eng, images, topology):
    key = ("-e", f"VLLM_API_KEY={API_KEY}")
    args = ("/models/none", "--pipeline-parallel-size", "1")
    r = in_container(eng, images[topology], *args, options=key)
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_GPUS, out[-3000:]
    assert "OK   vllm:" in out and "series applied" in out
    assert "FAIL gpus:" in out and "vLLM is not started" in out


def test_the_server_user_is_not_root_and_writes_only_its_folders(eng, images):
    """The image's user (uid 2000) writes the state folder, its home (vLLM's caches), /tmp
    (the offload metrics' folder) and /models (the tiny service's first start), and not the
    installed vLLM or the series."""
    probe = (
        'id -u; id -g; echo "HOME=$HOME"; '
        'for d in /state /models /tmp "$HOME/.cache"; do '
        'mkdir -p "$d" && touch "$d/probe" && echo "writes $d"; done; '
        "site=$(python3 -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\"); "
        'for d in "$site/vllm" /opt/expert-offload /etc; do '
        'touch "$d/probe" 2>/dev/null && echo "WRITES $d"; done; '
        'grep -q "^vllm:x:2000:2000:" /etc/passwd && echo user-entry'
    )
    r = in_container(eng, images["any"], "-c", probe, entrypoint="bash")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    lines = r.stdout.splitlines()
    assert lines[:3] == ["2000", "2000", "HOME=/home/vllm"], out
    for d in ("/state", "/models", "/tmp", "/home/vllm/.cache"):
        assert f"writes {d}" in lines, out
    assert not [line for line in lines if line.startswith("WRITES")], out
    assert "user-entry" in lines


def test_a_budget_only_start_writes_a_bind_mounted_state_folder(eng, images, tmp_path):
    """A state folder from the host, owned by the image's user as compose/README.md says:
    a budget-only start writes its cold file there (as uid 2000), then the preflight stops
    at the GPU check."""
    state = tmp_path / "state"
    state.mkdir()
    uid, gid = (int(x) for x in IMAGE_USER.split(":"))
    os.chown(state, uid, gid)
    script = (
        "python3 /opt/expert-offload/scripts/prepare-tiny-model /models/tiny "
        "/models/tiny-cold.json > /dev/null && "
        'exec /opt/expert-offload/scripts/entrypoint.sh "$@"'
    )
    options = (
        "-v",
        f"{state}:/state",
        "-e",
        f"VLLM_API_KEY={API_KEY}",
        "-e",
        "EO_HOST_BUDGET_GIB=0.001",
        "-e",
        "EO_STATE_DIR=/state",
    )
    r = in_container(
        eng,
        images["tiny"],
        "-c",
        script,
        "start",
        "/models/tiny",
        entrypoint="bash",
        options=options,
    )
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_GPUS, out[-4000:]
    assert "FAIL gpus:" in out, out[-4000:]
    [cold] = state.glob("cold-*.json")
    assert cold.stat().st_uid == uid, (cold, cold.stat())


def test_the_base_image_can_be_pinned_by_digest(eng, standin, images):
    """VLLM_IMAGE_DIGEST builds on the image of that digest (the tag is then only a name),
    and a digest that names another image fails the build."""
    name, env = eng
    r = run([name, "image", "inspect", "--format", "{{.Digest}}", standin], env)
    digest = r.stdout.strip()
    assert r.returncode == 0 and digest.startswith("sha256:"), r.stdout + r.stderr
    build = [str(ROOT / "scripts/image-build"), "--base", standin, "--tag", f"{TAG}-digest"]
    r = run([*build, "any"], {**env, "VLLM_IMAGE_DIGEST": digest})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"{standin}@{digest}" in out
    labels = config(eng, f"{TAG}-digest:any")["Labels"]
    assert labels["org.opencontainers.image.base.digest"] == digest
    r = run([*build, "any"], {**env, "VLLM_IMAGE_DIGEST": "sha256:" + "0" * 64})
    assert r.returncode == 1, (r.stdout + r.stderr)[-4000:]


def test_a_broken_patch_fails_the_build_naming_it(eng, standin, tmp_path):
    from test_image import break_patch  # the same stale-patch edit as the emulated build's

    context = tmp_path / "context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "vllm.pin"):
        shutil.copy2(ROOT / name, context / name)
    for name in ("patches", "scripts", "cold"):
        shutil.copytree(ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__"))
    names = [
        line
        for line in (context / "patches/series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    broken = names[len(names) // 2]
    break_patch(context / "patches" / broken)
    _, env = eng
    cmd = [str(ROOT / "scripts/image-build"), "--base", standin, "--context", str(context)]
    r = run([*cmd, "--tag", f"{TAG}-broken", "any"], env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert broken in out and "does not apply" in out, out[-4000:]
    assert "building vllm-expert-offload-test-broken:any failed" in out


# --- compose ---------------------------------------------------------------------------------

# the files to start; compose/base.yml is what the topology files extend
COMPOSE_FILES = sorted(p for p in (ROOT / "compose").glob("*.yml") if p.name != "base.yml")
NO_GPU = ROOT / "compose/overrides/no-gpu.yml"
API_KEY_SECRET = ROOT / "compose/overrides/api-key-secret.yml"


def podman_compose(eng) -> list[str]:
    name, _ = eng
    if name != "podman":
        pytest.skip("the compose checks use podman-compose; this engine is docker")
    exe = pathlib.Path(sys.executable).with_name("podman-compose")
    assert exe.exists(), "podman-compose is missing from the test environment (scripts/dev-env)"
    return [str(exe)]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_implementation_reads_the_file(eng, path, tmp_path):
    """podman-compose's `config` (a real Compose implementation: interpolation, merging,
    `extends`, validation of what it knows) accepts every compose file, and the override with
    tiny.yml."""
    _, env = eng
    files = ["-f", str(path)] + (["-f", str(NO_GPU)] if path.name == "tiny.yml" else [])
    r = run([*podman_compose(eng), *files, "config"], env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "services:" in r.stdout
    # with the key from a file: the secret's file mounted at /run/secrets/vllm_api_key
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    secret = ["-f", str(API_KEY_SECRET)]
    r = run(
        [*podman_compose(eng), *files, *secret, "config"], {**env, "API_KEY_FILE": str(key_file)}
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm_api_key" in r.stdout and str(key_file) in r.stdout, r.stdout


def test_tiny_compose_comes_up_to_the_preflight_gpu_stop(eng, images, standin):
    """compose/tiny.yml with the no-GPU override: the image it names (built above), the tiny
    model made at the first start, then the preflight stops the service at its GPU check."""
    name, env = eng
    env = {**env, "VLLM_IMAGE": standin, "PORT": "18731", "VLLM_API_KEY": API_KEY}
    project = ["-p", "eo-tiny-test", "-f", str(ROOT / "compose/tiny.yml"), "-f", str(NO_GPU)]
    # the compose file names vllm-expert-offload:tiny; the fixture's build is tagged as that
    r = run([name, "tag", images["tiny"], "vllm-expert-offload:tiny"], env)
    assert r.returncode == 0, r.stderr
    pc = podman_compose(eng)
    try:
        r = run(
            [*pc, *project, "up", "--abort-on-container-exit", "--exit-code-from", "vllm"],
            env,
            timeout=900,
        )
        out = r.stdout + r.stderr
        assert "FAIL gpus:" in out and "vLLM is not started" in out, out[-5000:]
        assert "OK   cold-file: tiny-cold.json" in out, out[-5000:]
        assert r.returncode == EXIT_GPUS, out[-5000:]
        # what the engine was asked for: the port on this host only, shared memory of its own,
        # an init, no new privileges, the image's user
        label = "label=io.podman.compose.project=eo-tiny-test"
        r = run([name, "ps", "-a", "-q", "--filter", label], env)
        [container] = r.stdout.split()
        r = run([name, "inspect", container], env)
        [doc] = json.loads(r.stdout)
        host = doc["HostConfig"]
        assert host["PortBindings"]["8000/tcp"] == [{"HostIp": "127.0.0.1", "HostPort": "18731"}]
        assert host["ShmSize"] == 2 << 30 and host["IpcMode"] != "host"
        assert host["Init"] is True
        assert any(s.startswith("no-new-privileges") for s in host["SecurityOpt"]), host
        assert doc["Config"]["User"] == IMAGE_USER
    finally:
        run([*pc, *project, "down", "-v"], env, timeout=300)
