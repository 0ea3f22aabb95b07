# SPDX-License-Identifier: Apache-2.0
"""The image without a Docker engine: the Dockerfile's patch step, run from the Dockerfile's own
text against the pinned vLLM wheel extracted as an installed package, with a good and a broken
series; the entrypoint; the layout the Dockerfile relies on.

The emulated image: the Dockerfile's COPY instructions copy into a scratch root (absolute image
paths re-rooted there), `python3` is a fresh virtual environment whose site-packages holds the
extracted wheel (the rest of vLLM's dependencies come from this test environment), and the
step runs with the Dockerfile's SHELL and ENV.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from eodev import dockerfile
from eodev.cache import cache_dir
from eotools import settings
from eotools.pin import PIN
from eotools.preflight import Setup, check_vllm

PATCH_STEP = "apply-patches.sh"  # what identifies the patch step among the RUN instructions
BINARY = {".so"}


def pinned_wheel(repo_root: pathlib.Path) -> pathlib.Path:
    """The pinned vLLM wheel, from the cache (downloaded and sha256-checked by pin.sh)."""
    r = subprocess.run(
        ["bash", "-c", f". {repo_root}/scripts/lib/pin.sh && fetch_pinned_wheel"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return pathlib.Path(r.stdout.strip())


@pytest.fixture(scope="session")
def pristine_site(repo_root) -> pathlib.Path:
    """The wheel extracted once into the cache, as pip would install it (never modified)."""
    target = cache_dir() / "extracted" / PIN.vllm_wheel.removesuffix(".whl")
    stamp = target / ".complete"
    if stamp.exists() and stamp.read_text().strip() == PIN.vllm_wheel_sha256:
        return target
    shutil.rmtree(target, ignore_errors=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(pinned_wheel(repo_root)) as z:
        z.extractall(partial)
    (partial / ".complete").write_text(PIN.vllm_wheel_sha256 + "\n")
    try:
        partial.rename(target)
    except OSError:  # another test process got there first
        shutil.rmtree(partial, ignore_errors=True)
    return target


def install_copy(pristine: pathlib.Path, site: pathlib.Path) -> None:
    """Copy the extracted package into `site`; compiled objects are hard links (nothing
    patches them), everything else real copies, so the cached tree stays pristine."""
    for src in pristine.rglob("*"):
        rel = src.relative_to(pristine)
        dst = site / rel
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif rel.name != ".complete":
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.suffix in BINARY or rel.as_posix() == "vllm/vllm-rs":
                try:
                    os.link(src, dst)
                    continue
                except OSError:
                    pass
            shutil.copy2(src, dst)


class EmulatedImage:
    """The image's filesystem under `root`, a `python3` with vLLM installed, and the step."""

    def __init__(self, repo_root: pathlib.Path, tmp: pathlib.Path, pristine: pathlib.Path):
        self.repo = repo_root
        self.root = tmp / "root"
        self.instructions = dockerfile.parse((repo_root / "Dockerfile").read_text())
        self.step_index = dockerfile.find_run(self.instructions, PATCH_STEP)
        self.stage = dockerfile.stage_before(self.instructions, self.step_index)
        venv = tmp / "python"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        self.bin = venv / "bin"
        self.site = pathlib.Path(
            subprocess.run(
                [
                    str(self.bin / "python3"),
                    "-c",
                    "import sysconfig as s; print(s.get_paths()['purelib'])",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        install_copy(pristine, self.site)
        # vLLM's dependencies (torch, transformers, ...) from this test environment, after it
        ours = sysconfig.get_paths()["purelib"]
        (self.site / "zz-test-deps.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
        for c in self.stage.copies:
            self._copy(c)

    def path(self, image_path: str) -> pathlib.Path:
        return self.root / image_path.lstrip("/")

    def _copy(self, c: dockerfile.Copy) -> None:
        """COPY from the build context: only the files .dockerignore lets through."""
        dest = self.path(c.dest)
        context = dockerfile.context_files(self.repo)
        for s in c.sources:
            src = self.repo / s
            if src.is_dir():
                prefix = s.rstrip("/") + "/"
                for rel in (f for f in context if f.startswith(prefix)):
                    target = dest / rel.removeprefix(prefix)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(self.repo / rel, target)
            else:
                assert s in context, f"{s} is not in the build context (.dockerignore)"
                target = dest / src.name if c.dest.endswith("/") else dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)

    def env(self, stage: dockerfile.Stage | None = None) -> dict[str, str]:
        stage = stage or self.stage
        env = dict(os.environ)
        for k, v in {**stage.args, **stage.env}.items():
            env[k] = str(self.path(v)) if v.startswith("/") else v
        env["HOME"] = str(self.path("/root"))
        self.path("/root").mkdir(parents=True, exist_ok=True)
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env.pop("PYTHONPATH", None)
        return env

    def run_step(self, needle: str = PATCH_STEP, **env: str) -> subprocess.CompletedProcess:
        """Run the RUN instruction containing `needle` (default: the patch step) as Docker
        would in this stage; `env` sets build arguments."""
        index = dockerfile.find_run(self.instructions, needle)
        stage = dockerfile.stage_before(self.instructions, index)
        return subprocess.run(
            [*stage.shell, self.instructions[index].value],
            cwd=self.root,
            env=self.env(stage) | env,
            capture_output=True,
            text=True,
            timeout=600,
        )


def digest(tree: pathlib.Path) -> str:
    """A hash of every Python file under tree/vllm (names and bytes)."""
    h = hashlib.sha256()
    for p in sorted((tree / "vllm").rglob("*.py")):
        h.update(p.relative_to(tree).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def image(repo_root, tmp_path, pristine_site) -> EmulatedImage:
    return EmulatedImage(repo_root, tmp_path, pristine_site)


def test_the_patch_step_applies_the_series_and_imports(image, pristine_site, repo_root):
    before = digest(pristine_site)
    r = image.run_step()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    series = [
        line
        for line in (repo_root / "patches/series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert f"applied {len(series)} patches" in out
    assert (
        f"vLLM {PIN.vllm_version} with vllm.model_executor.layers.fused_moe.expert_offload" in out
    )
    # the step patched the emulated image's vLLM, not the one this test runs on or the cache
    assert (image.site / "vllm/model_executor/layers/fused_moe/expert_offload").is_dir()
    found = subprocess.run(
        [str(image.bin / "python3"), "-c", "import vllm; print(vllm.__file__)"],
        env=image.env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert found == str(image.site / "vllm/__init__.py")
    assert digest(pristine_site) == before
    assert not list((image.site / "vllm").rglob("__pycache__")), "the step wrote bytecode"
    # the preflight's vllm check agrees: pinned release, series applied
    apply = image.path("/opt/expert-offload/scripts/apply-patches.sh")
    [ok] = check_vllm(Setup(site=image.site, apply_patches=apply))
    assert ok.status == "ok" and "series applied" in ok.message


def break_patch(patch: pathlib.Path) -> None:
    """Change one context line of the patch, as a stale patch would have it; a patch that only
    creates files (no context) gets a first hunk that expects a line upstream does not have."""
    lines = patch.read_text().splitlines(keepends=True)
    hunks = [i for i, line in enumerate(lines) if line.startswith("@@ ")]
    for i in range(hunks[0] + 1, len(lines)):
        if lines[i].startswith(" "):
            lines[i] = " # a line that upstream does not have\n"
            break
    else:
        new = lines[hunks[0]].split()[2]  # "+1,558"
        lines[hunks[0]] = f"@@ -1,1 {new[0]}1,{int(new.split(',')[1]) + 1} @@\n"
        lines.insert(hunks[0] + 1, " # a line that upstream does not have\n")
    patch.write_text("".join(lines))


@pytest.mark.parametrize("which", [0, -1])
def test_a_broken_patch_fails_the_step_naming_it(image, which):
    series_dir = image.path("/opt/expert-offload/patches")
    names = [
        line
        for line in (series_dir / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    broken = names[which]
    break_patch(series_dir / broken)
    before = digest(image.site)
    r = image.run_step()
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert broken in out
    assert "does not apply" in out
    assert "nothing was changed" in out
    assert digest(image.site) == before  # all or nothing: no file of the package changed
    assert "with vllm.model_executor" not in out  # the step stopped before the import check


def test_the_pristine_vllm_is_reported_unpatched(image):
    apply = image.path("/opt/expert-offload/scripts/apply-patches.sh")
    [r] = check_vllm(Setup(site=image.site, apply_patches=apply))
    assert r.status == "fail" and "not applied" in r.message
    assert "apply-patches.sh" in r.fix


def test_the_series_digest_is_recorded_and_checked(image, repo_root):
    r = image.run_step("series-digest")
    assert r.returncode == 0, r.stderr
    recorded = image.path("/opt/expert-offload/series.sha256").read_text().strip()
    digest_cmd = [str(repo_root / "scripts/series-digest")]
    assert recorded == subprocess.run(digest_cmd, capture_output=True, text=True).stdout.strip()
    assert image.run_step("series-digest", SERIES_SHA256=recorded).returncode == 0
    r = image.run_step("series-digest", SERIES_SHA256="0" * 64)
    assert r.returncode == 1 and f"patches/ has digest {recorded}" in r.stderr
    # any change to a patch changes the digest
    break_patch(min(image.path("/opt/expert-offload/patches").glob("*.patch")))
    r = image.run_step("series-digest", SERIES_SHA256=recorded)
    assert r.returncode == 1


def test_dockerfile_layout(repo_root):
    ins = dockerfile.parse((repo_root / "Dockerfile").read_text())
    kinds = [i.keyword for i in ins]
    # the entrypoint is the wrapper, in exec form, and it exists in the image's copy
    [entry] = [i for i in ins if i.keyword == "ENTRYPOINT"]
    [path] = dockerfile.exec_form(entry.value)
    stage = dockerfile.stage_before(ins, len(ins))
    home = stage.env["EO_HOME"]
    assert path.startswith(home + "/")
    wrapper = repo_root / path.removeprefix(home + "/")
    assert wrapper.is_file() and wrapper.stat().st_mode & stat.S_IXUSR
    # every COPY source exists and .dockerignore lets it (or files under it) through; no
    # bytecode or development tool reaches the build context
    context = dockerfile.context_files(repo_root)
    for c in stage.copies:
        for s in c.sources:
            assert (repo_root / s).exists(), s
            assert any(f == s or f.startswith(s.rstrip("/") + "/") for f in context), s
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]
    assert not [f for f in context if f.startswith(("scripts/eodev/bench", "tests/", "bench/"))]
    # OCI labels and the custom ones
    labels = " ".join(i.value for i in ins if i.keyword == "LABEL")
    for key in (
        "org.opencontainers.image.source",
        "org.opencontainers.image.version",
        "org.opencontainers.image.title",
        "org.opencontainers.image.licenses",
        "io.vllm-expert-offload.vllm-image",
        "io.vllm-expert-offload.series.sha256",
        "io.vllm-expert-offload.topology",
    ):
        assert f"{key}=" in labels, key
    assert kinds.count("FROM") == 1 and "CMD" not in kinds  # vllm serve's arguments: the user's
    # no parser directive that makes BuildKit pull a frontend (Docker Hub may be out of reach)
    text = (repo_root / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)


def fake_vllm(
    bin_dir: pathlib.Path, env_vars: tuple[str, ...] = (), body: str | None = None
) -> pathlib.Path:
    """A `vllm` that records its arguments (after the values of `env_vars`) instead of
    serving, then runs `body` (bash) if given."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "vllm.args"
    exe = bin_dir / "vllm"
    shown = "".join(f' "${v}"' for v in env_vars)
    exe.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n"{shown} "$@" > {log}\n{body or ""}')
    exe.chmod(0o755)
    return log


def run_entrypoint(
    repo_root, tmp_path, args, env_vars=(), vllm_body=None, **env_extra
) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    log = fake_vllm(tmp_path / "bin", env_vars, vllm_body)
    python = pathlib.Path(sys.executable).parent
    env = {
        # none of the settings of this shell: the start program reads them all
        **{k: v for k, v in os.environ.items() if k not in settings.BY_NAME},
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{python}{os.pathsep}/usr/bin:/bin",
        "EO_HOME": str(repo_root),
        "VLLM_API_KEY": "test-key",
        **env_extra,
    }
    r = subprocess.run(
        [str(repo_root / "scripts/entrypoint.sh"), *args], env=env, capture_output=True, text=True
    )
    return r, log


def test_entrypoint_runs_vllm_serve_with_the_arguments(repo_root, tmp_path):
    args = ["/models/m", "--pipeline-parallel-size", "2", "--served-model-name", "a b"]
    r, log = run_entrypoint(repo_root, tmp_path, args, EO_SKIP_PREFLIGHT="1")
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == ["serve", *args]


def test_entrypoint_stops_when_the_preflight_fails(repo_root, tmp_path):
    # no GPU here: the preflight's gpus check fails (exit 3) and vLLM must not start
    r, log = run_entrypoint(
        repo_root,
        tmp_path,
        ["/models/m", "-pp", "2"],
        EO_PREFLIGHT_SKIP="vllm",
        CUDA_VISIBLE_DEVICES="",  # no GPU, even on a GPU host
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "FAIL gpus: 2 GPU(s) needed" in r.stdout
    assert not log.exists()


@pytest.mark.parametrize("cold_file", [None, ""], ids=["unset", "empty"])
def test_entrypoint_makes_a_budget_only_start_when_no_cold_file_is_set(
    repo_root, tmp_path, tiny_model, cold_file
):
    state = tmp_path / "state"
    r, log = run_entrypoint(
        repo_root,
        tmp_path,
        [str(tiny_model), "--max-model-len", "4096"],
        ("VLLM_EXPERT_COLD_FILE", "VLLM_EXPERT_COUNT_FILE"),
        EO_SKIP_PREFLIGHT="1",
        EO_HOST_BUDGET_GIB="0.001",
        EO_STATE_DIR=str(state),
        **({} if cold_file is None else {"VLLM_EXPERT_COLD_FILE": cold_file}),
    )
    assert r.returncode == 0, r.stderr
    cold, counts, *args = log.read_text().splitlines()
    assert cold == str(state / "cold-0.001GiB.json") and pathlib.Path(cold).is_file()
    # this run's counts: run/<run id>/counts.json (eotools/usage_state.py)
    assert pathlib.Path(counts).parent.parent == state / "run", counts
    assert pathlib.Path(counts).name == "counts.json"
    assert args == ["serve", str(tiny_model), "--max-model-len", "4096"]
    assert "initial placement" in r.stderr


@pytest.mark.parametrize(
    "cold_file, says",
    [
        ("/cold/3GiB-per-card.jsn", "no such file in the container"),
        ("/home/me/cold/3GiB-per-card.json", "looks like a path on the host"),
        ("/", "a directory, not a cold file"),
    ],
)
def test_entrypoint_stops_when_the_cold_file_asked_for_is_not_there(
    repo_root, tmp_path, tiny_model, cold_file, says
):
    """A mistyped COLD_FILE or a host path is a mistake to fix, not a budget-only start the
    user did not ask for: the container stops with the cold-file code before anything runs."""
    state = tmp_path / "state"
    r, log = run_entrypoint(
        repo_root,
        tmp_path,
        [str(tiny_model)],
        VLLM_EXPERT_COLD_FILE=cold_file,
        EO_HOST_BUDGET_GIB="0.001",
        EO_STATE_DIR=str(state),
        EO_SKIP_PREFLIGHT="1",
    )
    assert r.returncode == 6, r.stdout + r.stderr
    assert says in r.stderr and "COLD_DIR" in r.stderr and "leave COLD_FILE unset" in r.stderr
    assert not log.exists() and not state.exists()


def test_entrypoint_help_prints_usage_without_the_preflight(repo_root, tmp_path):
    r, log = run_entrypoint(repo_root, tmp_path, ["--help"], CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "VLLM_EXPERT_COLD_FILE" in r.stdout and "preflight:" not in r.stdout
    assert log.read_text().splitlines() == ["serve", "--help"]  # then vllm serve's own help


def test_entrypoint_help_without_a_platform_for_vllm_says_so(repo_root, tmp_path):
    """Where `vllm serve --help` itself fails (a CPU-only test environment: vLLM finds no
    platform), the entrypoint's help still exits 0, with a line instead of vLLM's traceback."""
    failing = (
        'echo "Traceback (most recent call last):"\n'
        'echo "RuntimeError: Failed to infer device type" >&2\nexit 1\n'
    )
    r, _ = run_entrypoint(repo_root, tmp_path, ["--help"], vllm_body=failing)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "VLLM_EXPERT_COLD_FILE" in r.stdout and "no platform it can serve on" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_the_image_runs_as_a_fixed_non_root_user(repo_root):
    """Every build step runs as root, the server as the image's own user: fixed ids (build
    arguments EO_UID/EO_GID, 2000 by default, which compose/README.md tells operators to give
    a bind-mounted state folder), a home for vLLM's caches, and /state and /models made its
    own. tests/cpu/test_image_engine.py checks what it can write in a built image."""
    ins = dockerfile.parse((repo_root / "Dockerfile").read_text())
    stage = dockerfile.stage_before(ins, len(ins))
    users = [i for i, x in enumerate(ins) if x.keyword == "USER"]
    assert users, "no USER instruction: the server would run as root"
    last_run = max(i for i, x in enumerate(ins) if x.keyword == "RUN")
    assert users[-1] > last_run  # the build's steps as root, then the user
    uid, gid = ins[users[-1]].value.split(":")
    assert (uid, gid) == ("${EO_UID}", "${EO_GID}")
    assert stage.args["EO_UID"] == stage.args["EO_GID"] == "2000"
    make = ins[dockerfile.find_run(ins, "useradd")].value
    assert 'groupadd --gid "$EO_GID" vllm' in make
    assert '--uid "$EO_UID" --gid "$EO_GID" --home-dir /home/vllm --create-home' in make
    assert re.search(r'install -d -o "\$EO_UID" -g "\$EO_GID" -m 07[57]0 /state /models$', make)
    assert stage.env["HOME"] == "/home/vllm"
    readme = (repo_root / "compose/README.md").read_text()
    assert "chown 2000:2000" in readme and "EO_UID" in readme


def test_the_base_image_is_pinned_by_digest_when_one_is_given(repo_root):
    """VLLM_IMAGE_DIGEST (empty by default) makes the base NAME:TAG@DIGEST, which Docker and
    podman resolve by the digest; unset, vllm.pin's tag. The digest is recorded in a label.
    tests/cpu/test_image_engine.py builds with one."""
    ins = dockerfile.parse((repo_root / "Dockerfile").read_text())
    [start] = [i for i, x in enumerate(ins) if x.keyword == "FROM"]
    assert ins[start].value == "${VLLM_IMAGE}${VLLM_IMAGE_DIGEST:+@${VLLM_IMAGE_DIGEST}}"
    before = dict(x.value.split("=", 1) for x in ins[:start] if x.keyword == "ARG")
    assert before == {"VLLM_IMAGE": PIN.vllm_image, "VLLM_IMAGE_DIGEST": ""}
    labels = " ".join(x.value for x in ins if x.keyword == "LABEL")
    assert 'org.opencontainers.image.base.digest="${VLLM_IMAGE_DIGEST}"' in labels
    stage = dockerfile.stage_before(ins, len(ins))
    assert "VLLM_IMAGE_DIGEST" in stage.args  # declared again in the stage, for the label
