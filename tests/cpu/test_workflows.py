# SPDX-License-Identifier: Apache-2.0
"""The GitHub workflows: every action pinned by a full commit SHA (a tag can be moved to other
code; a commit cannot) with its version in a comment, and no job on a self-hosted runner for
a pull request from a fork (its code would run on that machine)."""

from __future__ import annotations

import pathlib
import re

import pytest
from eodev import schemas

WORKFLOWS = sorted(pathlib.Path(__file__).resolve().parents[2].glob(".github/workflows/*.yml"))
USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$")
PINNED = re.compile(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}")
VERSION_COMMENT = re.compile(r"\s+#\s*v\d+(\.\d+)*\s*$")
# the condition that keeps a fork's pull request off a job
SAME_REPOSITORY = "github.event.pull_request.head.repo.full_name == github.repository"


def unpinned_actions(text: str) -> list[str]:
    """The `uses:` lines of a workflow whose action is not pinned by a 40-hex commit with its
    version in a comment (local actions, ./..., need no pin)."""
    bad = []
    for line in text.splitlines():
        m = USES.match(line)
        if not m or m.group(1).startswith("./"):
            continue
        if not (PINNED.fullmatch(m.group(1)) and VERSION_COMMENT.fullmatch(m.group(2))):
            bad.append(line.strip())
    return bad


def triggers(doc: dict) -> set[str]:
    # YAML 1.1 reads the key `on` as True
    on = doc.get("on", doc.get(True))
    if isinstance(on, str):
        return {on}
    return set(on)


def self_hosted(job: dict) -> bool:
    runs_on = job.get("runs-on", [])
    labels = [runs_on] if isinstance(runs_on, str) else list(runs_on)
    return "self-hosted" in labels


def fork_pr_jobs_on_self_hosted(doc: dict) -> list[str]:
    """The self-hosted jobs a pull request from a fork would run."""
    events = triggers(doc)
    if "pull_request_target" in events:  # runs with the base repository's rights: never
        return [name for name, job in doc["jobs"].items() if self_hosted(job)]
    if "pull_request" not in events:
        return []
    return [
        name
        for name, job in doc["jobs"].items()
        if self_hosted(job) and SAME_REPOSITORY not in " ".join(str(job.get("if", "")).split())
    ]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_action_is_pinned_by_commit(path):
    text = path.read_text()
    assert "uses:" in text
    assert unpinned_actions(text) == []


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_no_self_hosted_job_runs_for_a_fork(path):
    doc = schemas.load_yaml(path)
    assert fork_pr_jobs_on_self_hosted(doc) == []
    for job in doc["jobs"].values():  # the checkout leaves no token in .git/config
        for step in job.get("steps", []):
            if str(step.get("uses", "")).startswith("actions/checkout@"):
                assert step.get("with", {}).get("persist-credentials") is False, step


def test_the_image_workflow_runs_its_gpu_job_only_for_this_repository():
    doc = schemas.load_yaml(pathlib.Path(WORKFLOWS[0]).with_name("image.yml"))
    job = doc["jobs"]["gpu-smoke"]
    assert self_hosted(job) and "pull_request" in triggers(doc)
    condition = " ".join(job["if"].split())
    assert condition == f"github.event_name != 'pull_request' || {SAME_REPOSITORY}"


def test_the_checks_catch_mistakes():
    sha = "11bd71901bbe5b1630ceea73d27597364c9af683"
    assert unpinned_actions(f"      - uses: actions/checkout@{sha} # v4.2.2") == []
    for line in (
        "      - uses: actions/checkout@v4",
        f"      - uses: actions/checkout@{sha}",  # no version comment
        f"      - uses: actions/checkout@{sha[:12]} # v4.2.2",  # a short SHA
        "      - uses: docker://alpine:3",
    ):
        assert unpinned_actions(line) == [line.strip()], line
    assert unpinned_actions("      - uses: ./.github/actions/local") == []
    gpu = {"runs-on": ["self-hosted", "gpu"], "steps": []}
    assert fork_pr_jobs_on_self_hosted({"on": {"pull_request": None}, "jobs": {"g": gpu}}) == ["g"]
    assert fork_pr_jobs_on_self_hosted({True: ["push"], "jobs": {"g": gpu}}) == []
    guarded = {**gpu, "if": SAME_REPOSITORY}
    assert fork_pr_jobs_on_self_hosted({"on": ["pull_request"], "jobs": {"g": guarded}}) == []
    target = {"on": ["pull_request_target"], "jobs": {"g": guarded}}
    assert fork_pr_jobs_on_self_hosted(target) == ["g"]
