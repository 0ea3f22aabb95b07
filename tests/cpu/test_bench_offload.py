# SPDX-License-Identifier: Apache-2.0
"""bench-offload's report, assembled from the committed H200 engine runs (--from-runs): every
configuration and workload in the project's result format, ratios against the unpatched run
of the same suite run, and each configuration's physical bound from the host-read cost.

    scripts/test tests/cpu/test_bench_offload.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

RUNS = "tests/cpu/data/h200-runs"  # engine runs recorded on an H200 (2026-12-01)
RAW = f"{RUNS}/offload-8l"


def from_runs_cmd(repo_root, tmp, runs, out, *args, layers: int = 8) -> list[str]:
    """bench-offload --from-runs RUNS ... --out OUT on a weightless test model of `layers`
    layers made under `tmp` (once)."""
    model = tmp / f"target-int4-{layers}l"
    if not model.exists():
        tool = [sys.executable, str(repo_root / "scripts/make-test-model"), str(model)]
        make = [*tool, "--layers", str(layers), "--no-weights"]
        subprocess.run(make, check=True, capture_output=True)
    cmd = [sys.executable, str(repo_root / "scripts/bench-offload"), "--model", str(model)]
    return [*cmd, "--from-runs", str(runs), *args, "--out", str(out)]


@pytest.fixture(scope="module")
def report(repo_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "suite.json"
    args = ["--ran-as", "x", "--ran-at", "y", "--host-read-us", "55.7"]
    cmd = from_runs_cmd(repo_root, tmp, repo_root / RAW, out, *args)
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_every_configuration_in_the_result_format(report):
    doc, md = report
    keys = {"suite", "date", "gpu", "command", "model", "runs"}
    assert keys <= doc.keys()
    runs = {r["config"]: r for r in doc["runs"]}
    assert set(runs) == {"unpatched", "cpu-offload-gb", "offload-01", "offload-02"}
    for r in runs.values():
        assert r["workload"] == "fresh" and len(r["decode_tok_s"]) == 3  # every repeat
        for k in ("tpot_ms_p50", "tpot_ms_p90", "ttft_ms", "host_reads_per_token"):
            assert r[k] == r[k]  # not NaN
    assert runs["unpatched"]["decode_vs_unpatched"] == 1.0
    assert runs["offload-02"]["decode_vs_unpatched"] == pytest.approx(432.3 / 650.8, abs=1e-3)
    assert runs["offload-02"]["host_reads_per_token"] == pytest.approx(2.08, abs=0.01)
    assert "| offload-02 | fresh |" in md
    # these runs predate per-process VRAM: the device's figure, marked
    o2 = runs["offload-02"]
    assert o2["vram_source"].startswith("the whole device")
    assert f"| {o2['peak_vram_gib']:.2f}* / {o2['peak_host_gib']:.2f} |" in md


def test_physical_bound_is_unpatched_tpot_plus_reads_times_the_read_cost(report):
    doc, md = report
    runs = {r["config"]: r for r in doc["runs"]}
    base = runs["unpatched"]["tpot_ms_p50"]
    assert runs["unpatched"]["physical_bound_tpot_ms"] == pytest.approx(base)
    assert runs["unpatched"]["tpot_vs_bound"] == pytest.approx(1.0)
    for name in ("offload-01", "offload-02", "cpu-offload-gb"):
        r = runs[name]
        bound = base + r["host_reads_per_token"] * 0.0557
        assert r["physical_bound_tpot_ms"] == pytest.approx(bound)
        assert r["tpot_vs_bound"] == pytest.approx(r["tpot_ms_p50"] / bound)
    assert doc["host_read_us"] == 55.7 and "of physical bound" in md.replace(
        "vs physical", "of physical"
    )


def test_config_specs():
    from eodev.bench.configs import parse_spec
    from eodev.bench_offload.suite import spec_slug

    assert parse_spec("offload-02") == ("offload-02", "", None, None)
    assert parse_spec("offload-02+count") == ("offload-02", "count", None, None)
    assert parse_spec("offload-03-swap+churn") == ("offload-03-swap", "churn", None, None)
    assert parse_spec("offload-02@/tmp/p3") == ("offload-02", "", "/tmp/p3", None)
    assert parse_spec("offload-03-swap:26+churn") == ("offload-03-swap", "churn", None, 26)
    assert parse_spec("offload-03-swap+hold") == ("offload-03-swap", "hold", None, None)
    assert parse_spec("cpu-offload-gb:205") == ("cpu-offload-gb", "", None, 205)
    assert parse_spec("offload-02:26+stage") == ("offload-02", "stage", None, 26)
    assert parse_spec("offload-03-swap+stage") == ("offload-03-swap", "stage", None, None)
    assert parse_spec("offload-03-swap+fast") == ("offload-03-swap", "fast", None, None)
    assert parse_spec("offload-03-swap+stage+prefetch") == (
        "offload-03-swap",
        "stage+prefetch",
        None,
        None,
    )
    assert spec_slug("offload-02") == "offload-02"  # the committed raw runs' names
    assert spec_slug("offload-03-swap:26") == "offload-03-swap-h26"
    assert spec_slug("offload-02@/tmp/a") != spec_slug("offload-02@/tmp/b")
    bad = (
        "offload-04",
        "offload-02+churn",
        "offload-02+fast",
        "unpatched+count",
        "offload-03+hold",
        "offload-03-swap+churn+hold",
        "offload-03-swap+fast+hold",
        "offload-03+fast",
        "offload-01+stage",
        "unpatched+stage",
        "offload-03-swap+prefetch",  # prefetch copies into staging's slots
        "offload-02+stage+prefetch",  # and needs one table
    )
    for spec in (*bad, "unpatched:3", "offload-01:3", "offload-02:x", "offload-02:0"):
        with pytest.raises(SystemExit):
            parse_spec(spec)


def _args(*argv: str):
    from eodev.bench_offload.cli import parser

    return parser().parse_args(["--model", "m", "--out", "o.json", *argv])


def test_pp_size_reaches_every_engine():
    from eodev.bench_offload.suite import suite_engine

    assert "pipeline_parallel_size" not in suite_engine(_args())
    two = suite_engine(_args("--pp-size", "2"), cpu_offload_gb=1.5)
    assert two["pipeline_parallel_size"] == 2 and two["cpu_offload_gb"] == 1.5


def test_ttft_32k_adds_its_task_and_room_for_its_prompt(repo_root, tmp_path):
    """--ttft-32k: a third TTFT task of 32,768 tokens whose first 8,192 are the 8k task's
    prompt, every engine's max_model_len raised for it; the report's TTFT cell shows it."""
    from eodev.bench_offload.report import _ttft_cell
    from eodev.bench_offload.suite import suite_engine
    from eodev.bench_offload.workloads import LONG_MODEL_LEN, engine_tasks, workload_prompts
    from eodev.testmodel.plant import load_plan

    model = tmp_path / "target-int4-2l"
    tool = [sys.executable, str(repo_root / "scripts/make-test-model"), str(model)]
    subprocess.run([*tool, "--layers", "2", "--no-weights"], check=True, capture_output=True)
    plan = load_plan(model)
    short = workload_prompts(plan)
    long = workload_prompts(plan, 32768)
    assert long[2][:10240] == short[2] and len(long[2]) >= 32768
    tasks = engine_tasks(_args("--ttft-32k"), *long)
    by_name = {t["name"]: t for t in tasks}
    assert len(by_name["ttft_32k"]["prompt"]) == 32768
    assert by_name["ttft_32k"]["prompt"][:8192] == by_name["ttft_8k"]["prompt"]
    assert "ttft_32k" not in {t["name"] for t in engine_tasks(_args(), *short)}
    assert suite_engine(_args("--ttft-32k"))["max_model_len"] == LONG_MODEL_LEN
    assert suite_engine(_args())["max_model_len"] == 10240
    row = {"ttft_2k_ms": [20.0, 21.0, 19.0], "ttft_8k_ms": [110.0], "ttft_32k_ms": [650.0]}
    assert _ttft_cell(row) == "20.0 / 110.0 / 650.0"
    assert _ttft_cell({**row, "ttft_32k_ms": None}) == "20.0 / 110.0"


def test_the_stage_variant_turns_prefill_staging_on(tmp_path):
    from eodev.bench_offload.configs import _variant_env

    env = {"VLLM_EXPERT_COLD_FILE": "c.json"}
    _variant_env(env, "stage", "offload-02", tmp_path / "b.json")
    assert env == {"VLLM_EXPERT_COLD_FILE": "c.json", "VLLM_EXPERT_PREFILL_STAGING": "1"}
    plain = {}
    _variant_env(plain, "count", "offload-02", tmp_path / "b.json")
    assert "VLLM_EXPERT_PREFILL_STAGING" not in plain


def test_the_fast_variant_sets_the_swap_policy_simulate_swap_prefers(tmp_path):
    from eodev.bench_offload.configs import _variant_env

    env = {}
    _variant_env(env, "fast+stage", "offload-03-swap", tmp_path / "b.json")
    assert env == {
        "VLLM_EXPERT_SWAP_INTERVAL": "1",
        "VLLM_EXPERT_SWAP_HALF_LIFE": "64",
        "VLLM_EXPERT_SWAP_MARGIN": "1",
        "VLLM_EXPERT_PREFILL_STAGING": "1",
    }


def test_the_prefetch_variant_turns_decode_prefetch_on(tmp_path):
    from eodev.bench_offload.configs import _variant_env

    env = {}
    _variant_env(env, "stage+prefetch", "offload-03-swap", tmp_path / "b.json")
    assert env == {"VLLM_EXPERT_PREFILL_STAGING": "1", "VLLM_EXPERT_DECODE_PREFETCH": "1"}


def test_agreement_says_where_greedy_tokens_leave_the_unpatched_ones():
    """A sequence that differs is located at its first differing token, with both tokens
    and each engine's logprob of its own token; the report groups repeated prompts that
    diverge the same way into one line."""
    from eodev.bench_offload.agreement import agreement, divergence_lines

    def run(*outputs):
        return {"tasks": {"fresh_tokens": {"outputs": list(outputs)}}}

    def out(ids, lps):
        return {"token_ids": ids, "logprobs": lps}

    base = run(out([1, 2, 3], [-0.1, -0.2, -4.5649]), out([4, 5], [-0.1, -0.1]))
    same = agreement(run(*base["tasks"]["fresh_tokens"]["outputs"]), base, "fresh")
    assert same["sequences_identical_to_unpatched"] == "2/2" and same["divergences"] == []
    res = run(out([1, 2, 9], [-0.1, -0.2, -4.5645]), out([4], [-0.1]))
    got = agreement(res, base, "fresh")
    assert got["sequences_identical_to_unpatched"] == "0/2"
    assert got["divergences"] == [
        {
            "prompt": 0,
            "at": 2,
            "of": 3,
            "token": 9,
            "unpatched_token": 3,
            "logprob": -4.5645,
            "unpatched_logprob": -4.5649,
        },
        {"prompt": 1, "at": 1, "of": 2},  # stopped early
    ]
    row = {"config": "offload-03-swap", "workload": "repeat"}
    first = got["divergences"][0]
    doc = {
        "runs": [{**row, "divergences": [first, {**first, "prompt": 5}]}, {**row, "config": "x"}]
    }
    lines = divergence_lines(doc)
    assert lines[2] == (
        "- offload-03-swap, repeat, prompts 0, 5: token 2 of 3: 9 (logprob -4.5645) against "
        "unpatched 3 (-4.5649), 0.0004 apart"
    )
    assert len(lines) == 3
    assert divergence_lines({"runs": [row]}) == []


def test_a_sweep_adds_both_configurations_per_host_fraction(repo_root, tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "sweep.json"
    args = ["--configs", "unpatched,offload-03-swap", "--sweep", "0.05,0.125,0.4"]  # 0.125: 64
    cmd = from_runs_cmd(repo_root, tmp_path, tmp_path / "empty", out, *args)
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    doc = json.loads(out.read_text())
    assert doc["not_run"] == [
        "unpatched",
        "offload-03-swap",
        "offload-03-swap-h26",
        "cpu-offload-gb-h26",
        "cpu-offload-gb",
        "offload-03-swap-h205",
        "cpu-offload-gb-h205",
    ]
    for n in (26, 205):  # a cold file per size, n experts of every layer
        cold = json.loads(out.with_suffix(f".cold-{n}.json").read_text())
        assert {len(v) for v in cold["layers"].values()} == {n}


def test_agreement_with_unpatched():
    from eodev.bench_offload.agreement import agreement

    def run(*outs):
        return {"tasks": {"fresh_tokens": {"outputs": list(outs)}}}

    base = run({"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]})
    same = run({"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.25, -0.3]})
    other = run({"token_ids": [1, 5, 3], "logprobs": [-0.1, -9.0, -0.3]})
    a = agreement(same, base, "fresh")
    assert a["sequences_identical_to_unpatched"] == "1/1"
    assert a["decode_logprob_max_abs_diff"] == pytest.approx(0.05)
    b = agreement(other, base, "fresh")  # compared only up to the first differing token
    assert b["sequences_identical_to_unpatched"] == "0/1"
    assert b["decode_logprob_max_abs_diff"] == 0.0
    assert agreement(same, None, "fresh") == {}


def test_the_offload03_suite_run_with_variants(repo_root, tmp_path):
    """Run b of 2026-12-01 re-assembled from its engine runs: offload-03 and its swap, the
    0004 A/B through another tree, the counting hook, each checked against unpatched."""
    specs = (
        "unpatched,offload-03-swap,offload-03,offload-02,offload-02@/tmp/vllm-p0003,"
        "offload-03-swap+churn,offload-02+count"
    )
    out = tmp_path / "b.json"
    runs = repo_root / RUNS / "offload03-variants-8l"
    cmd = from_runs_cmd(
        repo_root, tmp_path, runs, out, "--configs", specs, "--host-read-us", "55.7"
    )
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    doc = json.loads(out.read_text())
    rows = {(r.get("variant", r["config"]), r["workload"]): r for r in doc["runs"]}
    assert len(rows) == 14 and not doc["not_run"] and not doc["failed"]
    for r in doc["runs"]:
        total = 6 if r["workload"] == "fresh" else 12
        assert r["sequences_identical_to_unpatched"] == f"{total}/{total}"
    assert rows[("offload-03", "fresh")]["decode_vs_unpatched"] == pytest.approx(
        809.6 / 812.1, abs=1e-3
    )
    swap = rows[("offload-03-swap", "repeat")]
    assert swap["host_reads_source"].startswith("the runtime swap's counters")
    assert (
        swap["host_reads_per_token"] < 0.4 * rows[("offload-03", "repeat")]["host_reads_per_token"]
    )
    assert rows[("offload-02@/tmp/vllm-p0003", "fresh")]["config"] == "offload-02"
    assert rows[("offload-02+count", "fresh")]["variant"] == "offload-02+count"


def test_rounds_pair_each_configuration_with_the_unpatched_run_of_its_round(repo_root, tmp_path):
    """--rounds: ratios are taken within a round (against that round's unpatched run), and the
    report gives their median and range; every repeat of every round is kept."""
    raw = repo_root / RUNS / "offload03-variants-8l"
    runs = tmp_path / "runs"
    runs.mkdir()
    scale = {"unpatched": 0.8, "offload-02": 0.9}  # round 2: a slower machine, unevenly
    for name in scale:
        [src] = [f for f in raw.glob(f"bench-{name}-*.json") if ".config." not in f.name]
        (runs / src.name).write_text(src.read_text())
        doc = json.loads(src.read_text())
        for task in doc["tasks"].values():
            if "decode_tok_s" in task:
                task["decode_tok_s"] = [x * scale[name] for x in task["decode_tok_s"]]
        (runs / src.name.replace(f"bench-{name}-", f"bench-{name}-r2-")).write_text(json.dumps(doc))
    out = tmp_path / "rounds.json"
    args = ["--configs", "unpatched,offload-02", "--rounds", "2"]
    cmd = from_runs_cmd(repo_root, tmp_path, runs, out, *args)
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    doc = json.loads(out.read_text())
    rows = {(r["config"], r["workload"]): r for r in doc["runs"]}
    fresh = rows[("offload-02", "fresh")]
    first = 801.0 / 812.1  # run b's medians
    assert fresh["decode_vs_unpatched_rounds"] == pytest.approx([first, first * 0.9 / 0.8], 1e-3)
    assert fresh["decode_vs_unpatched"] == pytest.approx(first * (1 + 0.9 / 0.8) / 2, 1e-3)
    assert len(fresh["decode_tok_s"]) == 6 and fresh["rounds"] == 2
    assert fresh["sequences_identical_to_unpatched"] == "12/12"
    assert doc["rounds"] == 2 and not doc["not_run"]
    assert "over 2 rounds" in out.with_suffix(".md").read_text()


def test_engine_runs_record_their_machine(monkeypatch):
    """Decode speed differs between hosts of the same GPU (run c of 2026-12-01): each engine
    run says what it ran on, from /proc/cpuinfo and nvidia-smi."""
    import subprocess as sp
    import types

    from eodev.engine_probe import machine

    line = "NVIDIA H200, 580.82.07, 5, 16, 1980, 1980, 3201\n"
    monkeypatch.setattr(sp, "run", lambda *a, **k: types.SimpleNamespace(stdout=line))
    m = machine()
    assert m["cpus"] >= 1 and m["cpu"]
    assert m["gpu"] == {
        "name": "NVIDIA H200",
        "driver_version": "580.82.07",
        "pcie.link.gen.current": "5",
        "pcie.link.width.current": "16",
        "clocks.sm": "1980",
        "clocks.max.sm": "1980",
        "clocks.mem": "3201",
    }

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(sp, "run", missing)
    assert machine()["gpu"] is None


def test_decide_ab_task_and_its_report_line(report):
    """--decide-ab: decisions that never swap against none, and the report's line for it."""
    from eodev.bench_offload.report import markdown
    from eodev.bench_offload.workloads import decide_ab_task

    task = decide_ab_task([[1, 2]], 64, 3)
    assert task["kind"] == "decode_ab" and task["name"] == "decide_ab"
    assert task["variants"] == {"decide": {"margin": 1e30}, "no-decide": {"interval": 10**9}}
    doc, _ = report
    ab = {
        "ratio": "no-decide / decide",
        "pair_ratios": [0.99, 1.01, 1.0],
        "pair_ratio_p50": 1.0,
        "pair_ratio_range": [0.99, 1.01],
        "tpot_ms_p50": {"decide": 1.2, "no-decide": 1.2},
    }
    md = markdown({**doc, "decide_ab": {"offload-03-swap (round 1)": ab}})
    assert (
        "Decide kernel alone, offload-03-swap (round 1): TPOT no-decide / decide = 1.000 "
        "(median of 3 request pairs" in md
    )


def test_paired_runs_take_their_ratio_from_their_own_unpatched_engine(repo_root, tmp_path):
    """--paired: each configuration's ratio is against the unpatched engine that ran beside
    it (bench-unpatched-for-<config>), which also gives the unpatched row."""
    raw = repo_root / RAW
    runs = tmp_path / "runs"
    runs.mkdir()
    [base] = [f for f in raw.glob("bench-unpatched-*.json") if "config" not in f.name]
    [off] = [f for f in raw.glob("bench-offload-02-*.json") if "config" not in f.name]
    (runs / "bench-unpatched-for-offload-02-0123456789abcdef.json").write_text(base.read_text())
    (runs / "bench-offload-02-fedcba9876543210.json").write_text(off.read_text())
    out = tmp_path / "paired.json"
    cmd = from_runs_cmd(
        repo_root, tmp_path, runs, out, "--paired", "--configs", "unpatched,offload-02"
    )
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {x["config"]: x for x in json.loads(out.read_text())["runs"]}
    assert set(rows) == {"unpatched", "offload-02"}
    assert rows["unpatched"]["decode_vs_unpatched"] == 1.0
    assert rows["offload-02"]["decode_vs_unpatched"] == pytest.approx(432.3 / 650.8, abs=1e-3)

    # a configuration whose unpatched partner is missing is listed as not run
    (runs / "bench-unpatched-for-offload-02-0123456789abcdef.json").unlink()
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    assert json.loads(out.read_text())["not_run"] == ["offload-02"]


def test_a_paired_run_with_gzip_compressed_results(repo_root, tmp_path):
    """The committed paired 16-layer run keeps its engine results gzip-compressed (over
    100 KB each); --from-runs reads them and takes each ratio within its pair."""
    raw = repo_root / RUNS / "paired-16l"
    assert list(raw.glob("bench-offload-03-swap-*.json.gz"))
    out = tmp_path / "paired.json"
    args = ["--paired", "--decide-ab", "--decode-tokens", "256", "--host-experts-per-layer"]
    args += ["51", "--host-layers", "0,1", "--configs", "unpatched,offload-03-swap,offload-03"]
    cmd = from_runs_cmd(repo_root, tmp_path, raw, out, *args, layers=16)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {(x["config"], x["workload"]): x for x in doc["runs"]}
    swap_fresh = rows[("offload-03-swap", "fresh")]
    assert swap_fresh["decode_vs_unpatched"] == pytest.approx(490.6 / 547.9, abs=2e-3)
    assert swap_fresh["host_reads_per_token"] == pytest.approx(0.64, abs=0.01)
    assert rows[("offload-03-swap", "repeat")]["host_reads_per_token"] < 0.05
    assert doc["not_run"] == ["offload-03"]  # its engine failed on the GPU host


def test_run_units_group_configurations_and_alternate_their_order():
    from eodev.bench_offload.suite import run_units

    specs = ["unpatched", "offload-02", "offload-01", "offload-03-swap:26"]
    assert run_units(specs, 1, 0) == [(1, [s]) for s in specs]
    assert run_units(specs, 2, 1) == [
        (1, ["offload-02"]),
        (1, ["offload-01"]),
        (1, ["offload-03-swap:26"]),
        (2, ["offload-03-swap:26"]),
        (2, ["offload-01"]),
        (2, ["offload-02"]),
    ]
    assert run_units(specs, 1, 2) == [
        (1, ["offload-02", "offload-01"]),
        (1, ["offload-03-swap:26"]),
    ]


def test_a_group_takes_its_ratios_from_its_own_unpatched_engine(repo_root, tmp_path, monkeypatch):
    """--group 2: two configurations at a time beside one unpatched engine (one
    run_engine_group call per unit, labels naming the unit); each ratio is against that
    engine; a member that fails is reported alone; --from-runs finds the same runs again."""
    from eodev import gpu_harness as gh
    from eodev.bench_offload.cli import main

    raw = repo_root / RAW

    def load(prefix):
        [f] = [f for f in raw.glob(f"bench-{prefix}-*.json") if "config" not in f.name]
        return json.loads(f.read_text())

    calls = []

    def fake_group(members, timeout=1800, probe=None, stagger=0):
        util = os.environ.get("EO_GPU_MEMORY_UTILIZATION")
        calls.append(([m[0] for m in members], util, stagger, timeout))
        out = [load("unpatched")]
        assert not members[0][2] and not members[0][1]["env"]  # the unpatched engine
        for label, config, patched, _tree in members[1:]:
            assert patched == ("cpu-offload" not in label)
            assert config["tasks"] == members[0][1]["tasks"]
            if label == "bench-offload-03":
                out.append(RuntimeError("engine run bench-offload-03 failed (exit 1)"))
            else:
                out.append(load(label.removeprefix("bench-")))
        return out

    monkeypatch.setattr(gh, "run_engine_group", fake_group)
    monkeypatch.delenv("EO_GPU_MEMORY_UTILIZATION", raising=False)
    model = tmp_path / "target-int4-8l"
    tool = [sys.executable, str(repo_root / "scripts/make-test-model"), str(model)]
    subprocess.run([*tool, "--layers", "8", "--no-weights"], check=True, capture_output=True)
    out = tmp_path / "group.json"
    configs = "unpatched,cpu-offload-gb,offload-02,offload-01,offload-03"
    args = ["--model", str(model), "--group", "2", "--configs", configs]
    # a failed member is reported, and the exit status says so
    assert main([*args, "--out", str(out)]) == 1
    first = [
        "bench-unpatched-for-cpu-offload-gb+offload-02",
        "bench-cpu-offload-gb",
        "bench-offload-02",
    ]
    second = ["bench-unpatched-for-offload-01+offload-03", "bench-offload-01", "bench-offload-03"]
    # the first unit starts the unpatched engine and the members up to the first patched
    # one before the others (a cold compile cache); each unit has its own deadline
    assert calls == [(first, "0.33", 3, 900), (second, "0.33", 0, 900)]
    doc = json.loads(out.read_text())
    rows = {x["config"]: x for x in doc["runs"]}
    assert set(rows) == {"unpatched", "cpu-offload-gb", "offload-02", "offload-01"}
    assert rows["offload-02"]["decode_vs_unpatched"] == pytest.approx(432.3 / 650.8, abs=1e-3)
    assert list(doc["failed"]) == ["offload-03"]
    # each unit's unpatched engine is a row of its own, at 1.0x of itself
    bases = [x for x in doc["runs"] if x["config"] == "unpatched" and x["workload"] == "fresh"]
    assert [x.get("variant") for x in bases] == [None, "unpatched (beside offload-01, offload-03)"]
    assert [x["decode_vs_unpatched"] for x in bases] == [1.0, 1.0]

    # the same unit's runs, as a GPU host leaves them, assembled with --from-runs
    runs = tmp_path / "runs"
    runs.mkdir()
    for label in calls[0][0]:
        src = "unpatched" if "unpatched" in label else label.removeprefix("bench-")
        (runs / f"{label}-0123456789abcdef.json").write_text(json.dumps(load(src)))
    again = tmp_path / "again.json"
    cmd = from_runs_cmd(repo_root, tmp_path, runs, again, "--group", "2", "--configs", configs)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(again.read_text())
    assert doc["not_run"] == ["offload-01", "offload-03"]
    ratio = {x["config"]: x["decode_vs_unpatched"] for x in doc["runs"]}
    assert ratio["offload-02"] == pytest.approx(432.3 / 650.8, abs=1e-3)


def test_per_repeat_ratios_and_a_reproduction_check_on_two_committed_runs(repo_root, tmp_path):
    """Each row carries its per-repeat ratios against its own unpatched engine and their
    range (the spread it reports); --compare-with sets each ratio beside an earlier run's
    and says whether it lies within that run's range. The two paired offload-03-swap runs
    recorded before and after the placement fix do not agree."""
    import gzip

    def raw_rates(folder, label, workload):
        [f] = (repo_root / folder).glob(f"{label}-[0-9a-f]*[0-9a-f].json.gz")
        return json.loads(gzip.decompress(f.read_bytes()))["tasks"][workload]["decode_tok_s"]

    d_raw = f"{RUNS}/paired-16l"
    f_raw = f"{RUNS}/paired-placement-fix-16l"
    common = ["--paired", "--decode-tokens", "256", "--host-experts-per-layer", "51"]
    earlier = tmp_path / "d.json"
    cmd = from_runs_cmd(
        repo_root,
        tmp_path,
        repo_root / d_raw,
        earlier,
        *common,
        "--decide-ab",
        "--configs",
        "unpatched,offload-03-swap,offload-03",
        layers=16,
    )
    subprocess.run(cmd, check=True, capture_output=True, cwd=repo_root)
    later = tmp_path / "f.json"
    cmd = from_runs_cmd(
        repo_root,
        tmp_path,
        repo_root / f_raw,
        later,
        *common,
        "--configs",
        "unpatched,offload-03-swap,offload-03-swap+hold",
        "--compare-with",
        str(earlier),
        layers=16,
    )
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]

    def expect(folder, workload):
        mine = raw_rates(folder, "bench-offload-03-swap", workload)
        base = raw_rates(folder, "bench-unpatched-for-offload-03-swap", workload)
        ratios = [a / b for a, b in zip(mine, base, strict=True)]
        return sorted(mine)[1] / sorted(base)[1], [min(ratios), max(ratios)], ratios

    doc = json.loads(later.read_text())
    rows = {(x.get("variant", x["config"]), x["workload"]): x for x in doc["runs"]}
    for workload in ("fresh", "repeat"):
        ratio, rng, ratios = expect(f_raw, workload)
        row = rows[("offload-03-swap", workload)]
        assert row["decode_vs_unpatched_by_repeat"] == pytest.approx(ratios)
        assert row["decode_vs_unpatched_range"] == pytest.approx(rng)
        [f] = (repo_root / f_raw).glob("bench-offload-03-swap-[0-9a-f]*[0-9a-f].json.gz")
        runs = json.loads(gzip.decompress(f.read_bytes()))["tasks"][workload]["runs"]
        assert row["tpot_ms_by_request"] == [x["tpot_ms"] for x in runs] and len(runs) > 3
    rep = {(x["config"], x["workload"]): x for x in doc["reproduction"]["rows"]}
    assert set(rep) == {("offload-03-swap", "fresh"), ("offload-03-swap", "repeat")}
    for workload in ("fresh", "repeat"):
        ratio, rng, _ = expect(d_raw, workload)
        x = rep[("offload-03-swap", workload)]
        assert x["before"] == pytest.approx(ratio) and x["before_range"] == pytest.approx(rng)
        assert x["now"] == pytest.approx(expect(f_raw, workload)[0])
        assert x["reproduced"] is (rng[0] <= x["now"] <= rng[1])
    assert rep[("offload-03-swap", "fresh")]["reproduced"] is False  # 0.966 vs 0.835-0.956
    md = later.with_suffix(".md").read_text()
    assert "0 of 2 ratios within that run's per-repeat range" in md
    assert (
        "| offload-03-swap | fresh | 0.895x (0.835-0.956) | 0.966x (0.911-1.042) | **no** |" in md
    )


