# SPDX-License-Identifier: Apache-2.0
"""bench-cpu-experts on a tiny geometry: one result per (experts, tokens per expert), the PCIe
time it is set against, the check that the CPU int4 matmul computes the dequantized MLP (and
that a wrong layout fails it), and bad arguments refused with exit 2.

    scripts/test tests/cpu/test_cpu_experts.py
"""

from __future__ import annotations

import json

import pytest

TINY = ["--hidden", "256", "--expert-width", "64", "--group-size", "32", "--pool", "6"]


def test_each_case_is_timed_beside_its_pcie_time(tmp_path):
    from eodev import cpu_experts

    out = tmp_path / "r.json"
    argv = [*TINY, "--experts", "1,3", "--tokens-per-expert", "1,2", "--repeats", "3"]
    assert cpu_experts.main([*argv, "--row-bytes", "1000000", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(c["experts"], c["tokens_per_expert"]) for c in r["cases"]] == [
        (1, 1),
        (1, 2),
        (3, 1),
        (3, 2),
    ]
    for c in r["cases"]:
        assert len(c["cpu_us"]) == 3 and all(t > 0 for t in c["cpu_us"])
        # experts x row bytes at 49.9 GB/s
        assert c["pcie_us"] == pytest.approx(c["experts"] * 1e6 / 49.9e9 * 1e6)
        assert c["cpu_vs_pcie"] == pytest.approx(c["cpu_us_median"] / c["pcie_us"])
    assert r["check_max_rel_diff"] < 0.02
    assert r["geometry"] == {"hidden": 256, "expert_width": 64, "group_size": 32}


def test_the_check_catches_a_wrong_weight_layout(monkeypatch):
    from eodev import cpu_experts

    assert cpu_experts.check_one_expert(256, 64, 32, seed=1) < 0.02
    right = cpu_experts.dequantized

    def no_offset(q, lin):  # codes read as unsigned, without the -8
        return right(q + 8, lin)

    monkeypatch.setattr(cpu_experts, "dequantized", no_offset)
    assert cpu_experts.check_one_expert(256, 64, 32, seed=1) > 0.1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool", "2", "--experts", "3"], "--pool 2 holds fewer experts than --experts 3"),
        (["--hidden", "100"], "multiples of --group-size"),
        (["--experts", "2,x"], "not a comma-separated list of integers"),
        (["--tokens-per-expert", "0"], "each value must be at least 1"),
    ],
)
def test_bad_arguments_are_refused(capsys, argv, message):
    from eodev import cpu_experts

    with pytest.raises(SystemExit) as e:
        cpu_experts.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
