# SPDX-License-Identifier: Apache-2.0
"""The patch-series tooling: scripts/vllm-tree, scripts/export-patches, scripts/apply-patches.sh.

The scripts run for real, as subprocesses: vllm-tree builds the pinned vLLM tree once per
test run from the cached wheel, a small three-patch series is committed on top of a copy of it
and exported, and that series is applied to copies of the tree, as a git checkout and as a
site-packages directory, in every state the tools must recognise.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_TREE = ROOT / "scripts" / "vllm-tree"
EXPORT = ROOT / "scripts" / "export-patches"
APPLY = ROOT / "scripts" / "apply-patches.sh"
PIN = dict(
    line.split("=", 1)
    for line in (ROOT / "vllm.pin").read_text().splitlines()
    if line.startswith("PIN_")
)
VERSION = PIN["PIN_VLLM_VERSION"]
TAG = f"upstream-v{VERSION}"

# Git behaves the same for everyone: no user or system configuration, so no identity either
# (apply-patches.sh must then bring its own). DEV commits the demo series, with fixed dates.
ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
DEV = {
    **ENV,
    "GIT_AUTHOR_NAME": "Dev Eloper",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "Dev Eloper",
    "GIT_COMMITTER_EMAIL": "dev@example.com",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00",
    "GIT_COMMITTER_DATE": "2026-01-02T03:04:05+00:00",
}

ENVS = "vllm/envs.py"
DEMO = "vllm/model_executor/layers/fused_moe/_demo_offload.py"
MOE_INIT = "vllm/model_executor/layers/fused_moe/__init__.py"
# Lines of vllm/envs.py the demo patches insert after; the hunk's context is the lines above.
DECLARATION = '    VLLM_HOST_IP: str = ""\n'
GETTER = '    "VLLM_HOST_IP": lambda: os.getenv("VLLM_HOST_IP", ""),\n'


def run(*args: object, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True)


def ok(*args: object, **kwargs) -> str:
    result = run(*args, **kwargs)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr}"
    return result.stdout


def git(repo: Path, *args: object, env: dict[str, str] = ENV) -> str:
    return ok("git", "-C", repo, *args, env=env).strip()


def digest(path: Path) -> str:
    """A hash of every file under path: names, contents and executable bits."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink()):
        rel = f.relative_to(path).as_posix()
        if rel.startswith(".git/"):
            continue  # git's own files change on a mere `git status`; HEAD is checked instead
        h.update(f"{rel}\0{os.stat(f).st_mode & stat.S_IXUSR}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new))


@dataclass
class Series:
    workspace: Path  # the tree with the three demo commits
    patches: Path  # their export: series and 0001..0003 *.patch
    names: list[str]


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("pristine") / "tree"
    ok(VLLM_TREE, "--no-series", tree)
    return tree


@pytest.fixture(scope="session")
def series(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> Series:
    """Three commits on real vLLM files; the second edits lines the first added."""
    base = tmp_path_factory.mktemp("series")
    ws = base / "workspace"
    ok("git", "clone", "-q", pristine, ws)
    edit(ws / ENVS, DECLARATION, DECLARATION + "    VLLM_DEMO_OFFLOAD: bool = False\n")
    edit(
        ws / ENVS,
        GETTER,
        GETTER + '    "VLLM_DEMO_OFFLOAD": lambda: os.getenv("VLLM_DEMO_OFFLOAD", "0") == "1",\n',
    )
    (ws / DEMO).write_text('"""Demo expert offload."""\n\nBUDGET_BYTES = 0\n')
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", "Add VLLM_DEMO_OFFLOAD", env=DEV)
    edit(ws / ENVS, '"VLLM_DEMO_OFFLOAD", "0") == "1"', '"VLLM_DEMO_OFFLOAD", "1") == "1"')
    edit(ws / DEMO, "BUDGET_BYTES = 0\n", "BUDGET_BYTES = 1 << 30\n")
    git(ws, "commit", "-q", "-a", "-m", "[demo] Offload by default\n\nWith a budget.", env=DEV)
    (ws / MOE_INIT).write_text((ws / MOE_INIT).read_text() + "# demo: see _demo_offload.py\n")
    git(ws, "commit", "-q", "-a", "-m", "Point fused_moe at the demo", env=DEV)

    patches = base / "patches"
    ok(EXPORT, "--workspace", ws, "--patches", patches)
    names = sorted(p.name for p in patches.glob("*.patch"))
    assert len(names) == 3
    return Series(ws, patches, names)


@pytest.fixture
def site_packages(pristine: Path, tmp_path: Path) -> Path:
    """A site-packages directory as pip leaves it: the vllm package and its dist-info."""
    site = tmp_path / "site-packages"
    site.mkdir()
    ok("cp", "-a", pristine / "vllm", site)  # faster than shutil.copytree
    info = site / f"vllm-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: vllm\nVersion: {VERSION}\n")
    return site


@pytest.fixture
def checkout(pristine: Path, tmp_path: Path) -> Path:
    target = tmp_path / "checkout"
    ok("git", "clone", "-q", pristine, target)
    return target


def apply(target: Path, patches: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return run(APPLY, *options, "--patches", patches, target)


def apply_by_hand(target: Path, patch: Path) -> None:
    ok("patch", "-s", "-p1", "--no-backup-if-mismatch", "-d", target, "-i", patch)


# --- vllm-tree ---------------------------------------------------------------------------------


def test_tree_is_the_pristine_wheel(pristine: Path) -> None:
    assert git(pristine, "rev-list", "--count", "HEAD") == "1"
    assert git(pristine, "rev-parse", TAG) == git(pristine, "rev-parse", "HEAD")
    wheel, commit_id = PIN["PIN_VLLM_WHEEL"], PIN["PIN_VLLM_COMMIT"]
    subject = git(pristine, "log", "-1", "--format=%s")
    assert subject == f"vLLM {VERSION} ({commit_id}) as released in {wheel}"
    assert git(pristine, "status", "--porcelain") == ""

    files = git(pristine, "ls-files").splitlines()
    assert ENVS in files and len(files) > 2000
    assert all(f.startswith("vllm/") for f in files), "only the vllm package, no dist-info"
    assert not [f for f in files if f.endswith(".so") or f == "vllm/vllm-rs"]
    native = re.compile(r"\.(h|hpp|cuh|inl|cu)$|/Makefile$")
    assert not [f for f in files if f.startswith("vllm/third_party/") and native.search(f)]
    assert f"__version__ = version = '{VERSION}'" in (pristine / "vllm/_version.py").read_text()
    exclude = (pristine / ".git/info/exclude").read_text().splitlines()
    assert "__pycache__/" in exclude and "*.pyc" in exclude


def test_tree_is_reproducible_and_takes_the_series(
    pristine: Path, series: Series, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "keep-me").write_text("x")
    refused = run(VLLM_TREE, "--patches", series.patches, tree)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert (tree / "keep-me").exists()

    # The same commit on a machine whose git is set up differently.
    ignore = tmp_path / "ignore"
    ignore.write_text("*.json\n*.md\n")
    other = tmp_path / "gitconfig"
    other.write_text(
        f"[core]\n autocrlf = true\n excludesFile = {ignore}\n[init]\n defaultBranch = trunk\n"
        "[user]\n name = Other\n email = other@example.com\n"
    )
    env = {**ENV, "GIT_CONFIG_GLOBAL": str(other), "GIT_DEFAULT_HASH": "sha256"}
    ok(VLLM_TREE, "--force", "--patches", series.patches, tree, env=env)
    assert not (tree / "keep-me").exists()
    assert git(tree, "rev-parse", TAG) == git(pristine, "rev-parse", "HEAD")
    assert git(tree, "status", "--porcelain", env=env) == ""
    version_py = "vllm/_version.py"  # no CRLF despite core.autocrlf
    assert (tree / version_py).read_bytes() == (pristine / version_py).read_bytes()
    log = f"{TAG}..HEAD", "--format=%an|%s|%b"
    assert git(tree, "log", *log) == git(series.workspace, "log", *log)
    # Building from the series and exporting again gives the series back, byte for byte.
    check = run(EXPORT, "--check", "--workspace", tree, "--patches", series.patches, env=env)
    assert check.returncode == 0, check.stdout + check.stderr


# --- export-patches ----------------------------------------------------------------------------


def test_export_is_byte_stable_whatever_the_git_config(series: Series, tmp_path: Path) -> None:
    order = tmp_path / "order"
    order.write_text("vllm/model_executor/*\n")
    hostile = tmp_path / "gitconfig"
    hostile.write_text(
        "[diff]\n noprefix = true\n mnemonicPrefix = true\n algorithm = histogram\n"
        " context = 5\n interHunkContext = 10\n renames = copies\n suppressBlankEmpty = true\n"
        f" orderFile = {order}\n"
        "[format]\n numbered = true\n signature = hostile\n thread = shallow\n"
        " headers = X-Hostile: yes\n to = list@example.com\n coverLetter = true\n"
        " subjectPrefix = RFC\n signOff = true\n from = Other <other@example.com>\n"
        " suffix = .diff\n useAutoBase = true\n filenameMaxLength = 20\n"
        "[core]\n abbrev = 7\n quotePath = false\n"
    )
    for name, env in ("plain", ENV), ("hostile", {**ENV, "GIT_CONFIG_GLOBAL": str(hostile)}):
        out = tmp_path / name
        for _ in range(2):  # the second run finds nothing to change
            ok(EXPORT, "--workspace", series.workspace, "--patches", out, env=env)
        assert sorted(p.name for p in out.iterdir()) == sorted(["series", *series.names])
        for f in out.iterdir():
            assert f.read_bytes() == (series.patches / f.name).read_bytes(), f"{name}: {f.name}"

    text = (series.patches / series.names[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] Add VLLM_DEMO_OFFLOAD\n" in text
    listed = [ln for ln in (series.patches / "series").read_text().splitlines() if ln[:1] != "#"]
    assert listed == ["", *series.names]


def test_export_check_and_rewrite(series: Series, tmp_path: Path) -> None:
    up_to_date = run(
        EXPORT, "--check", "--workspace", series.workspace, "--patches", series.patches
    )
    assert up_to_date.returncode == 0, up_to_date.stdout

    ws = tmp_path / "workspace"
    ok("git", "clone", "-q", series.workspace, ws)
    (ws / DEMO).write_text((ws / DEMO).read_text() + "PINNED = True\n")
    git(ws, "commit", "-q", "-a", "-m", "Pin memory", env=DEV)
    patches = tmp_path / "patches"
    shutil.copytree(series.patches, patches)
    (patches / "0009-gone.patch").write_text("stale\n")
    edit(patches / "series", "# The patch series", "# Our own header.\n# The patch series")
    before = digest(patches)

    check = run(EXPORT, "--check", "--workspace", ws, "--patches", patches)
    assert check.returncode == 1
    for change in ("add 0004-Pin-memory.patch", "update series", "delete 0009-gone.patch"):
        assert f"would {change}" in check.stdout
    assert digest(patches) == before, "--check changed files"

    ok(EXPORT, "--workspace", ws, "--patches", patches)
    assert sorted(p.name for p in patches.glob("*.patch")) == [
        *series.names,
        "0004-Pin-memory.patch",
    ]
    text = (patches / "series").read_text()
    assert text.startswith("# Our own header.\n") and text.endswith("0004-Pin-memory.patch\n")
    assert run(EXPORT, "--check", "--workspace", ws, "--patches", patches).returncode == 0


def header(patch: Path) -> list[str]:
    """The mail header of an exported patch: its lines up to the first empty one."""
    return patch.read_text().split("\n\n", 1)[0].splitlines()


def commit_on(ws: Path, subject: str, env: dict[str, str] = DEV) -> None:
    (ws / DEMO).write_text((ws / DEMO).read_text() + f"# {len(subject)}\n")
    git(ws, "commit", "-q", "-a", "-m", subject, env=env)


def test_patches_carry_dep3_fields_dated_by_their_commits(
    series: Series, checkout: Path, site_packages: Path, tmp_path: Path
) -> None:
    for name in series.names:
        lines = header(series.patches / name)
        assert "From: Dev Eloper <dev@example.com>" in lines, name  # DEP-3 Author
        assert any(ln.startswith("Subject: [PATCH] ") for ln in lines), name  # Description
        assert lines[-2:] == ["Forwarded: no", "Last-Update: 2026-01-02"], name

    # Each patch gets its own commit's committer date: the day in the committer's time zone
    # (04:30 UTC on the 4th), not the author date.
    ws = tmp_path / "workspace"
    ok("git", "clone", "-q", series.workspace, ws)
    later = {
        **DEV,
        "GIT_AUTHOR_DATE": "2025-12-31T10:00:00+00:00",
        "GIT_COMMITTER_DATE": "2026-02-03T23:30:00-05:00",
    }
    commit_on(ws, "Offload later", env=later)
    patches = tmp_path / "patches"
    ok(EXPORT, "--workspace", ws, "--patches", patches)
    dates = [ln for p in sorted(patches.glob("*.patch")) for ln in header(p) if "Update" in ln]
    assert dates == ["Last-Update: 2026-01-02"] * 3 + ["Last-Update: 2026-02-03"]
    assert "Date: Wed, 31 Dec 2025 10:00:00 +0000" in header(patches / "0004-Offload-later.patch")

    # git am (a checkout) and GNU patch (site-packages) take the header; the commits git am
    # makes are dated by Last-Update, so their export is the same bytes, and series-digest
    # reads the series.
    result = apply(checkout, patches)
    assert result.returncode == 0, result.stderr
    dated = git(checkout, "log", "--format=%cs %s", f"{TAG}..HEAD").splitlines()
    assert dated[0] == "2026-02-03 Offload later" and len(dated) == 4
    check = run(EXPORT, "--check", "--workspace", checkout, "--patches", patches)
    assert check.returncode == 0, check.stdout + check.stderr
    result = apply(site_packages, patches)
    assert result.returncode == 0, result.stderr
    assert (site_packages / DEMO).read_bytes() == (ws / DEMO).read_bytes()
    digest_of = ok(ROOT / "scripts/series-digest", patches).strip()
    assert re.fullmatch(r"[0-9a-f]{64}", digest_of)


def test_file_names_hold_the_whole_subject(series: Series, tmp_path: Path) -> None:
    ws = tmp_path / "workspace"
    ok("git", "clone", "-q", series.workspace, ws)
    subject = (
        "Offload: keep every expert of a layer in host memory when its whole table is cold "
        "(VLLM_EXPERT_HOST_LAYERS)"
    )
    commit_on(ws, subject)
    patches = tmp_path / "patches"
    ok(EXPORT, "--workspace", ws, "--patches", patches)
    slug = (
        "Offload-keep-every-expert-of-a-layer-in-host-memory-when-its-whole-table-is-cold-"
        "VLLM_EXPERT_HOST_LAYERS"
    )
    assert (patches / f"0004-{slug}.patch").is_file(), sorted(p.name for p in patches.iterdir())

    # a subject whose name would be cut is refused, and nothing is written
    commit_on(ws, "Offload " + "very " * 40 + "long")
    refused = run(EXPORT, "--workspace", ws, "--patches", tmp_path / "none")
    assert refused.returncode == 2
    assert "too long for a file name" in refused.stderr and "shorten it" in refused.stderr
    assert not (tmp_path / "none").exists()


def test_export_refuses_more_than_one_author(series: Series, tmp_path: Path) -> None:
    ws = tmp_path / "workspace"
    ok("git", "clone", "-q", series.workspace, ws)
    # another committer is fine: DEP-3's Author is the commit's author
    commit_on(ws, "Committed by someone else", env={**DEV, "GIT_COMMITTER_NAME": "Other"})
    ok(EXPORT, "--workspace", ws, "--patches", tmp_path / "one-author")

    other = {**DEV, "GIT_AUTHOR_NAME": "Other Author", "GIT_AUTHOR_EMAIL": "other@example.com"}
    commit_on(ws, "Written by someone else", env=other)
    odd = git(ws, "rev-parse", "--short", "HEAD")
    for options in [], ["--check"]:
        refused = run(EXPORT, *options, "--workspace", ws, "--patches", tmp_path / "two")
        assert refused.returncode == 2, refused.stdout
        assert "2 author identities" in refused.stderr
        assert f"Other Author <other@example.com>: {odd}\n" in refused.stderr
        assert "Dev Eloper <dev@example.com>: " in refused.stderr
        assert "--author='Dev Eloper <dev@example.com>'" in refused.stderr  # the fix
        assert not (tmp_path / "two").exists()


def test_export_refuses_a_workspace_without_the_tag(tmp_path: Path) -> None:
    ok("git", "init", "-q", tmp_path / "repo")
    result = run(EXPORT, "--workspace", tmp_path / "repo", "--patches", tmp_path / "p")
    assert result.returncode == 2 and TAG in result.stderr
    assert not (tmp_path / "p").exists()


# --- apply-patches.sh: git checkout --------------------------------------------------------------


def test_apply_to_git_checkout(series: Series, checkout: Path) -> None:
    head = git(checkout, "rev-parse", "HEAD")
    check = apply(checkout, series.patches, "--check")
    assert check.returncode == 0 and "would apply 3 patches" in check.stdout
    assert git(checkout, "rev-parse", "HEAD") == head

    result = apply(checkout, series.patches)
    assert result.returncode == 0, result.stderr
    assert f"* Applying {series.names[0]} (1/3)" in result.stdout
    assert git(checkout, "rev-list", "--count", f"{TAG}..HEAD") == "3"
    log = f"{TAG}..HEAD", "--format=%an|%s|%b"
    assert git(checkout, "log", *log) == git(series.workspace, "log", *log)
    assert git(checkout, "status", "--porcelain") == ""
    for f in ENVS, DEMO, MOE_INIT:
        assert (checkout / f).read_bytes() == (series.workspace / f).read_bytes()

    head = git(checkout, "rev-parse", "HEAD")
    again = apply(checkout, series.patches)
    assert again.returncode == 0
    assert "already patched: 3 patches" in again.stdout
    assert git(checkout, "rev-parse", "HEAD") == head


def test_apply_to_git_checkout_refuses_uncommitted_changes(series: Series, checkout: Path) -> None:
    (checkout / ENVS).write_text((checkout / ENVS).read_text() + "# local change\n")
    before = digest(checkout), git(checkout, "rev-parse", "HEAD")
    result = apply(checkout, series.patches)
    assert result.returncode == 1
    assert "uncommitted changes" in result.stderr and ENVS in result.stderr
    assert (digest(checkout), git(checkout, "rev-parse", "HEAD")) == before


def test_git_checkout_version_from_tags(series: Series, checkout: Path) -> None:
    git(checkout, "rm", "-q", "vllm/_version.py")
    git(checkout, "commit", "-q", "-m", "no _version.py", env=DEV)
    assert apply(checkout, series.patches, "--check").returncode == 0  # from upstream-v0.29.0
    git(checkout, "tag", "v0.28.1")
    result = apply(checkout, series.patches, "--check")
    assert result.returncode == 3 and "0.28.1" in result.stderr


# --- apply-patches.sh: site-packages -------------------------------------------------------------


def test_apply_to_site_packages_without_git(
    series: Series, site_packages: Path, tmp_path: Path
) -> None:
    # A git on PATH that records any call: the site-packages path must not use git.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text(f"#!/bin/sh\necho called >> {tmp_path / 'git-called'}\nexit 127\n")
    (fake / "git").chmod(0o755)
    env = {**ENV, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}

    result = run(APPLY, "--patches", series.patches, site_packages, env=env)
    assert result.returncode == 0, result.stderr
    for f in ENVS, DEMO, MOE_INIT:
        assert (site_packages / f).read_bytes() == (series.workspace / f).read_bytes()
    assert not [p for p in site_packages.rglob("*") if p.suffix in (".orig", ".rej")]
    patched = digest(site_packages)

    again = run(APPLY, "--patches", series.patches, site_packages, env=env)
    assert again.returncode == 0
    assert "already patched: 3 patches" in again.stdout
    assert digest(site_packages) == patched
    assert not (tmp_path / "git-called").exists()


def test_check_changes_nothing(series: Series, site_packages: Path) -> None:
    before = digest(site_packages)
    result = apply(site_packages, series.patches, "--check")
    assert result.returncode == 0 and "would apply 3 patches" in result.stdout
    assert digest(site_packages) == before


def test_wrong_version_is_refused(series: Series, site_packages: Path) -> None:
    edit(site_packages / "vllm/_version.py", f"'{VERSION}'", "'0.28.1'")
    before = digest(site_packages)
    result = apply(site_packages, series.patches)
    assert result.returncode == 3
    assert "0.28.1" in result.stderr and f"vLLM {VERSION} (vllm.pin)" in result.stderr
    assert digest(site_packages) == before


def test_version_from_dist_info(series: Series, site_packages: Path) -> None:
    (site_packages / "vllm/_version.py").unlink()
    assert apply(site_packages, series.patches, "--check").returncode == 0
    metadata = site_packages / f"vllm-{VERSION}.dist-info/METADATA"
    edit(metadata, f"Version: {VERSION}", "Version: 0.28.1")
    result = apply(site_packages, series.patches, "--check")
    assert result.returncode == 3 and "0.28.1" in result.stderr


def test_no_vllm_package(series: Series, tmp_path: Path) -> None:
    result = apply(tmp_path, series.patches)
    assert result.returncode == 3 and "no vllm/ package" in result.stderr


@pytest.mark.parametrize("applied", [1, 2])
def test_partly_applied_is_refused(series: Series, site_packages: Path, applied: int) -> None:
    for name in series.names[:applied]:
        apply_by_hand(site_packages, series.patches / name)
    before = digest(site_packages)
    result = apply(site_packages, series.patches)
    assert result.returncode == 4, result.stderr
    assert "partly patched" in result.stderr
    for i, name in enumerate(series.names):
        assert (name in result.stderr) == (i < applied), name
    assert digest(site_packages) == before


def test_patch_that_does_not_apply(series: Series, site_packages: Path) -> None:
    edit(site_packages / ENVS, GETTER, GETTER.replace("os.getenv", "os.environ.get"))
    before = digest(site_packages)
    result = apply(site_packages, series.patches)
    assert result.returncode == 1
    assert f"{series.names[0]} of " in result.stderr and ENVS in result.stderr
    assert "nothing was changed" in result.stderr
    assert digest(site_packages) == before


def test_no_fuzz(series: Series, site_packages: Path, tmp_path: Path) -> None:
    # Change the outermost context line of a hunk, three lines above the inserted line.
    envs = site_packages / ENVS
    lines = envs.read_text().splitlines(keepends=True)
    outermost = lines.index(GETTER) - 2
    lines[outermost] = lines[outermost].rstrip("\n") + "  # changed\n"
    envs.write_text("".join(lines))
    # GNU patch with its default fuzz would take it; apply-patches.sh must not.
    fuzzy = tmp_path / "fuzzy"
    (fuzzy / ENVS).parent.mkdir(parents=True)
    shutil.copy(envs, fuzzy / ENVS)
    ok(
        "patch",
        "--dry-run",
        "-s",
        "-p1",
        "--fuzz=2",
        "-d",
        fuzzy,
        "-i",
        series.patches / series.names[0],
    )

    before = digest(site_packages)
    result = apply(site_packages, series.patches)
    assert result.returncode == 1 and ENVS in result.stderr
    assert digest(site_packages) == before


# --- apply-patches.sh: the series and the command line ---------------------------------------


@pytest.fixture
def version_only(pristine: Path, tmp_path: Path) -> Path:
    """Enough of an installation for the checks that come before any patching."""
    site = tmp_path / "version-only"
    (site / "vllm").mkdir(parents=True)
    shutil.copy(pristine / "vllm/_version.py", site / "vllm")
    return site


def test_empty_series(version_only: Path, tmp_path: Path) -> None:
    site = version_only
    patches = tmp_path / "empty"
    patches.mkdir()
    (patches / "series").write_text("# nothing yet\n\n   # indented comment\n")
    result = apply(site, patches)
    assert result.returncode == 0 and "nothing to apply" in result.stdout
    edit(site / "vllm/_version.py", f"'{VERSION}'", "'0.28.1'")
    assert apply(site, patches).returncode == 3, "the version is checked first"


def test_broken_series(version_only: Path, tmp_path: Path) -> None:
    site = version_only
    patches = tmp_path / "broken"
    patches.mkdir()
    (patches / "series").write_text("0001-missing.patch\n")
    missing = apply(site, patches)
    assert missing.returncode == 2 and "0001-missing.patch" in missing.stderr

    (patches / "series").write_text("0001-outside.patch\n")
    (patches / "0001-outside.patch").write_text(
        "diff --git a/setup.py b/setup.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/setup.py\n@@ -0,0 +1 @@\n+print('hi')\n"
    )
    outside = apply(site, patches)
    assert outside.returncode == 2 and "outside vllm/" in outside.stderr
    assert not (site / "setup.py").exists()


def test_the_project_series_applies_to_the_pin(site_packages: Path) -> None:
    # patches/series itself, whatever it holds today: it must apply to the pinned vLLM.
    result = run(APPLY, "--check", site_packages)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", [VLLM_TREE, EXPORT, APPLY], ids=lambda p: p.name)
def test_command_line(script: Path) -> None:
    helped = run(script, "--help")
    assert helped.returncode == 0 and "Exit codes" in helped.stdout
    assert run(script, "--no-such-option").returncode == 2