def test_reproduction_verdicts():
    from eodev.bench_offload.reproduction import reproduction, reproduction_lines

    def doc(ratio, rng, config="offload-02"):
        row = {"config": config, "workload": "fresh", "decode_vs_unpatched": ratio}
        if rng:
            row["decode_vs_unpatched_range"] = rng
        base = {"config": "unpatched", "workload": "fresh", "decode_vs_unpatched": 1.0}
        return {"runs": [base, row]}

    inside = reproduction(doc(0.86, [0.84, 0.88]), doc(0.85, [0.80, 0.90]))
    assert [(r["config"], r["reproduced"]) for r in inside] == [("offload-02", True)]
    assert reproduction(doc(0.95, None), doc(0.85, [0.80, 0.90]))[0]["reproduced"] is False
    assert reproduction(doc(0.85, [0.8, 0.9]), doc(0.85, None))[0]["reproduced"] is None
    assert reproduction(doc(0.85, None, "offload-01"), doc(0.85, None)) == []
    # a row whose engine ran another path in one of the runs gets no verdict
    hybrid, merged = doc(0.9, [0.85, 0.95], "offload-03"), doc(0.9, [0.85, 0.95], "offload-03")
    hybrid["runs"][1]["one_table_layers"], merged["runs"][1]["one_table_layers"] = 11, 16
    [row] = reproduction(merged, hybrid)
    assert row["reproduced"] is None and row["one_table_layers"] == [11, 16]
    rep = {"against": "a", "against_date": "d", "rows": [row]}
    lines = reproduction_lines({"reproduction": rep})
    assert "not the same path (one table on 11 then 16 layers)" in lines[-1]
    assert reproduction(hybrid, hybrid)[0]["reproduced"] is True


