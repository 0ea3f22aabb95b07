# SPDX-License-Identifier: Apache-2.0
"""The two tool packages: eotools ships in the image and runs there without torch, vLLM or the
development tools; eodev (benchmarks, test models, GPU harness) may use eotools, never the
other way round. The build context (.dockerignore) holds eotools and the entry points that
use it, and of eodev only the test-model generator that compose/tiny.yml runs; each tool in
it runs from that context alone."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from eodev.dockerfile import context_files

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "scripts/eotools"

# Imports that a shipped module must not need to load: blocked in the subprocesses below.
BLOCKED = ("torch", "vllm", "eodev", "transformers", "tokenizers")
BLOCK = "import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"


def run_python(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter in `cwd`, with no PYTHONPATH of this test run."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def module_imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, id(node) in top))
    return out


def test_shipped_modules_never_import_the_development_tools():
    found = [
        (str(p.relative_to(SHIPPED)), mod)
        for p in SHIPPED.rglob("*.py")
        for mod, _ in module_imports(p)
        if mod.split(".")[0] == "eodev"
    ]
    assert not found, f"eotools imports eodev (use eotools.devtools.dev_module): {found}"


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> pathlib.Path:
    """The build context as `docker build` receives it (.dockerignore applied)."""
    root = tmp_path_factory.mktemp("context")
    for rel in context_files(ROOT):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    return root


def test_shipped_modules_need_no_torch_vllm_or_eodev_at_import(context):
    """Every module, those of subpackages included, imports from the build context (eotools
    beside vllm.pin, no eodev) with torch, vLLM, transformers, tokenizers and eodev made
    unimportable."""
    names = sorted(
        ".".join(p.relative_to(SHIPPED).with_suffix("").parts)
        for p in SHIPPED.rglob("*.py")
        if p.stem != "__init__"
    )
    code = BLOCK.format(blocked=BLOCKED) + "".join(f"import eotools.{n}\n" for n in names)
    r = run_python(code, context / "scripts")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(names) >= 15  # the preflight, budget start, cold-set tools, ...


def test_the_context_ships_eotools_and_only_the_test_model_of_eodev(context):
    scripts = context / "scripts"
    assert (scripts / "eotools/preflight.py").is_file()
    assert {p.name for p in scripts.iterdir()} >= {
        "entrypoint.sh",
        "start",  # what the entrypoint execs
        "apply-patches.sh",
        "series-digest",
        "preflight",
        "budget-start",
        "select-cold-set",
        "count-experts",
        "prepare-tiny-model",  # compose/tiny.yml's first start
    }
    dev = {p.relative_to(scripts / "eodev").parts[0] for p in (scripts / "eodev").rglob("*.py")}
    assert dev == {"__init__.py", "tiny_model.py", "synthetic_cold.py", "testmodel"}, dev
    for tool in ("bench", "make-test-model", "test", "dev-env", "bench-offload", "image-build"):
        assert not (scripts / tool).exists(), tool


def test_the_tiny_services_model_maker_imports_from_the_context(context):
    """compose/tiny.yml runs prepare-tiny-model in the image: every module it reaches is
    there (torch, safetensors and tokenizers are the image's)."""
    code = "import eodev.tiny_model, eodev.synthetic_cold, eodev.testmodel.cli\n"
    r = run_python(code, context / "scripts")
    assert r.returncode == 0, r.stderr[-3000:]


def shipped_tools(context: pathlib.Path) -> list[str]:
    return sorted(
        p.name
        for p in (context / "scripts").iterdir()
        if p.is_file() and p.read_text().startswith("#!/usr/bin/env python3")
    )


def test_every_shipped_tool_runs_from_the_context_alone(context):
    """`--help` of each Python entry point in the context, with torch, vLLM and eodev
    unimportable (prepare-tiny-model: vLLM): the image's tools need neither."""
    tools = shipped_tools(context)
    assert len(tools) >= 6, tools
    for tool in tools:
        blocked = BLOCKED if tool != "prepare-tiny-model" else ("vllm",)
        code = (
            BLOCK.format(blocked=blocked)
            + f"sys.argv = [{tool!r}, '--help']\n"
            + f"import runpy; runpy.run_path({str(context / 'scripts' / tool)!r}, "
            + "run_name='__main__')\n"
        )
        r = run_python(code, context)
        assert r.returncode == 0, f"{tool} --help: {r.stderr[-2000:]}"
        assert "usage:" in r.stdout, tool


def test_the_synthetic_source_says_what_it_needs_without_eodev(context, tmp_path):
    """count-experts --source synthetic reads a make-test-model checkpoint's planted routers
    (eodev); with eotools on its own it stops with a message and exit 1."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2, "num_experts": 4}')
    data = tmp_path / "chat.txt"
    data.write_text("hello\n\nworld\n")
    alone = tmp_path / "alone"  # the context less eodev: eotools copied on its own
    shutil.copytree(context, alone, ignore=shutil.ignore_patterns("eodev"))
    r = subprocess.run(
        [
            sys.executable,
            str(alone / "scripts/count-experts"),
            "--source",
            "synthetic",
            "--model",
            str(model),
            "--data",
            f"chat={data}",
            "--out-dir",
            str(tmp_path / "counts"),
        ],
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: --source synthetic works on make-test-model checkpoints" in r.stderr
    assert "Traceback" not in r.stderr and "--source server" in r.stderr
