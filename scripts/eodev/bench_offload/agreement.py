# SPDX-License-Identifier: Apache-2.0
"""Correctness riding along with the speed figures: each configuration's greedy tokens and
their logprobs, and the first token of every TTFT prompt, against its unpatched engine's; and
the report's lines on where they differ."""

from __future__ import annotations


def agreement(res: dict, base: dict | None, workload: str) -> dict:
    """Greedy tokens and their logprobs against the unpatched run of the same suite run: a
    correctness check riding along with the speed numbers."""
    task = f"{workload}_tokens"
    if base is None or task not in res["tasks"] or task not in base["tasks"]:
        return {}
    same, total, worst, diverged = 0, 0, 0.0, []
    outputs = zip(res["tasks"][task]["outputs"], base["tasks"][task]["outputs"], strict=True)
    for i, (a, b) in enumerate(outputs):
        total += 1
        d = divergence(a, b)
        if d is None:
            same += 1
        else:
            diverged.append({"prompt": i, **d})
        # logprobs of the tokens both chose, up to where they part
        agreed = d["at"] if d else len(a["token_ids"])
        for p, q in zip(a["logprobs"][:agreed], b["logprobs"][:agreed], strict=False):
            worst = max(worst, abs(p - q))
    return {
        "sequences_identical_to_unpatched": f"{same}/{total}",
        "decode_logprob_max_abs_diff": worst,
        "divergences": diverged,
    }


def divergence(a: dict, b: dict) -> dict | None:
    """Where greedy output `a` first leaves the unpatched engine's `b`: the token index,
    both tokens and each engine's logprob of its own token there. Two logprobs a few 1e-4
    apart are a near tie that a rounding difference flipped; a wrong expert row leaves the
    unpatched token far behind. None where the outputs are the same."""
    ta, tb = a["token_ids"], b["token_ids"]
    at = next((k for k, (t, u) in enumerate(zip(ta, tb, strict=False)) if t != u), None)
    if at is None:
        if len(ta) == len(tb):
            return None
        return {"at": min(len(ta), len(tb)), "of": len(tb)}  # one stopped early
    return {
        "at": at,
        "of": len(tb),
        "token": ta[at],
        "unpatched_token": tb[at],
        "logprob": a["logprobs"][at],
        "unpatched_logprob": b["logprobs"][at],
    }


def prefill_agreement(res: dict, base: dict | None) -> dict:
    """The first token of every TTFT prompt (2k, 8k, 32k, every repeat) against the
    unpatched engine's: the check on what prefill staging computed, whose prompts the
    decode workloads' short ones never reach. Empty for runs made before it was kept."""
    if base is None or res is base:
        return {}
    same = total = 0
    worst = spread = 0.0
    for name, task in res["tasks"].items():
        theirs = base["tasks"].get(name, {}).get("first_tokens")
        if not name.startswith("ttft_") or not task.get("first_tokens") or not theirs:
            continue
        for a, b in zip(task["first_tokens"], theirs, strict=True):
            total += 1
            if a["token_id"] == b["token_id"]:
                same += 1
                worst = max(worst, abs(a["logprob"] - b["logprob"]))
        spread = max(spread, _logprob_spread(theirs))
    if not total:
        return {}
    return {
        "ttft_first_tokens_identical_to_unpatched": f"{same}/{total}",
        "ttft_first_logprob_max_abs_diff": worst,
        "ttft_first_logprob_unpatched_spread": spread,
    }


def _logprob_spread(first_tokens: list[dict]) -> float:
    """How far the unpatched engine's own logprobs of one prompt's first token lie apart
    over its repeats (same token only): the yardstick for a patched engine's difference,
    since a long prompt's prefill need not repeat itself bit for bit."""
    by_token: dict[int, list[float]] = {}
    for t in first_tokens:
        by_token.setdefault(t["token_id"], []).append(t["logprob"])
    return max((max(v) - min(v) for v in by_token.values()), default=0.0)


def divergence_lines(doc: dict) -> list[str]:
    """Where each configuration's greedy tokens leave its unpatched engine's: the first
    differing token of each such output, a divergence that repeated prompts share once."""
    out = []
    for r in doc["runs"]:
        seen: dict[tuple, tuple[str, list[int]]] = {}  # divergence -> (text, its prompts)
        for d in r.get("divergences") or []:
            key = tuple(d.get(k) for k in ("at", "of", "token", "unpatched_token"))
            if key not in seen:
                what = f"token {d['at']} of {d['of']}"
                if "token" in d:
                    what += (
                        f": {d['token']} (logprob {d['logprob']:.4f}) against unpatched "
                        f"{d['unpatched_token']} ({d['unpatched_logprob']:.4f}), "
                        f"{abs(d['logprob'] - d['unpatched_logprob']):.4f} apart"
                    )
                seen[key] = (what, [])
            seen[key][1].append(d["prompt"])
        label = f"{r.get('variant', r['config'])}, {r['workload']}"
        for what, prompts in seen.values():
            which = ", ".join(map(str, prompts))
            out.append(f"- {label}, prompt{'s' * (len(prompts) > 1)} {which}: {what}")
    if not out:
        return []
    head = "Where greedy tokens differ from the unpatched engine's (first differing token):"
    return ["", head, *out]


def prefill_agreement_lines(doc: dict) -> list[str]:
    """One sentence: each configuration's first tokens of the TTFT prompts against the
    unpatched engine's."""
    rows = [
        r
        for r in doc["runs"]
        if r["workload"] == "fresh" and r.get("ttft_first_tokens_identical_to_unpatched")
    ]
    if not rows:
        return []

    def one(r: dict) -> str:
        text = (
            f"{r.get('variant', r['config'])} {r['ttft_first_tokens_identical_to_unpatched']} "
            f"(logprob max |diff| {r['ttft_first_logprob_max_abs_diff']:.4f}"
        )
        if r.get("ttft_first_logprob_unpatched_spread") is not None:
            text += f"; unpatched's own repeats {r['ttft_first_logprob_unpatched_spread']:.4f}"
        return text + ")"

    each = "; ".join(one(r) for r in rows)
    return [
        "",
        "First token of every TTFT prompt (each prompt length, every repeat and the "
        f"warm-up), identical to its unpatched engine's: {each}.",
    ]