def test_a_profile_is_set_beside_its_own_rounds_unpatched_partner():
    from eodev.bench_offload.profiles import _partner_profile

    profs = {
        "unpatched beside a, b (round 2)": "r2",
        "unpatched beside c, a": "r1",
        "unpatched": "alone",
    }
    assert _partner_profile(profs, "a") == "r1"
    assert _partner_profile(profs, "a (round 2)") == "r2"
    assert _partner_profile(profs, "b") == "alone"  # its round-1 partner has no profile
    assert _partner_profile(profs, "c (round 2)") == "alone"


def test_rows_whose_engine_ran_another_path_are_flagged():
    """A first group of five engines on one H200 (2026-12-01) merged only 11 of 16 layers of
    its one-table engines: VRAM ran out while merging and the rest kept two tables. The
    report flags such rows instead of presenting them as offload-03's."""
    from eodev.bench_offload.report import markdown, path_warnings

    def row(config, n, variant=None):
        r = {"config": config, "workload": "fresh", "moe_layers": 16, "one_table_layers": n}
        return r | ({"variant": variant} if variant else {})

    runs = [
        row("unpatched", 0),
        row("offload-02", 0),
        row("offload-03", 11),
        row("offload-03-swap", 16),
        row("offload-03-swap", 15, "offload-03-swap:26"),
        row("offload-02", 3),
        {**row("offload-03", 11), "workload": "repeat"},  # one line per configuration
        {"config": "offload-03", "workload": "fresh"},  # a run from before the count
    ]
    warnings = path_warnings({"runs": runs})
    assert [w.split(" ran with ")[0] for w in warnings] == [
        "WARNING: offload-03",
        "WARNING: offload-03-swap:26",
        "WARNING: offload-02",
    ]
    assert "11 of 16 MoE layers as one table (expected 16)" in warnings[0]
    assert "3 of 16 MoE layers as one table (expected 0)" in warnings[2]
    assert "why the other layers kept two tables" in warnings[0]
    assert "VLLM_EXPERT_ONE_TABLE was on" in warnings[2]
    base = {"suite": "s", "gpu": "g", "date": "d", "command": "c"}
    stats = {
        "host_fraction": 0.1, "decode_tok_s": [1.0], "tpot_ms_p50": 1.0, "tpot_ms_p90": 1.0,
        "ttft_2k_ms": [1.0], "ttft_8k_ms": [1.0], "host_reads_per_token": 0.0,
        "swaps_per_token": 0.0, "startup_s": 1.0, "decode_vs_unpatched": 1.0,
    }  # fmt: skip
    md = markdown({**base, "runs": [{**r, **stats} for r in runs]})
    assert all(w in md for w in warnings)


