# SPDX-License-Identifier: Apache-2.0
"""The GPU correctness tests' verdict (eodev.logprob_noise), on small hand-made runs and on
the engine runs an H200 produced on 2026-12-01 (kept in tests/cpu/data/h200-runs/): the
configurations that keep the unpatched order of sums pass at the noise itself, the two that
reorder sums exceed it and pass within the stated tolerance, and a small fault fails.

    scripts/test tests/cpu/test_logprob_noise.py
"""

from __future__ import annotations

import copy
import pathlib

import pytest
from eodev import logprob_noise as lp
from eodev.bench_offload.saved_runs import engine_run

RUNS = pathlib.Path(__file__).resolve().parent / "data/h200-runs"
NOISE_RUNS = RUNS / "int4-8l-unpatched-noise"
OFFLOAD_RUNS = RUNS / "int4-8l-offload"


def _run(token_ids, logprobs, prompt_logprobs) -> dict:
    out = {"token_ids": token_ids, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    return {"tasks": {"c1": {"outputs": [out]}, "c2": {"outputs": [copy.deepcopy(out)]}}}


def test_diff_runs_counts_every_decode_and_prompt_token_of_both_tasks():
    a = _run([1, 2], [-0.5, -1.0], [None, -2.0, -3.0])
    b = _run([1, 2], [-0.5, -1.25], [None, -2.5, -3.0])
    d = lp.diff_runs(a, b)
    assert d["tokens_identical"]
    assert d["decode_max"] == 0.25 and d["decode_mean"] == pytest.approx(0.125)
    assert d["prompt_max"] == 0.5 and d["prompt_mean"] == pytest.approx(0.25)
    b["tasks"]["c2"]["outputs"][0]["token_ids"] = [1, 3]
    assert not lp.diff_runs(a, b)["tokens_identical"]


def test_failures_name_each_statistic_past_the_noise_times_the_tolerance():
    noise = {"decode_max": 0.05, "decode_mean": 0.002, "prompt_max": 0.1, "prompt_mean": 0.001}
    d = {"tokens_identical": True, **noise, "decode_max": 0.07, "prompt_mean": 0.0015}
    assert lp.failures(d, noise) == [
        "decode_max 0.07 > 1 x unpatched noise 0.05",
        "prompt_mean 0.0015 > 1 x unpatched noise 0.001",
    ]
    assert lp.failures(d, noise, 2.0) == []
    assert lp.failures({**d, "tokens_identical": False}, noise, 2.0) == [
        "greedy tokens differ from the unpatched server"
    ]
    with pytest.raises(ValueError, match="stricter than the noise"):
        lp.failures(d, noise, 0.5)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least one pair"):
        lp.noise({})
    empty = _run([], [], [None])
    with pytest.raises(ValueError, match="no decode or no prompt logprobs"):
        lp.diff_runs(empty, empty)


def _load(folder: pathlib.Path, name: str) -> dict:
    """The committed engine run NAME-KEY (gzip) in `folder`, found as bench-offload does."""
    res = engine_run(folder, name)
    assert res is not None, f"no engine run {name} in {folder}"
    return res


@pytest.fixture(scope="module")
def h200():
    """The five unpatched INT4 runs and the offload runs of the same day, as the GPU test
    pairs them."""
    u = {
        n: _load(NOISE_RUNS, f"int4-unpatched-{n}")
        for n in ("2048", "2048-again", "2048-third", "512", "2048-rebatched")
    }
    noise = lp.noise(
        {
            "same_config": (u["2048"], u["2048-again"]),
            "same_config_2": (u["2048"], u["2048-third"]),
            "same_config_3": (u["2048-again"], u["2048-third"]),
            "prefill_chunk": (u["2048"], u["512"]),
            "batching": (u["2048"], u["2048-rebatched"]),
        }
    )
    return u, noise


@pytest.mark.parametrize(
    "name, unpatched, reorders",
    [
        ("int4-offload01-2048", "2048", False),
        ("int4-onetable-swap-off-2048", "2048", False),
        ("int4-offload02-2048", "2048", True),
        ("int4-offload02-512", "512", True),
        ("int4-onetable-swap-every-step-2048", "2048", True),
    ],
)
def test_h200_runs_pass_at_the_noise_or_within_the_tolerance_when_sums_reorder(
    h200, name, unpatched, reorders
):
    u, noise = h200
    d = lp.diff_runs(_load(OFFLOAD_RUNS, name), u[unpatched])
    assert d["tokens_identical"]
    if not reorders:
        assert lp.failures(d, noise) == []
        return
    # measured: these exceed the unpatched noise (the reason for the tolerance) ...
    assert lp.failures(d, noise) != []
    # ... and stay within the tolerance, with room to spare on every statistic
    assert lp.failures(d, noise, lp.REORDERED_SUM_TOLERANCE) == []
    assert all(d[k] <= 0.9 * lp.REORDERED_SUM_TOLERANCE * noise[k] for k in lp.STATS)


def test_a_small_fault_in_a_few_tokens_fails_even_with_the_tolerance(h200):
    """One wrong expert row in one layer, for a few tokens, moves their logprobs by tenths,
    not by whole units: 0.3 on five decode tokens is past twice the noise's maximum."""
    u, noise = h200
    run = copy.deepcopy(_load(OFFLOAD_RUNS, "int4-onetable-swap-every-step-2048"))
    lps = run["tasks"]["c1"]["outputs"][0]["logprobs"]
    for i in range(5, 10):
        lps[i] -= 0.3
    problems = lp.failures(lp.diff_runs(run, u["2048"]), noise, lp.REORDERED_SUM_TOLERANCE)
    assert problems and problems[0].startswith("decode_max 0.3")


# ---- Qwen4Exp (recurrent Gated DeltaNet layers): the runs of 2026-12-03 ----------------------
Q4_RUNS = RUNS / "qwen4exp-tiny-int4"
# as tests/gpu/test_qwen4exp.py holds them: offload-01 makes the unpatched call; the others
# reorder the INT4 kernel's sums on this geometry (a one-table layer is not bit-exact to the
# unsplit one either: bench/results/2026-12-03-qwen4exp-gpu-h200.md)
Q4_TOLERANCE = {
    "q4-offload01": lp.SAME_KERNELS_TOLERANCE,
    "q4-offload02": lp.REORDERED_SUM_TOLERANCE,
    "q4-onetable": lp.REORDERED_SUM_TOLERANCE,
    "q4-onetable-swap": lp.REORDERED_SUM_TOLERANCE,
}


Q4_UNPATCHED = (
    "q4-unpatched",
    "q4-unpatched-again",
    "q4-unpatched-third",
    "q4-unpatched-rebatched",
)


def _qwen4exp(folder: pathlib.Path, names: tuple[str, ...]) -> tuple[dict, dict]:
    runs = {n: _load(folder, n) for n in Q4_UNPATCHED + names}
    a = runs["q4-unpatched"]
    noise = lp.noise(
        {
            "same_config": (a, runs["q4-unpatched-again"]),
            "same_config_2": (a, runs["q4-unpatched-third"]),
            "same_config_3": (runs["q4-unpatched-again"], runs["q4-unpatched-third"]),
            "batching": (a, runs["q4-unpatched-rebatched"]),
        }
    )
    return runs, noise


@pytest.fixture(scope="module")
def qwen4exp():
    return _qwen4exp(Q4_RUNS, ("q4-ple-gpu", "q4-ple-host", *Q4_TOLERANCE))


@pytest.fixture(scope="module")
def qwen4exp_run2():
    """The same engines again, another day's processes (offload-01 and the PLE pair)."""
    return _qwen4exp(
        RUNS / "qwen4exp-tiny-int4-run2", ("q4-ple-gpu", "q4-ple-host", "q4-offload01")
    )


def test_per_prompt_means_take_the_largest_mean_of_one_request():
    a = _run([1, 2], [-0.5, -1.0], [None, -2.0, -3.0, -4.0])
    b = copy.deepcopy(a)
    b["tasks"]["c1"]["outputs"][0]["prompt_logprobs"][3] = -4.3  # one prompt of the two
    b["tasks"]["c2"]["outputs"][0]["logprobs"][1] = -1.2
    d = lp.diff_runs(a, b)
    assert d["prompt_mean"] == pytest.approx(0.3 / 6) and d["prompt_mean_worst"] == pytest.approx(
        0.1
    )
    assert d["decode_mean"] == pytest.approx(0.2 / 4) and d["decode_mean_worst"] == pytest.approx(
        0.1
    )
    noise = lp.noise({"pair": (a, a)})
    assert set(lp.PER_PROMPT_STATS) <= set(noise)
    assert lp.failures(d, noise, stats=lp.PER_PROMPT_STATS)[1].startswith("decode_mean_worst")


def test_a_flip_in_a_recurrent_layer_moves_every_later_token_of_the_prompt(qwen4exp):
    """Why the pooled mean does not judge Qwen4Exp: offload-02's 1,749-token prompt is exact
    up to one position, then most later tokens differ a little."""
    runs, _ = qwen4exp
    x = runs["q4-offload02"]["tasks"]["c1"]["outputs"][3]["prompt_logprobs"]
    y = runs["q4-unpatched"]["tasks"]["c1"]["outputs"][3]["prompt_logprobs"]
    diff = [abs(p - q) for p, q in zip(x[1:], y[1:], strict=True)]
    first = next(i for i, d in enumerate(diff) if d > 0)
    assert first == 240 and len(diff) == 1749
    after = diff[first:]
    assert sum(d > 0 for d in after) / len(after) > 0.6 and max(after) < 0.2


@pytest.mark.parametrize("name", list(Q4_TOLERANCE))
def test_qwen4exp_runs_pass_per_prompt(qwen4exp, name):
    runs, noise = qwen4exp
    d = lp.diff_runs(runs[name], runs["q4-unpatched"])
    assert d["tokens_identical"]
    assert lp.failures(d, noise, Q4_TOLERANCE[name], lp.PER_PROMPT_STATS) == []
    pooled = lp.failures(d, noise, Q4_TOLERANCE[name])
    # the pooled mean fails offload-02 only: its flip fell early in the longest prompt
    assert pooled == ([] if name != "q4-offload02" else [pooled[0]])
    if name == "q4-offload02":
        assert pooled[0].startswith("prompt_mean 0.004736 > 2 x unpatched noise 0.0009376")


@pytest.mark.parametrize("which", ["run1", "run2"])
def test_the_ple_host_table_passes_as_one_more_sample_of_the_noise(qwen4exp, qwen4exp_run2, which):
    runs, noise = qwen4exp if which == "run1" else qwen4exp_run2
    d = lp.diff_runs(runs["q4-ple-host"], runs["q4-ple-gpu"])
    assert d["tokens_identical"]
    assert lp.failures(d, noise, lp.SAME_KERNELS_TOLERANCE, lp.PER_PROMPT_STATS) == []
    assert (
        lp.failures(
            lp.diff_runs(runs["q4-offload01"], runs["q4-unpatched"]),
            noise,
            lp.SAME_KERNELS_TOLERANCE,
            lp.PER_PROMPT_STATS,
        )
        == []
    )


def test_engines_with_identical_kernels_land_past_a_four_pair_noise(qwen4exp, qwen4exp_run2):
    """Why those checks are not held to the noise itself: the decode logprobs of these engines
    take a few discrete outcomes, and in each run one engine lands on the outcome that the
    four unpatched pairs missed, 0.0260 from its reference against their 0.0217."""
    runs1, noise1 = qwen4exp
    runs2, noise2 = qwen4exp_run2
    host_vs_unpatched_1 = lp.diff_runs(runs1["q4-ple-host"], runs1["q4-unpatched"])
    host_vs_gpu_2 = lp.diff_runs(runs2["q4-ple-host"], runs2["q4-ple-gpu"])
    for d, noise in ((host_vs_unpatched_1, noise1), (host_vs_gpu_2, noise2)):
        assert d["tokens_identical"]
        assert noise["decode_max"] == pytest.approx(0.02169, abs=1e-5)
        assert d["decode_max"] == pytest.approx(0.02595, abs=1e-5)
        problems = lp.failures(d, noise, 1.0, lp.PER_PROMPT_STATS)
        assert problems and problems[0].startswith("decode_max 0.02595 > 1 x")
        assert d["decode_max"] < 0.85 * lp.SAME_KERNELS_TOLERANCE * noise["decode_max"]


STAGING_RUNS = RUNS / "prefill-staging-8l"


@pytest.mark.parametrize("chunk", [512, 2048])
def test_prefill_staging_runs_pass_as_one_more_sample_of_the_noise(chunk):
    """The prefill-staging GPU test's engines (8-layer INT4 model, 64 host experts per
    layer): staged against either unstaged engine lies up to 1.13x past their one-pair
    noise; the tolerance holds both."""
    on, off, again = (
        _load(STAGING_RUNS, f"staging-{n}-{chunk}") for n in ("on", "off", "off-again")
    )
    noise = lp.noise({"same_config": (off, again)})
    assert lp.failures(lp.diff_runs(on, off), noise) != []  # why 1x is not the bound
    for other in (off, again):
        d = lp.diff_runs(on, other)
        assert d["tokens_identical"]
        assert lp.failures(d, noise, lp.SAME_KERNELS_TOLERANCE) == []
        assert all(d[k] <= 1.15 * noise[k] + 1e-6 for k in lp.STATS)


def test_a_stale_slot_fails_the_staging_check():
    """A layer read from the wrong slot for one prompt's chunk: its prompt logprobs move by a
    few tenths, past the tolerance."""
    on, off, again = (_load(STAGING_RUNS, f"staging-{n}-2048") for n in ("on", "off", "off-again"))
    on = copy.deepcopy(on)
    out = on["tasks"]["c1"]["outputs"][1]["prompt_logprobs"]
    for i in range(10, 40):
        if out[i] is not None:
            out[i] -= 0.25
    problems = lp.failures(
        lp.diff_runs(on, off), lp.noise({"same_config": (off, again)}), lp.SAME_KERNELS_TOLERANCE
    )
    assert problems and problems[0].startswith("prompt_max 0.")


@pytest.mark.parametrize("fault", ["five decode tokens", "a whole prompt"])
def test_a_small_fault_still_fails_per_prompt(qwen4exp, fault):
    """A wrong row for a few tokens (0.3 on five decode tokens), or a small error on every
    token of one short prompt from its start (0.03, a scale slightly off): both fail."""
    runs, noise = qwen4exp
    run = copy.deepcopy(runs["q4-offload02"])
    out = run["tasks"]["c1"]["outputs"][0]
    if fault == "five decode tokens":
        out["logprobs"][5:10] = [v - 0.3 for v in out["logprobs"][5:10]]
        want = "decode_max 0.3"
    else:
        out["prompt_logprobs"] = [None if v is None else v - 0.03 for v in out["prompt_logprobs"]]
        want = "prompt_mean_worst 0.03"
    d = lp.diff_runs(run, runs["q4-unpatched"])
    problems = lp.failures(d, noise, lp.REORDERED_SUM_TOLERANCE, lp.PER_PROMPT_STATS)
    assert problems and problems[0].startswith(want), problems
