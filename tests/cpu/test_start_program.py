# SPDX-License-Identifier: Apache-2.0
"""The image's start program (scripts/entrypoint.sh -> scripts/start, eotools/start.py) with a
fake `vllm` on PATH: one table of settings, serve arguments, API keys and signals it must
refuse (exit code, a message naming the setting and the fix, never a traceback, vLLM never
started), and the starts it must let through, with what it execs.

    scripts/test tests/cpu/test_start_program.py
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from eotools import serve_args, settings
from eotools.preflight import CHECKS
from eotools.topologies import TOPOLOGIES

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "scripts/entrypoint.sh"
SHOWN = ("VLLM_API_KEY", "VLLM_EXPERT_COLD_FILE", "VLLM_EXPERT_COUNT_FILE", "VLLM_PLE_TABLE")


def fake_vllm(bin_dir: pathlib.Path) -> pathlib.Path:
    """A `vllm` that writes the environment values of SHOWN (or <unset>), then its
    arguments, one a line, instead of serving."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "vllm.args"
    shown = "".join(f' "${{{v}-<unset>}}"' for v in SHOWN)
    exe = bin_dir / "vllm"
    exe.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n"{shown} "$@" > {log}\n')
    exe.chmod(0o755)
    return log


def start_env(tmp_path: pathlib.Path, **env: str) -> dict[str, str]:
    """No setting of this shell, a fake vllm first on PATH, an API key and no preflight
    unless the case says otherwise."""
    python = pathlib.Path(sys.executable).parent
    base = {k: v for k, v in os.environ.items() if k not in settings.BY_NAME}
    return {
        **base,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{python}{os.pathsep}/usr/bin:/bin",
        "VLLM_API_KEY": "test-key",
        "EO_SKIP_PREFLIGHT": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }


