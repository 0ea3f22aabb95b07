# SPDX-License-Identifier: Apache-2.0
"""Running one unit's engines (alone, or side by side with an unpatched engine of their own),
or with --from-runs finding their results again, and keeping each result with the host reads
per token of where its engine put its experts."""

from __future__ import annotations

import dataclasses
import subprocess

from .. import gpu_harness as gh
from .configs import prepare
from .placement import host_reads_per_token, one_table_placement, uva_placement
from .saved_runs import engine_run
from .suite import Suite, spec_slug, suite_engine


@dataclasses.dataclass
class Collected:
    """The engine results of a run as they come in, by (configuration, round), and the
    configurations that did not run or failed."""

    ran_model: str
    results: dict[tuple[str, int], dict] = dataclasses.field(default_factory=dict)
    not_run: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    # the unpatched engines of the second and later units of a round (--paired, --group),
    # reported as rows of their own: each unit's baseline
    unit_bases: list[str] = dataclasses.field(default_factory=list)
    units_run: int = 0

    def fail(self, member: dict, rnd: int, err: BaseException) -> None:
        """Record a configuration whose engine failed; the others of the run go on."""
        gh.log(f"configuration {member['spec']} (round {rnd}) FAILED: {err}")
        self.failed[member["label"].removeprefix("bench-")] = str(err)[-2000:]


def _unit_from_runs(
    suite: Suite,
    collected: Collected,
    members: list[dict],
    base_label: str,
    group: int,
) -> tuple[dict[str, dict], dict | None]:
    """A unit's engine results found in --from-runs: (results by spec, the unit's unpatched
    engine's result, None without); members without a result are listed as not run."""
    folder = suite.args.from_runs
    got: dict[str, dict] = {}
    base_res = engine_run(folder, base_label) if group else None
    for m in members:
        res = engine_run(folder, m["label"])
        if res is None or (group and base_res is None):
            collected.not_run.append(m["label"].removeprefix("bench-"))
            continue
        collected.ran_model = res.pop("ran_model", None) or collected.ran_model
        got[m["spec"]] = res
    return got, base_res


def _run_group_unit(
    suite: Suite,
    collected: Collected,
    members: list[dict],
    base_label: str,
    rnd: int,
) -> tuple[dict[str, dict], dict | None]:
    """Run a unit's engines side by side with one unpatched engine, all taking turns request
    by request: (results by spec, the unpatched engine's result, None if it failed)."""
    args = suite.args
    base_config = {
        "model": str(args.model),
        "env": {},
        "engine": suite_engine(args),
        "tasks": suite.tasks,
    }
    side = [(base_label, base_config, False, None)] + [
        (m["label"], m["run_config"], m["patched"], m["tree"]) for m in members
    ]
    # the first unit fills a cold compile cache with one engine of each kind before
    # the others start (vLLM's cache index is not written atomically): the
    # unpatched engine and the members up to the first patched one
    first_patched = next((i for i, m in enumerate(members) if m["patched"]), 0)
    stagger = 0 if collected.units_run else 2 + first_patched
    collected.units_run += 1
    try:
        # a unit that hangs is cut off alone; the run's other units still run
        outs = gh.run_engine_group(side, timeout=args.unit_timeout_s, stagger=stagger)
    except subprocess.TimeoutExpired as e:
        outs = [RuntimeError(str(e))] * len(side)
    base_res = None if isinstance(outs[0], Exception) else outs[0]
    got: dict[str, dict] = {}
    for m, out in zip(members, outs[1:], strict=True):
        # one configuration failing must not lose the others of the run; without
        # its unpatched partner none of the unit has a ratio
        err = out if isinstance(out, Exception) else outs[0]
        if isinstance(err, Exception):
            collected.fail(m, rnd, err)
        else:
            got[m["spec"]] = out
    return got, base_res


def _run_alone(collected: Collected, member: dict, rnd: int) -> dict[str, dict]:
    """Run one configuration's engine alone: its result by spec (empty if it failed)."""
    m = member
    try:
        return {m["spec"]: gh.run_engine(m["label"], m["run_config"], m["patched"], tree=m["tree"])}
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        collected.fail(m, rnd, e)
        return {}


def _keep_unit_base(
    collected: Collected,
    base_res: dict,
    members: list[dict],
    got: dict[str, dict],
    unit: list[str],
    rnd: int,
) -> None:
    """Keep a unit's unpatched engine as the round's unpatched row, or (second and later
    units of a round) as a row of its own beside its configurations."""
    base_res["spec"] = dict(config="unpatched", variant="", tree=None, per_layer=None)
    base_res["host_reads_per_token"] = {w: 0.0 for w in ("fresh", "repeat")}
    base_res["partner_of"] = [m["spec"] for m in members if m["spec"] in got]
    if collected.results.setdefault(("unpatched", rnd), base_res) is not base_res:
        label = f"unpatched (beside {', '.join(unit)})"
        collected.results[(label, rnd)] = base_res
        collected.unit_bases += [label] if label not in collected.unit_bases else []


def _keep_member(
    suite: Suite, collected: Collected, m: dict, res: dict, base_res: dict | None, rnd: int
) -> None:
    """Keep one configuration's result with its host reads per token of each workload
    (from where its engine really put host experts)."""
    plan, name, per_layer, placed = suite.plan, m["name"], m["per_layer"], m["placed"]
    if base_res is not None:
        res["paired_base"] = base_res
    res.setdefault("engine_args", m["run_config"]["engine"])
    mem = res["memory"]
    if name.startswith("offload-0") and name != "offload-01":
        suite.host_bytes.setdefault(per_layer, mem["expert_host_bytes"])
    share = None
    if name == "cpu-offload-gb":
        placed, share = uva_placement(mem, plan.geometry.num_layers, suite.every)
    placed = one_table_placement(mem, placed)
    res["host_reads_per_token"] = {}
    for workload, ps in (("fresh", suite.prompts), ("repeat", suite.repeat_prompts)):
        if f"{workload}_tokens" not in res["tasks"]:  # a run made before this workload
            continue
        outs = [o["token_ids"] for o in res["tasks"][f"{workload}_tokens"]["outputs"]]
        res["host_reads_per_token"][workload] = host_reads_per_token(plan, ps, outs, placed, share)
    res["spec"] = {
        "config": name,
        "variant": m["variant"],
        "tree": m["tree"],
        "per_layer": per_layer,
    }
    collected.results[(m["spec"], rnd)] = res


def run_unit(suite: Suite, collected: Collected, rnd: int, unit: list[str], group: int) -> None:
    """Run (or, --from-runs, find) one unit's engines and keep their results."""
    members = [prepare(suite, spec, rnd) for spec in unit]
    in_round = f"-r{rnd}" if rnd > 1 else ""
    base_label = f"bench-unpatched-for-{'+'.join(map(spec_slug, unit))}{in_round}"
    base_res = None
    if suite.args.from_runs:
        got, base_res = _unit_from_runs(suite, collected, members, base_label, group)
    elif group:
        got, base_res = _run_group_unit(suite, collected, members, base_label, rnd)
    else:
        (m,) = members
        got = _run_alone(collected, m, rnd)
    if base_res is not None and got:
        _keep_unit_base(collected, base_res, members, got, unit, rnd)
    for m in members:
        if m["spec"] in got:
            _keep_member(suite, collected, m, got[m["spec"]], base_res, rnd)