def test_the_sweep_pairs_both_configurations_at_each_cold_set_size(tmp_path):
    """The sweep: offload-03 with swap against --cpu-offload-gb at every cold-set size
    that both ran, the plain configurations standing for the run's main size."""
    from eodev.bench.sweep import plot_sweep, sweep_lines, sweep_points

    def row(config, size, workload, ratio, fraction):
        variant = {"variant": f"{config}:{size}"} if size != 51 else {}
        return {
            "config": config, "workload": workload, "decode_vs_unpatched": ratio,
            "host_fraction": fraction, "decode_vs_unpatched_range": [ratio - 0.02, ratio + 0.01],
        } | variant  # fmt: skip

    runs = [
        {"config": "unpatched", "workload": "fresh", "decode_vs_unpatched": 1.0},
        row("offload-03-swap", 51, "fresh", 0.99, 0.098),
        row("cpu-offload-gb", 51, "fresh", 0.85, 0.103),
        row("offload-03-swap", 26, "fresh", 1.02, 0.053),
        row("cpu-offload-gb", 26, "fresh", 0.95, 0.060),
        row("offload-03-swap", 205, "fresh", 0.80, 0.40),  # its partner did not run
        {**row("offload-03-swap", 102, "fresh", 0.9, 0.2), "variant": "offload-03-swap:102+stage"},
        row("cpu-offload-gb", 102, "fresh", 0.6, 0.2),  # staging leaves decode as it is
        row("offload-02", 51, "fresh", 0.86, 0.1),
        {**row("offload-03-swap", 51, "fresh", 0.5, 0.098), "variant": "offload-03-swap+hold"},
    ]
    doc = {"gpu": "g", "model": {"host_experts_per_layer": 51}, "runs": runs}
    recorded = {**runs[3], "host_experts_per_layer": 26}  # as runs record it now
    assert sweep_points({**doc, "runs": runs[:3] + [recorded] + runs[4:]}) == sweep_points(doc)
    points = sweep_points(doc)
    assert sorted(points) == [("cpu-offload-gb", "fresh"), ("offload-03-swap", "fresh")]
    swap = points[("offload-03-swap", "fresh")]
    assert [(p["experts_per_layer"], p["ratio"]) for p in swap] == [
        (26, 1.02),
        (51, 0.99),
        (102, 0.9),
    ]
    assert swap[0]["low"] == pytest.approx(1.0) and swap[0]["high"] == pytest.approx(1.03)
    lines = sweep_lines(doc)
    assert "| 26 | fresh | 1.020x (0.053) | 0.950x (0.060) | 1.07x |" in lines
    assert "| 51 | fresh | 0.990x (0.098) | 0.850x (0.103) | 1.16x |" in lines
    assert plot_sweep(doc, tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 1000
    one_point = {**doc, "runs": runs[:3]}
    assert sweep_lines(one_point) == [] and not plot_sweep(one_point, tmp_path / "t.png")


def test_a_bad_compare_with_file_stops_before_any_engine_runs(repo_root, tmp_path):
    """--compare-with is read when the arguments are: a wrong path or a file that is not a
    suite result stops the command at once (exit 2), not after a GPU run's worth of engines."""
    tool = [sys.executable, str(repo_root / "scripts/bench-offload"), "--model", str(tmp_path)]
    not_suite = tmp_path / "other.json"
    not_suite.write_text('{"suite": "x"}')
    for path, says in (
        (tmp_path / "missing.json", "No such file"),
        (not_suite, "not a bench-offload result (no runs)"),
    ):
        out = tmp_path / "o" / "r.json"
        cmd = [*tool, "--compare-with", str(path), "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert "--compare-with" in r.stderr and not out.exists()


def test_rounds_keep_the_round_that_ran_another_path():
    """Merged rounds carry the round furthest from the configuration's path, so that a
    fallback in any round is flagged."""
    from eodev.bench_offload.report import path_warnings
    from eodev.bench_offload.rows import merge_rounds

    def row(config, n):
        return {
            "config": config, "workload": "fresh", "decode_tok_s": [1.0], "tpot_ms_p50": 1.0,
            "tpot_ms_p90": 1.0, "ttft_ms": 1.0, "startup_s": 1.0, "peak_vram_gib": 1.0,
            "peak_host_gib": 1.0, "host_reads_per_token": 0.0, "swaps_per_token": 0.0,
            "ttft_2k_ms": [1.0], "ttft_8k_ms": [1.0], "itl_samples": 1,
            "decode_vs_unpatched": 1.0, "moe_layers": 16, "one_table_layers": n,
        }  # fmt: skip

    assert merge_rounds([row("offload-03", 16), row("offload-03", 11)])["one_table_layers"] == 11
    assert merge_rounds([row("offload-02", 0), row("offload-02", 2)])["one_table_layers"] == 2
    merged = merge_rounds([row("offload-03-swap", 16), row("offload-03-swap", 16)])
    assert merged["one_table_layers"] == 16 and not path_warnings({"runs": [merged]})


def test_the_report_flags_an_unpatched_engine_far_from_the_others():
    """With --group, each unit has its own unpatched engine, all of one configuration. The
    report lists them, and warns about one that decodes more than 10% off their median
    (one run of 2026-12-01: 457 against 594 and 594 tok/s), since every ratio of its unit
    moves with it."""
    from eodev.bench_offload.reproduction import baseline_lines

    def row(variant, fresh, repeat):
        out = []
        for workload, speeds in (("fresh", fresh), ("repeat", repeat)):
            r = {"config": "unpatched", "workload": workload, "decode_tok_s": speeds}
            if variant:
                r["variant"] = variant
            out.append(r)
        return out

    doc = {
        "runs": row(None, [456.7, 482.5, 434.4], [505.2, 512.3, 468.5])
        + row("unpatched (beside a)", [624.1, 514.5, 594.1], [572.3, 557.7, 604.2])
        + row("unpatched (beside b)", [593.8, 615.1, 524.1], [524.2, 559.6, 487.6])
        + [{"config": "offload-02", "workload": "fresh", "decode_tok_s": [100.0]}]
    }
    text = "\n".join(baseline_lines(doc))
    assert "unpatched 456.7 / 505.2" in text and "(1.30x / 1.13x apart)" in text
    warnings = [x for x in text.splitlines() if x.startswith("WARNING")]
    assert warnings == [
        "WARNING: unpatched decoded 23% below the median of this run's unpatched engines "
        "on fresh prompts: the ratios against it are lifted by about as much."
    ]
    assert baseline_lines({"runs": row(None, [1.0], [1.0])}) == []


def test_the_census_difference_leaves_out_alias_ranges():
    """Runs made before the probe left alias ranges out list one-table staging's second
    address of the table's VRAM as tensors (30 GB on a 24-layer model, 2026-12-03): the
    report leaves such groups out of the difference; the slots' real VRAM stays."""
    from eodev.bench_offload.memory import census_diff

    alias = {"shape": [838860800], "dtype": "uint8", "count": 24, "bytes": 24 * 838860800}
    alias["held_by"] = ["AliasRange._base"]
    slot = {"shape": [88080384], "dtype": "uint8", "count": 2, "bytes": 2 * 88080384}
    slot["held_by"] = ["SplitTable._base"]
    base = {"other_bytes": 1000, "top": []}
    mine = {"other_bytes": 1000 + alias["bytes"] + slot["bytes"], "top": [alias, slot]}
    diff = census_diff(mine, base)
    assert diff["extra"] == [slot]
    assert diff["other_bytes_delta"] == slot["bytes"]


def test_the_report_names_what_an_engine_holds_beside_its_weights():
    """From the probe's census of both engines: the extra bytes of a configuration over its
    unpatched engine, and the tensor groups it holds more of (the 72 MB that
    offload-02 held on 2026-12-01, which totals alone could not name)."""
    from eodev.bench_offload.memory import census_diff, census_lines

    kv = {"shape": [2, 4096, 16], "dtype": "bfloat16", "count": 16, "bytes": 4 << 30}
    base = {"other_bytes": (4 << 30) + 1000, "top": [kv]}
    stray = {
        "shape": [51, 20, 1280],
        "dtype": "float16",
        "count": 16,
        "bytes": 16 * 2_611_200,
        "held_by": ["FusedMoEQuantDesc.scale"],
    }
    mine = {"other_bytes": (4 << 30) + 1000 + stray["bytes"], "top": [kv, stray]}
    diff = census_diff(mine, base)
    assert diff["other_bytes_delta"] == stray["bytes"]
    assert diff["extra"] == [stray]  # the KV cache is in both, so not listed
    assert census_diff(mine, None) is None
    assert census_diff(base, base) is None

    rows = [
        {"config": "offload-02", "workload": "fresh", "census_vs_unpatched": diff},
        {"config": "offload-02", "workload": "repeat", "census_vs_unpatched": diff},
        {"config": "offload-01", "workload": "fresh", "census_vs_unpatched": None},
    ]
    lines = [x for x in census_lines({"runs": rows}) if x]
    assert lines == [
        "Beside its weights, offload-02 holds 41.8 MB more GPU memory in tensors than its "
        "unpatched engine: 16 x float16[51, 20, 1280] (41.8 MB, held by "
        "FusedMoEQuantDesc.scale)."
    ]


def test_the_report_names_the_code_that_allocated_it():
    """With EO_ALLOC_HISTORY=1 the probe groups live allocations by the vLLM code that
    made them; the report names the sites where a configuration holds more than its
    unpatched engine (blocks present in both, the KV cache here, are not listed)."""
    from eodev.bench_offload.memory import census_lines, sites_diff

    kv = {"site": "vllm/v1/worker/gpu_model_runner.py:6100 _allocate_kv_cache", "count": 16}
    base = {"other_bytes": 4 << 30, "top": [{**kv, "bytes": 4 << 30, "sizes": [1 << 28]}]}
    stray = {
        "site": "vllm/model_executor/layers/quantization/auto_gptq.py:700 create_weights",
        "count": 32,
        "bytes": 71_942_144,
        "sizes": [1_310_720, 2_621_440],
    }
    mine = {"other_bytes": (4 << 30) + stray["bytes"], "top": [base["top"][0], stray]}
    diff = sites_diff(mine, base)
    assert diff == {"other_bytes_delta": 71_942_144, "extra": [stray]}
    assert sites_diff(mine, None) is None

    rows = [{"config": "offload-02", "workload": "fresh", "alloc_sites_vs_unpatched": diff}]
    assert [x for x in census_lines({"runs": rows}) if x] == [
        "Allocated beside its weights, offload-02 holds 71.9 MB more than its unpatched "
        "engine, made at: vllm/model_executor/layers/quantization/auto_gptq.py:700 "
        "create_weights (+32 blocks, 71.9 MB)."
    ]


def test_reproduction_names_the_baselines_off_their_runs_median(repo_root):
    """Each reproduction row says how far the unpatched engine its ratio divides by sat
    from its run's median unpatched engine, in both runs, read from the committed tables
    (older rows do not name their baseline: its speed is the row's median over its ratio).
    The earlier run's group 1 divided by an engine 23% below its run's median on fresh
    prompts; the later run's did not, and 4 of its 7 misses against the earlier one are those
    rows."""
    from eodev.bench_offload.reproduction import baseline_offset, reproduction, reproduction_lines

    runs = repo_root / RUNS
    h = json.loads((runs / "suite-16l-earlier.json").read_text())
    i = json.loads((runs / "suite-16l.json").read_text())
    rows = {(r["config"], r["workload"]): r for r in reproduction(i, h)}
    before, now = rows[("offload-02", "fresh")]["baseline_off"]
    assert before == pytest.approx(456.7 / 593.8 - 1, abs=2e-3)
    assert now == pytest.approx(0.0, abs=1e-3)
    assert rows[("offload-01", "fresh")]["baseline_off"][1] == pytest.approx(
        530.1 / 590.2 - 1, abs=2e-3
    )
    rep = {"against": "h", "against_date": "d", "rows": list(rows.values())}
    text = "\n".join(reproduction_lines({"reproduction": rep}))
    assert (
        "15 of 22 ratios within that run's per-repeat range; 4 of the 7 outside it divide by "
        "an unpatched engine more than 10% off its run's median." in text
    )
    assert "| offload-02 | fresh | 0.993x (0.940-1.021) | 0.866x (0.827-0.914) | **no** | " in text
    assert "| **-23%** / +0% |" in text
    # one unpatched engine in a run: nothing to compare it with
    lone = {"runs": [r for r in i["runs"] if "variant" not in r]}
    row = next(r for r in lone["runs"] if r["config"] == "offload-02")
    assert baseline_offset(lone, row) is None


def test_per_request_tpot_in_the_report(repo_root):
    """The report gives each engine's per-request TPOT as mean +- standard error and range:
    the suite's group-1 numbers, from its recorded engine runs (the unpatched engine's
    requests ranged 1.38-2.23 ms; --cpu-offload-gb's were steady)."""
    import gzip

    from eodev.bench_offload.report import request_lines

    raw = repo_root / RUNS / "suite-16l"

    def row(config, label):
        [f] = raw.glob(f"{label}-[0-9a-f]*[0-9a-f].json*")
        data = f.read_bytes()
        doc = json.loads(gzip.decompress(data) if f.suffix == ".gz" else data)
        tpot = [x["tpot_ms"] for x in doc["tasks"]["fresh"]["runs"]]
        return {"config": config, "workload": "fresh", "tpot_ms_by_request": tpot}

    rows = [
        row(
            "unpatched", "bench-unpatched-for-offload-02+offload-03+offload-03-swap+cpu-offload-gb"
        ),
        row("offload-03-swap", "bench-offload-03-swap"),
        row("cpu-offload-gb", "bench-cpu-offload-gb"),
        {"config": "offload-02", "workload": "fresh", "tpot_ms_by_request": [2.0]},
    ]
    lines = request_lines({"runs": rows})
    assert "| unpatched | fresh | 18 | 1.723 +- 0.059 | 1.38-2.23 |" in lines
    assert "| offload-03-swap | fresh | 18 | 1.912 +- 0.058 | 1.48-2.20 |" in lines
    assert "| cpu-offload-gb | fresh | 18 | 2.191 +- 0.009 | 2.17-2.30 |" in lines
    assert not any("offload-02" in x for x in lines)  # one request: no spread to give
    assert request_lines({"runs": rows[3:]}) == []


def test_vram_saved_against_the_host_bytes():
    """Unpatched and offload-02 engines recorded on an H200 (16 layers, 51 host experts per
    layer): the report sets the VRAM each saved against the bytes it placed on host, by
    the driver's count and by torch's, the expert weights' block slack and the free bytes
    stranded in partly used segments where the probe recorded them; one table's rows are
    outside torch's allocator."""
    from eodev.bench_offload.memory import vram_saved, vram_saved_lines

    base = {
        "process_vram_bytes": 27_613_200_384,
        "torch_allocated_bytes": 26_671_122_432,
        "torch_reserved_bytes": 26_818_379_776,
        "expert_host_bytes": 0,
        "weight_blocks": {"expert_block_bytes": 1000, "expert_requested_bytes": 1000},
        "stranded_free": {"stranded_bytes": 147_257_344},
    }
    mem = {
        "process_vram_bytes": 25_723_666_432,
        "torch_allocated_bytes": 24_659_326_976,
        "torch_reserved_bytes": 24_901_582_848,
        "expert_host_bytes": 2_083_737_600,
        "weight_blocks": {"expert_block_bytes": 3000, "expert_requested_bytes": 1000},
        "stranded_free": {"stranded_bytes": 314_406_912},
    }
    saved = vram_saved(mem, base)
    assert saved == {
        "host_bytes": 2_083_737_600,
        "process_vram": 1_889_533_952,
        "torch_allocated": 2_011_795_456,
        "torch_reserved": 1_916_796_928,
        "stranded_free": 314_406_912,
        "unpatched_stranded_free": 147_257_344,
        "expert_block_slack": 2000,
        "unpatched_expert_block_slack": 0,
    }
    assert vram_saved(base, base) is None and vram_saved(mem, None) is None
    one_table = {**mem, "one_table_layers": 16}
    assert "torch_allocated" not in vram_saved(one_table, base)
    doc = {"runs": [{"config": "offload-02", "workload": "fresh", "vram_saved": saved}]}
    (line,) = [x for x in vram_saved_lines(doc) if x]
    assert "1,889,533,952 B of the process's VRAM (90.7%)" in line
    assert "2,011,795,456 B of torch's allocated bytes (96.5%)" in line
    assert "1,916,796,928 B of its reserved bytes (92.0%)" in line
    assert "hold 2,000 B more than their tensors asked for (unpatched: 0 B)" in line
    assert "segments it cannot give back: 314,406,912 B (unpatched: 147,257,344 B)" in line
    assert "worst segment" not in line  # the probe named no live block
    # a recorded run's worst segment, with the weights that keep it alive named
    worst = {
        "segment_bytes": 20_971_520,
        "free_bytes": 18_350_080,
        "largest_live_bytes": 2_621_440,
        "pool": "(0, 0)",
        "live": [{"bytes": 2_621_440, "name": "model.layers.3.mlp.gate.weight"}],
    }
    mem["stranded_free"]["top"] = [worst, {**worst, "free_bytes": 1}]
    saved = vram_saved(mem, base)
    assert saved["stranded_worst_segment"] == worst
    doc = {"runs": [{"config": "offload-02", "workload": "fresh", "vram_saved": saved}]}
    (line,) = [x for x in vram_saved_lines(doc) if x]
    assert line.endswith(
        "The worst segment, 20,971,520 B, has 18,350,080 B free beside "
        "model.layers.3.mlp.gate.weight (2,621,440 B)."
    )


def test_ttft_bound_is_the_unpatched_prefill_or_the_host_copy_whichever_is_larger():
    """--copy-gbps: a prompt's bound is unpatched TTFT, or every host expert's bytes once per
    prefill chunk at the copy bandwidth where that is longer (40% of the experts on host)."""
    from eodev.bench import prefill_bound

    row = {
        "config": "offload-02",
        "workload": "fresh",
        "expert_host_gib": 4.0,
        "prefill_chunk_tokens": 2048,
        "ttft_prompt_tokens": {"2k": 2048, "8k": 8192},
        "ttft_unpatched_ms": {"2k": 100.0, "8k": 300.0},
        "ttft_2k_ms": [80.0, 90.0, 120.0],
        "ttft_8k_ms": [500.0, 520.0, 510.0],
    }
    got = prefill_bound.bounds(row, 55.3)
    one_copy = 4 * 2**30 / 55.3e9 * 1e3  # 77.7 ms
    assert got["2k"]["bound_ms"] == 100.0  # unpatched is longer than one copy
    assert got["2k"]["vs_bound"] == pytest.approx(0.9)
    assert got["8k"]["copy_ms"] == pytest.approx(4 * one_copy)
    assert got["8k"]["bound_ms"] == pytest.approx(4 * one_copy)  # four chunks' copies
    assert got["8k"]["vs_bound"] == pytest.approx(510 / (4 * one_copy))
    assert got["8k"]["vs_unpatched"] == pytest.approx(510 / 300)
    # one chunk for the whole prompt: one copy, and the bound is unpatched again
    assert (
        prefill_bound.bounds({**row, "prefill_chunk_tokens": 8192}, 55.3)["8k"]["bound_ms"] == 300
    )
    assert prefill_bound.bounds({**row, "prefill_chunk_tokens": None}, 55.3) == {}


def test_the_report_sets_each_ttft_beside_its_bound(report, repo_root, tmp_path):
    """The committed 8-layer runs with --copy-gbps: the chunk comes from each engine's own
    recorded settings, the unpatched TTFT from its run's unpatched engine."""
    out = tmp_path / "bound.json"
    args = ["--ran-as", "x", "--ran-at", "y", "--copy-gbps", "55.3"]
    subprocess.run(
        from_runs_cmd(repo_root, tmp_path, repo_root / RAW, out, *args),
        check=True,
        capture_output=True,
        cwd=repo_root,
    )
    doc = json.loads(out.read_text())
    runs = {r["config"]: r for r in doc["runs"]}
    o2 = runs["offload-02"]
    assert o2["prefill_chunk_tokens"] == 2048
    b = o2["ttft_vs_bound"]["8k"]
    ref = statistics.median(runs["unpatched"]["ttft_8k_ms"])
    copy = 4 * o2["expert_host_gib"] * 2**30 / 55.3e9 * 1e3
    assert b["bound_ms"] == pytest.approx(max(ref, copy))
    assert b["vs_bound"] == pytest.approx(statistics.median(o2["ttft_8k_ms"]) / max(ref, copy))
    assert "ttft_vs_bound" not in runs["unpatched"]
    md = out.with_suffix(".md").read_text()
    assert "Time to first token against its bound (copy bandwidth 55.3 GB/s" in md
    assert f"| offload-02 | {o2['expert_host_gib']:.2f} | 2048 |" in md
    assert "ttft_vs_bound" not in report[0]["runs"][1]  # without --copy-gbps, no bound


def test_ttft_keeps_each_first_token_and_the_report_compares_them(monkeypatch):
    """The TTFT task keeps the first token of every repeat with its logprob (prefill
    staging changes what a long prompt's prefill reads, and the short decode prompts never
    stage); the report counts them against the unpatched engine's."""
    import types

    from eodev import engine_probe
    from eodev.bench_offload.agreement import prefill_agreement, prefill_agreement_lines

    class LLM:
        def __init__(self, first: int, lp: float):
            self.first, self.lp, self.prompts = first, lp, []

        def generate(self, prompts, params, use_tqdm):
            assert params.max_tokens == 1 and params.logprobs == 1
            ids = prompts[0]["prompt_token_ids"]
            self.prompts.append(ids)
            token = self.first + ids[0]
            lp = {token: types.SimpleNamespace(logprob=self.lp)}
            seq = types.SimpleNamespace(token_ids=[token], logprobs=[lp])
            return [types.SimpleNamespace(outputs=[seq])]

    sampling = types.SimpleNamespace(SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", sampling)
    task = {"prompt": [5, 6, 7, 8], "repeats": 2}
    ref = engine_probe._ttft(LLM(100, -0.5), task)
    assert len(ref["ttft_ms"]) == 2 and ref["prompt_tokens"] == 4
    # warm-up and two repeats, each prompt starting with another token
    assert [f["token_id"] for f in ref["first_tokens"]] == [106, 107, 108]
    same = engine_probe._ttft(LLM(100, -0.75), task)
    other = engine_probe._ttft(LLM(101, -0.5), task)

    def run(t):
        return {"tasks": {"ttft_8k": t, "fresh": {}}}

    base = run(ref)
    assert prefill_agreement(run(same), base) == {
        "ttft_first_tokens_identical_to_unpatched": "3/3",
        "ttft_first_logprob_max_abs_diff": 0.25,
        "ttft_first_logprob_unpatched_spread": 0.0,
    }
    got = prefill_agreement(run(other), base)
    assert got["ttft_first_tokens_identical_to_unpatched"] == "0/3"
    old = {"ttft_ms": [1.0], "prompt_tokens": 4}  # a run made before first tokens were kept
    assert prefill_agreement(run(old), base) == {}
    assert prefill_agreement(base, base) == {}
    rows = [
        {"config": "offload-03-swap", "workload": "fresh", "variant": "offload-03-swap+stage"},
    ]
    rows[0].update(prefill_agreement(run(same), base))
    (line,) = [x for x in prefill_agreement_lines({"runs": rows}) if x]
    assert line.endswith(
        "offload-03-swap+stage 3/3 (logprob max |diff| 0.2500; unpatched's own repeats 0.0000)."
    )
    # an unpatched engine whose long prompt lands on two logprobs over its repeats (seen on
    # 32k prompts): that spread is reported beside the patched engine's difference
    wobbly = {
        "first_tokens": [
            {"token_id": 7, "logprob": -0.9499},
            {"token_id": 7, "logprob": -0.9164},
            {"token_id": 7, "logprob": -0.9499},
            {"token_id": 8, "logprob": -2.0},
        ]
    }
    steady = {
        "first_tokens": [{"token_id": 7, "logprob": -0.9499}] * 3
        + [{"token_id": 9, "logprob": -1.0}]
    }
    got = prefill_agreement(run(steady), run(wobbly))
    assert got["ttft_first_tokens_identical_to_unpatched"] == "3/4"
    assert got["ttft_first_logprob_max_abs_diff"] == pytest.approx(0.0335)
    assert got["ttft_first_logprob_unpatched_spread"] == pytest.approx(0.0335)