def run_start(tmp_path, args, **env) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    log = fake_vllm(tmp_path / "bin")
    r = subprocess.run(
        [str(ENTRYPOINT), *args],
        env=start_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    return r, log


def execd(log: pathlib.Path) -> tuple[dict[str, str], list[str]]:
    """The environment values (SHOWN) and the arguments the fake vllm was run with."""
    lines = log.read_text().split("\n")[:-1]
    return dict(zip(SHOWN, lines, strict=False)), lines[len(SHOWN) :]


# --- refusals: one table ------------------------------------------------------------------

SETTING, API_KEY, USAGE, COLD_FILE = 8, 9, 2, 6


def case(id, code, says, env=None, args=None):
    return pytest.param(code, says, env or {}, args, id=id)


REFUSED = [
    # the examples
    case(
        "one-table-yes",
        SETTING,
        ["VLLM_EXPERT_ONE_TABLE='yes'", "0 or 1"],
        {"VLLM_EXPERT_ONE_TABLE": "yes"},
    ),
    case(
        "staging-minus-1",
        SETTING,
        ["VLLM_EXPERT_PREFILL_STAGING='-1'", "0 or 1"],
        {"VLLM_EXPERT_PREFILL_STAGING": "-1"},
    ),
    case(
        "ple-table-HOST",
        SETTING,
        ["VLLM_PLE_TABLE='HOST'", "write host"],
        {"VLLM_PLE_TABLE": "HOST"},
    ),
    case(
        "budget-inf", SETTING, ["EO_HOST_BUDGET_GIB='inf'", "finite"], {"EO_HOST_BUDGET_GIB": "inf"}
    ),
    case(
        "host-layers-huge",
        SETTING,
        ["VLLM_EXPERT_HOST_LAYERS='0-99999999999'", "is above 99999", "name layers 0-99999"],
        {"VLLM_EXPERT_HOST_LAYERS": "0-99999999999"},
    ),
    case(
        "state-dir-relative",
        SETTING,
        ["EO_STATE_DIR='state'", "relative", "absolute"],
        {"EO_STATE_DIR": "state"},
    ),
    # budgets
    case(
        "budget-nan", SETTING, ["EO_HOST_BUDGET_GIB='nan'", "finite"], {"EO_HOST_BUDGET_GIB": "nan"}
    ),
    case(
        "budget-1e400",
        SETTING,
        ["EO_HOST_BUDGET_GIB='1e400'", "infinity"],
        {"EO_HOST_BUDGET_GIB": "1e400"},
    ),
    case(
        "budget-zero",
        SETTING,
        ["EO_HOST_BUDGET_GIB='0'", "outside > 0"],
        {"EO_HOST_BUDGET_GIB": "0"},
    ),
    case(
        "budget-negative",
        SETTING,
        ["EO_HOST_BUDGET_GIB='-3'", "outside"],
        {"EO_HOST_BUDGET_GIB": "-3"},
    ),
    case(
        "budget-too-large",
        SETTING,
        ["EO_HOST_BUDGET_GIB='5000'", "<= 4,096"],
        {"EO_HOST_BUDGET_GIB": "5000"},
    ),
    case(
        "budget-comma",
        SETTING,
        ["EO_HOST_BUDGET_GIB='7,6'", "decimal"],
        {"EO_HOST_BUDGET_GIB": "7,6"},
    ),
    # layer lists and the pipeline split
    case(
        "host-layers-backwards",
        SETTING,
        ["'5-3'", "runs backwards", "write 3-5"],
        {"VLLM_EXPERT_HOST_LAYERS": "5-3"},
    ),
    case(
        "host-layers-superscript",
        SETTING,
        ["VLLM_EXPERT_HOST_LAYERS='²'", "not an ASCII digit"],
        {"VLLM_EXPERT_HOST_LAYERS": "²"},
    ),
    case(
        "host-layers-beyond-model",
        SETTING,
        ["VLLM_EXPERT_HOST_LAYERS='0-9'", "model's 4 layers"],
        {"VLLM_EXPERT_HOST_LAYERS": "0-9"},
    ),
    case(
        "partition-stages",
        SETTING,
        ["VLLM_PP_LAYER_PARTITION='1,1,2'", "parallel size 2"],
        {"VLLM_PP_LAYER_PARTITION": "1,1,2"},
        ["-pp", "2"],
    ),
    case(
        "partition-sum",
        SETTING,
        ["VLLM_PP_LAYER_PARTITION='3,3'", "add up to 6", "add up to 4"],
        {"VLLM_PP_LAYER_PARTITION": "3,3"},
        ["-pp", "2"],
    ),
    case(
        "partition-text",
        SETTING,
        ["VLLM_PP_LAYER_PARTITION='a,b'", "layer counts"],
        {"VLLM_PP_LAYER_PARTITION": "a,b"},
    ),
    case(
        "partition-zero",
        SETTING,
        ["VLLM_PP_LAYER_PARTITION='4,0'", "0 layers"],
        {"VLLM_PP_LAYER_PARTITION": "4,0"},
        ["-pp", "2"],
    ),
    # paths
    case(
        "cold-file-relative",
        SETTING,
        ["VLLM_EXPERT_COLD_FILE='cold/a.json'", "absolute"],
        {"VLLM_EXPERT_COLD_FILE": "cold/a.json"},
    ),
    case(
        "metrics-dir-relative",
        SETTING,
        ["VLLM_EXPERT_METRICS_DIR='metrics'", "absolute"],
        {"VLLM_EXPERT_METRICS_DIR": "metrics"},
    ),
    case(
        "count-file-relative",
        SETTING,
        ["VLLM_EXPERT_COUNT_FILE='c.json'", "absolute"],
        {"VLLM_EXPERT_COUNT_FILE": "c.json"},
    ),
    case(
        "key-file-relative",
        SETTING,
        ["VLLM_API_KEY_FILE='key'", "absolute"],
        {"VLLM_API_KEY_FILE": "key"},
    ),
    # the series' swap, counting and staging numbers
    case("swap-2", SETTING, ["VLLM_EXPERT_SWAP='2'", "0 or 1"], {"VLLM_EXPERT_SWAP": "2"}),
    case(
        "swap-interval-0",
        SETTING,
        ["VLLM_EXPERT_SWAP_INTERVAL='0'", "outside 1-"],
        {"VLLM_EXPERT_SWAP_INTERVAL": "0"},
    ),
    case(
        "half-life-0",
        SETTING,
        ["VLLM_EXPERT_SWAP_HALF_LIFE='0'", "outside > 0"],
        {"VLLM_EXPERT_SWAP_HALF_LIFE": "0"},
    ),
    case(
        "margin-nan",
        SETTING,
        ["VLLM_EXPERT_SWAP_MARGIN='nan'", "finite"],
        {"VLLM_EXPERT_SWAP_MARGIN": "nan"},
    ),
    case(
        "self-check-negative",
        SETTING,
        ["VLLM_EXPERT_SWAP_SELF_CHECK='-1'", "outside 0-"],
        {"VLLM_EXPERT_SWAP_SELF_CHECK": "-1"},
    ),
    case(
        "count-interval-negative",
        SETTING,
        ["VLLM_EXPERT_COUNT_INTERVAL_S='-5'", "outside >= 0"],
        {"VLLM_EXPERT_COUNT_INTERVAL_S": "-5"},
    ),
    case(
        "ple-table-pinned",
        SETTING,
        ["VLLM_PLE_TABLE='pinned'", "not one of gpu, host, file, auto"],
        {"VLLM_PLE_TABLE": "pinned"},
    ),
    case(
        "ple-resolved-by-hand",
        SETTING,
        ["VLLM_PLE_TABLE_RESOLVED='host'", "set by the start", "unset it"],
        {"VLLM_PLE_TABLE_RESOLVED": "host"},
    ),
    case(
        "ple-prefetch-threads-many",
        SETTING,
        ["VLLM_PLE_PREFETCH_THREADS='many'", "whole number"],
        {"VLLM_PLE_PREFETCH_THREADS": "many"},
    ),
    case(
        "ple-reserve-nan",
        SETTING,
        ["VLLM_PLE_AUTO_RESERVE_GB='nan'", "finite"],
        {"VLLM_PLE_AUTO_RESERVE_GB": "nan"},
    ),
    case(
        "ple-host-experts-negative",
        SETTING,
        ["VLLM_PLE_AUTO_HOST_EXPERTS_GB='-5'", "outside >= 0"],
        {"VLLM_PLE_AUTO_HOST_EXPERTS_GB": "-5"},
    ),
    case(
        "ple-min-reads-inf",
        SETTING,
        ["VLLM_PLE_MIN_READS_PER_S='inf'", "finite"],
        {"VLLM_PLE_MIN_READS_PER_S": "inf"},
    ),
    case(
        "ple-evict-yes",
        SETTING,
        ["VLLM_PLE_FILE_EVICT='yes'", "0 or 1"],
        {"VLLM_PLE_FILE_EVICT": "yes"},
    ),
    case(
        "trace-tokens-float",
        SETTING,
        ["VLLM_EXPERT_COUNT_TRACE_TOKENS='1e6'", "whole number"],
        {"VLLM_EXPERT_COUNT_TRACE_TOKENS": "1e6"},
    ),
    case(
        "staging-min-0",
        SETTING,
        ["VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS='0'", "outside 1-"],
        {"VLLM_EXPERT_PREFILL_STAGING_MIN_TOKENS": "0"},
    ),
    case(
        "decode-prefetch-yes",
        SETTING,
        ["VLLM_EXPERT_DECODE_PREFETCH='yes'", "0 or 1"],
        {"VLLM_EXPERT_DECODE_PREFETCH": "yes"},
    ),
    case(
        "decode-prefetch-programs-0",
        SETTING,
        ["VLLM_EXPERT_DECODE_PREFETCH_PROGRAMS='0'", "outside 1-"],
        {"VLLM_EXPERT_DECODE_PREFETCH_PROGRAMS": "0"},
    ),
    case(
        "vmm-fail-at-bogus",
        SETTING,
        ["VLLM_EXPERT_VMM_FAIL_AT='bogus'", "not a name"],
        {"VLLM_EXPERT_VMM_FAIL_AT": "bogus"},
    ),
    # the start's own switches
    case(
        "preflight-skip-unknown",
        SETTING,
        ["EO_PREFLIGHT_SKIP='gpu'", "known: vllm"],
        {"EO_PREFLIGHT_SKIP": "gpu"},
    ),
    case(
        "topology-unknown",
        SETTING,
        ["EO_TOPOLOGY='4x80GB'", "not one of"],
        {"EO_TOPOLOGY": "4x80GB"},
    ),
    case(
        "skip-preflight-true",
        SETTING,
        ["EO_SKIP_PREFLIGHT='true'", "0 or 1"],
        {"EO_SKIP_PREFLIGHT": "true"},
    ),
    case(
        "allow-no-key-yes",
        SETTING,
        ["EO_ALLOW_NO_API_KEY='yes'", "0 or 1"],
        {"EO_ALLOW_NO_API_KEY": "yes"},
    ),
    case(
        "api-key-newline",
        SETTING,
        ["VLLM_API_KEY=(hidden)", "control character"],
        {"VLLM_API_KEY": "abc\ndef"},
    ),
    # the API key
    case(
        "no-api-key",
        API_KEY,
        ["no API key", "EO_ALLOW_NO_API_KEY=1", "env_file", "secret"],
        {"VLLM_API_KEY": ""},
    ),
    case(
        "key-file-missing",
        API_KEY,
        ["VLLM_API_KEY_FILE=/nonexistent/key", "no such file"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "/nonexistent/key"},
    ),
    case(
        "key-file-empty",
        API_KEY,
        ["the file is empty"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "@empty"},
    ),
    case(
        "key-file-directory",
        API_KEY,
        ["a directory"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "@dir"},
    ),
    case(
        "key-file-fifo",
        API_KEY,
        ["not a regular file"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "@fifo"},
    ),
    case(
        "key-file-large",
        API_KEY,
        ["larger than"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "@large"},
    ),
    case(
        "key-file-two-lines",
        API_KEY,
        ["control character"],
        {"VLLM_API_KEY": "", "VLLM_API_KEY_FILE": "@lines"},
    ),
    case(
        "api-key-arg-empty",
        API_KEY,
        ["--api-key", "without a key"],
        None,
        ["--api-key", "--port", "8000"],
    ),
    # serve arguments and the cold file
    case("pp-not-a-number", USAGE, ["-pp 'two'", "parallel sizes"], None, ["-pp", "two"]),
    # what vLLM's parser reads and start-up's would not: shortened options, a config file
    case(
        "pp-shortened",
        USAGE,
        ["--pipeline-parallel is a shortened option", "write --pipeline-parallel-size in full"],
        None,
        ["--pipeline-parallel", "2"],
    ),
    case(
        "tp-shortened",
        USAGE,
        ["--tensor-parallel is a shortened option", "--tensor-parallel-size"],
        None,
        ["--tensor-parallel=2"],
    ),
    case(
        "config-file", USAGE, ["--config", "not from a config file"], None, ["--config", "c.yaml"]
    ),
    case(
        "pp-zero",
        USAGE,
        ["--pipeline-parallel-size 0", "outside 1-"],
        None,
        ["--pipeline-parallel-size=0"],
    ),
    case(
        "cold-file-missing",
        COLD_FILE,
        ["VLLM_EXPERT_COLD_FILE=/cold/x.json", "no such file", "COLD_DIR"],
        {"VLLM_EXPERT_COLD_FILE": "/cold/x.json"},
    ),
]


def materialise(tmp_path: pathlib.Path, env: dict[str, str]) -> dict[str, str]:
    """Key files the cases name by @kind."""
    out = dict(env)
    kind = env.get("VLLM_API_KEY_FILE", "")
    if kind.startswith("@"):
        p = tmp_path / f"key-{kind[1:]}"
        if kind == "@empty":
            p.write_text(" \n")
        elif kind == "@dir":
            p.mkdir()
        elif kind == "@fifo":
            os.mkfifo(p)
        elif kind == "@large":
            p.write_text("k" * 5000)
        elif kind == "@lines":
            p.write_text("first\nsecond\n")
        out["VLLM_API_KEY_FILE"] = str(p)
    return out


@pytest.mark.parametrize("code, says, env, args", REFUSED)
def test_refused(tiny_model, tmp_path, code, says, env, args):
    """Exit code, the setting or argument named with its value and the problem, a fix,
    no traceback, and vLLM never run."""
    r, log = run_start(tmp_path, [str(tiny_model), *(args or [])], **materialise(tmp_path, env))
    out = r.stdout + r.stderr
    assert r.returncode == code, out
    for s in says:
        assert s in r.stderr, (s, r.stderr)
    assert "start: error:" in r.stderr and "fix:" in r.stderr, r.stderr
    assert "Traceback" not in out
    assert not log.exists()
    if "VLLM_API_KEY" in env and env["VLLM_API_KEY"]:
        assert env["VLLM_API_KEY"] not in out  # a key is never echoed


def test_the_table_has_the_cases_it_promises():
    assert len(REFUSED) >= 25
    # every setting of the table is refused at least once above
    tested = {k for p in REFUSED for k in p.values[2]}
    assert set(settings.BY_NAME) <= tested, set(settings.BY_NAME) - tested


# --- signals --------------------------------------------------------------------------------


def blocking_model(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A checkpoint whose safetensors file is a FIFO: reading it blocks, as a hung network
    mount would, in budget-start and in the preflight alike (both read the expert size)."""
    model = tmp_path / "stalled"
    model.mkdir()
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8}
    (model / "config.json").write_text(json.dumps(cfg))
    fifo = model / "model.safetensors"
    os.mkfifo(fifo)
    return model, fifo


def stop_while_blocked(tmp_path, signum, **env) -> tuple[subprocess.CompletedProcess, float]:
    model, fifo = blocking_model(tmp_path)
    log = fake_vllm(tmp_path / "bin")
    p = subprocess.Popen(
        [str(ENTRYPOINT), str(model)],
        env=start_env(tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = None
    try:
        deadline = time.monotonic() + 60
        while writer is None:  # opens once the start program is reading the FIFO
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "the start never reached the checkpoint"
                time.sleep(0.05)
        time.sleep(0.2)
        sent = time.monotonic()
        p.send_signal(signum)
        out, err = p.communicate(timeout=10)
        took = time.monotonic() - sent
    finally:
        if writer is not None:
            os.close(writer)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not log.exists()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), took


SIGNALS = [
    pytest.param(signal.SIGTERM, 143, {"EO_HOST_BUDGET_GIB": "0.001"}, id="term-in-budget-start"),
    pytest.param(signal.SIGINT, 130, {"EO_HOST_BUDGET_GIB": "0.001"}, id="int-in-budget-start"),
    pytest.param(signal.SIGTERM, 143, {"VLLM_EXPERT_COLD_FILE": "@cold"}, id="term-in-preflight"),
    pytest.param(signal.SIGINT, 130, {"VLLM_EXPERT_COLD_FILE": "@cold"}, id="int-in-preflight"),
]


@pytest.mark.parametrize("signum, code, env", SIGNALS)
def test_a_signal_stops_the_start(tmp_path, signum, code, env):
    env = {**env, "EO_STATE_DIR": str(tmp_path / "state")}
    if env.get("VLLM_EXPERT_COLD_FILE") == "@cold":
        cold = tmp_path / "cold.json"
        doc = {
            "format": "vllm-expert-offload/cold-set",
            "version": 1,
            "model": {"architecture": "Qwen3MoeForCausalLM", "num_layers": 4, "num_experts": 8},
            "layers": {"0": [7]},
        }
        cold.write_text(json.dumps(doc))
        env.update(VLLM_EXPERT_COLD_FILE=str(cold), EO_SKIP_PREFLIGHT="0")
        env["EO_PREFLIGHT_SKIP"] = "vllm"
    r, took = stop_while_blocked(tmp_path, signum, **env)
    name = signal.Signals(signum).name
    assert r.returncode == code, r.stdout + r.stderr
    assert r.stderr.count(f"start: stopped by {name}") == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert took < 5
    if "EO_HOST_BUDGET_GIB" in env:
        assert not list((tmp_path / "state").glob("cold-*.json"))  # nothing half-written


# --- what is accepted, and what is exec'd -------------------------------------------------


def test_the_arguments_reach_vllm_unchanged(tmp_path):
    args = ["/models/m", "--served-model-name", "a b", "-pp=1", "--x", "", "ü", "--help-me"]
    r, log = run_start(tmp_path, args)
    assert r.returncode == 0, r.stderr
    env, got = execd(log)
    assert got == ["serve", *args]
    assert env["VLLM_API_KEY"] == "test-key"


def test_empty_settings_are_unset_for_vllm(tmp_path):
    """compose's ${VAR:-} gives empty values: they mean unset, for vLLM too (which would
    refuse an empty VLLM_PLE_TABLE and read an empty number as an error)."""
    empty = {"VLLM_PLE_TABLE": "", "VLLM_EXPERT_COLD_FILE": "", "VLLM_EXPERT_ONE_TABLE": ""}
    r, log = run_start(tmp_path, ["/models/m"], **empty)
    assert r.returncode == 0, r.stderr
    env, _ = execd(log)
    assert env["VLLM_PLE_TABLE"] == "<unset>" and env["VLLM_EXPERT_COLD_FILE"] == "<unset>"


def test_the_api_key_file_is_read_and_handed_to_vllm(tmp_path):
    key = tmp_path / "key"
    key.write_text("  s3cret-key \n")
    r, log = run_start(tmp_path, ["/models/m"], VLLM_API_KEY="", VLLM_API_KEY_FILE=str(key))
    assert r.returncode == 0, r.stderr
    env, _ = execd(log)
    assert env["VLLM_API_KEY"] == "s3cret-key" and "s3cret" not in r.stdout + r.stderr


def test_an_api_key_among_the_serve_arguments_is_enough(tmp_path):
    r, log = run_start(tmp_path, ["/models/m", "--api-key", "k1", "k2"], VLLM_API_KEY="")
    assert r.returncode == 0, r.stderr
    assert execd(log)[1][-3:] == ["--api-key", "k1", "k2"]


def test_serving_without_a_key_is_said(tmp_path):
    r, log = run_start(tmp_path, ["/models/m"], VLLM_API_KEY="", EO_ALLOW_NO_API_KEY="1")
    assert r.returncode == 0, r.stderr
    assert "warning: no API key (EO_ALLOW_NO_API_KEY=1)" in r.stderr
    assert execd(log)[0]["VLLM_API_KEY"] == "<unset>"


def test_a_negative_swap_margin_is_accepted_with_a_warning(tmp_path):
    r, log = run_start(tmp_path, ["/models/m"], VLLM_EXPERT_SWAP_MARGIN="-1")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("warning: VLLM_EXPERT_SWAP_MARGIN=-1 is negative") == 1


def cold_of(env: dict[str, str]) -> dict:
    return json.loads(pathlib.Path(env["VLLM_EXPERT_COLD_FILE"]).read_text())


def budget_start(tmp_path, tiny_model, pp: int, **env):
    """A budget-only start through the preflight (its checks that need no GPU or vLLM)."""
    state = tmp_path / "state"
    r, log = run_start(
        tmp_path,
        [str(tiny_model), "--pipeline-parallel-size", str(pp)],
        EO_HOST_BUDGET_GIB="0.001",
        EO_STATE_DIR=str(state),
        EO_SKIP_PREFLIGHT="0",
        EO_PREFLIGHT_SKIP="vllm,gpus,host-mapping",
        **env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK   cold-file" in r.stdout, r.stdout
    env_seen, args = execd(log)
    assert args == ["serve", str(tiny_model), "--pipeline-parallel-size", str(pp)]
    count = pathlib.Path(env_seen["VLLM_EXPERT_COUNT_FILE"])  # run/<run id>/counts.json
    assert count.parent.parent == state / "run" and count.name == "counts.json"
    return cold_of(env_seen), r


def test_a_budget_only_start_follows_the_layer_partition(tmp_path, tiny_model):
    """VLLM_PP_LAYER_PARTITION=1,3: stage 0 is layer 0 alone, and the cold file says so; the
    preflight and vLLM count each rank's experts against its stage's budget."""
    cold, _ = budget_start(tmp_path, tiny_model, 2, VLLM_PP_LAYER_PARTITION="1,3")
    assert cold["budget"]["layer_partition"] == [1, 3]
    per_stage = cold["budget"]["experts_per_stage"]
    assert len(cold["layers"]["0"]) == per_stage[0] > 0
    assert sum(len(cold["layers"].get(str(x), [])) for x in (1, 2, 3)) == per_stage[1]


def test_a_budget_only_start_leaves_the_host_layers_out(tmp_path, tiny_model):
    """Layers VLLM_EXPERT_HOST_LAYERS puts wholly on host are not in the cold file (vLLM
    refuses a layer in both); a stage that is all host layers gets none, with one line."""
    cold, _ = budget_start(tmp_path, tiny_model, 2, VLLM_EXPERT_HOST_LAYERS="1")
    assert "1" not in cold["layers"] and {"0", "2", "3"} <= set(cold["layers"])
    cold, r = budget_start(tmp_path, tiny_model, 2, VLLM_EXPERT_HOST_LAYERS="0-1")
    assert set(cold["layers"]) == {"2", "3"} and cold["budget"]["experts_per_stage"][0] == 0
    assert r.stderr.count("every layer of pipeline stage 0 (0-1) is in VLLM_EXPERT_HOST") == 1


def test_the_state_folder_stays_locked_while_vllm_serves(tmp_path, tiny_model):
    """budget-start's lock on EO_STATE_DIR is inherited by the exec'd `vllm serve`: while
    it runs, a second start on the folder stops with exit 10 and says why; once it is gone
    (however it ended), the folder is free again."""
    state = tmp_path / "state"
    env = dict(EO_HOST_BUDGET_GIB="0.001", EO_STATE_DIR=str(state))
    log = fake_vllm(tmp_path / "bin")
    serving = tmp_path / "bin" / "vllm"
    serving.write_text(serving.read_text() + "exec sleep 60\n")  # keeps the inherited fd
    first = subprocess.Popen(
        [str(ENTRYPOINT), str(tiny_model)], env=start_env(tmp_path, **env), cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.exists() and first.poll() is None, "the first start did not reach vllm"
        second = tmp_path / "second"
        r, _ = run_start(second, [str(tiny_model)], **env)
        assert r.returncode == 10, r.stdout + r.stderr
        assert f"the state folder {state} is in use by another server" in r.stderr
        assert "fix: stop the other server" in r.stderr and "Traceback" not in r.stderr
    finally:
        first.kill()
        first.wait()
    r, _ = run_start(tmp_path / "third", [str(tiny_model)], **env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_cold_file_wins_over_the_budget_and_says_so(tmp_path, tiny_model):
    cold = tmp_path / "cold.json"
    cold.write_text("{}")  # only its existence matters without the preflight
    state = tmp_path / "state"
    r, log = run_start(
        tmp_path,
        [str(tiny_model)],
        VLLM_EXPERT_COLD_FILE=str(cold),
        EO_HOST_BUDGET_GIB="2",
        EO_STATE_DIR=str(state),
    )
    assert r.returncode == 0, r.stderr
    assert f"EO_HOST_BUDGET_GIB=2 is not used: VLLM_EXPERT_COLD_FILE={cold} is" in r.stderr
    assert execd(log)[0]["VLLM_EXPERT_COLD_FILE"] == str(cold) and not state.exists()


def test_help_prints_the_settings_table(tmp_path):
    r, log = run_start(tmp_path, ["--help"], VLLM_EXPERT_ONE_TABLE="yes")  # help first
    assert r.returncode == 0, r.stderr
    for s in settings.SETTINGS:
        assert s.name in r.stdout
    assert "exit codes" in r.stdout and execd(log)[1] == ["serve", "--help"]


# --- the pieces ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["/m", "--pipeline_parallel_size", "2"], ("/m", 2, 1, None)),
        (["/m", "-tp=4", "--api-key=a"], ("/m", 1, 4, ("a",))),
        (["/m", "--api-key", "a", "b", "--port", "1"], ("/m", 1, 1, ("a", "b"))),
        (["/m", "--api-key"], ("/m", 1, 1, ("",))),
        (["--model", "/x", "-pp", "3"], ("/x", 3, 1, None)),
    ],
)
def test_serve_arguments(args, expected):
    s = serve_args.parse(args)
    assert (s.model, s.pp, s.tp, s.api_keys) == expected


def test_the_tables_name_what_the_preflight_and_topologies_know():
    assert settings.PREFLIGHT_CHECKS == CHECKS
    assert set(settings.TOPOLOGY_NAMES) == set(TOPOLOGIES)


def test_docs_say_the_table():
    doc = (ROOT / "docs/configuration.md").read_text()
    for reader in ("vLLM", "start"):
        assert settings.markdown(reader) in doc, f"python3 -m eotools.settings ({reader})"


# --- the GPU questions come from a child process ---------------------------------------------


def test_the_preflight_asks_the_gpus_from_a_child_process(monkeypatch):
    """The start execs vLLM in its own process: CUDA state it made (torch's contexts, the
    driver's files) would be inherited, so its preflight asks the GPUs from a child."""
    from eotools import cuda_probe, preflight, start

    seen = {}
    monkeypatch.setattr(preflight, "run", lambda setup, skip: seen.setdefault("setup", setup) and 0)
    values = settings.read({})
    start.run_preflight(values, {}, serve_args.parse(["/models/m"]), None)
    assert seen["setup"].query_gpus is cuda_probe.query_gpus_in_child
    assert seen["setup"].probes is cuda_probe.probes_in_child


def test_the_child_answers_as_the_process_would(monkeypatch):
    from eotools import cuda_probe

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_probe.query_gpus_in_child() == cuda_probe.query_gpus()
    here = [cuda_probe.probe_host_register(), cuda_probe.probe_vmm_host_numa()]
    assert cuda_probe.probes_in_child() == here


@pytest.mark.parametrize(
    "script, says",
    [
        ("kill -SEGV $$", "the GPU query died (signal 11)"),
        ("echo driver blew up >&2; exit 3", "the GPU query died (exit 3: driver blew up)"),
        ("echo not json", "the GPU query printed no answer"),
        ("sleep 30", "the GPU query took more than 1 s"),
    ],
    ids=["crash", "exit", "garbage", "hang"],
)
def test_a_child_that_gives_no_answer_is_a_refusal_not_a_traceback(
    tmp_path, monkeypatch, script, says
):
    """A driver that kills or hangs the child: no GPU listed (the gpus check fails with why)
    and both host-mapping probes refused, as vLLM would meet the same driver."""
    from eotools import cuda_probe

    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    gpus, how = cuda_probe.query_gpus_in_child(timeout_s=1)
    assert gpus == [] and how == says
    probes = cuda_probe.probes_in_child(timeout_s=1)
    assert [p.works for p in probes] == [False, False] and all(p.detail == says for p in probes)


def test_a_model_after_the_options_is_refused_not_misread(tmp_path, tiny_model):
    """vLLM finds the model anywhere among its arguments; start-up reads it first or from
    --model, so a model elsewhere is refused (exit 2) instead of being checked as none."""
    r, log = run_start(tmp_path, ["--max-model-len", "4096", str(tiny_model)])
    assert r.returncode == USAGE and not log.exists(), r.stdout + r.stderr
    assert "no model: put the model first" in r.stderr and "Traceback" not in r.stderr
    r, log = run_start(tmp_path, ["--max-model-len", "4096", "--model", str(tiny_model)])
    assert r.returncode == 0, r.stderr


def test_an_unreadable_cold_folder_is_a_message(monkeypatch, tmp_path):
    """The image runs as uid 2000: a host folder it cannot enter is EACCES from stat(),
    which pathlib's is_file() raises; the start names the user and the fix."""
    from eotools import start

    real = pathlib.Path.stat

    def stat(self, *a, **k):
        if str(self).startswith("/cold/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    err = start.missing_cold_file("/cold/c.json", None)
    assert err is not None and err.code == COLD_FILE
    assert "cannot be read as uid" in err.problem and "Permission denied" in err.problem
    assert "COLD_DIR" in err.fix and "uid 2000" in err.fix


BAD_OFFSETS = b'{"m.experts.0.w": {"data_offsets": "0-10"}}'


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"\x05\x00"), "shorter than 8 bytes"),
        (
            lambda d: (d / "model.safetensors").write_bytes((1 << 45).to_bytes(8, "little")),
            "a header of 35,184,372,088,832 bytes",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"[1,2]"),
            "not a JSON object",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(
                len(BAD_OFFSETS).to_bytes(8, "little") + BAD_OFFSETS
            ),
            "no valid data_offsets",
        ),
        (
            lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
            "not a safetensors index",
        ),
    ],
    ids=["short", "huge-header", "header-list", "offsets", "index"],
)
def test_a_broken_checkpoint_stops_a_budget_only_start_with_a_message(tmp_path, make, says):
    """budget-start reads the expert size from the checkpoint's headers: a cut or garbled
    file is a message naming it (exit 1), never a traceback or a MemoryError."""
    model = tmp_path / "broken"
    model.mkdir()
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8}
    (model / "config.json").write_text(json.dumps(cfg))
    make(model)
    r, log = run_start(
        tmp_path, [str(model)], EO_HOST_BUDGET_GIB="0.001", EO_STATE_DIR=str(tmp_path / "s")
    )
    assert r.returncode == 1 and not log.exists(), r.stdout + r.stderr
    assert says in r.stderr and str(model) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
