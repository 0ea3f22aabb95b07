# SPDX-License-Identifier: Apache-2.0
"""The configuration names of the result format (DEVELOPERS.md): one place for every tool;
and bench-offload's --configs entries built on them."""

CONFIGS = (
    "unpatched",
    "cpu-offload-gb",
    "offload-01",
    "offload-02",
    "offload-03",
    "offload-03-swap",
)


def parse_spec(spec: str) -> tuple[str, str, str | None, int | None]:
    """A --configs entry: CONFIG[:N][+count][+churn|+hold|+fast][+stage][+prefetch][@TREE].
    `:N` puts N experts of every layer on host (offload-02/03; for cpu-offload-gb the same bytes);
    `+count` turns the usage-counting hook on; `+churn` makes the runtime swap decide every
    decode step; `+hold` makes it decide as usual with a margin no count reaches (no swap);
    `+fast` makes it decide every step with a 64-step half-life and margin 1 (the setting
    simulate-swap finds best for streams of mixed domains);
    `+stage` turns prefill staging on (VLLM_EXPERT_PREFILL_STAGING=1; offload-02/03);
    `+prefetch` turns decode prefetch on (VLLM_EXPERT_DECODE_PREFETCH=1; offload-03 and
    offload-03-swap, with +stage, whose slots it copies into);
    `@TREE` runs another patched vLLM tree (an A/B of two series in one run)."""
    spec, _, tree = spec.partition("@")
    head, *extras = spec.split("+")
    name, _, size = head.partition(":")
    if name not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}: one of {', '.join(CONFIGS)}")
    per_layer = None
    if size:
        if not size.isdigit() or int(size) < 1:
            raise SystemExit(f"{spec!r}: ':N' needs a number of host experts per layer >= 1")
        if name in ("unpatched", "offload-01"):
            raise SystemExit(f"{spec!r}: {name} has no host experts per layer to set")
        per_layer = int(size)
    for x in extras:
        if x not in ("count", "churn", "hold", "fast", "stage", "prefetch"):
            raise SystemExit(
                f"unknown variant +{x} in {spec!r}: +count, +churn, +hold, +fast, +stage or "
                "+prefetch"
            )
    if "stage" in extras and name not in ("offload-02", "offload-03", "offload-03-swap"):
        raise SystemExit(
            f"+stage needs offload-02, offload-03 or offload-03-swap (prefill staging stages "
            f"host experts), not {name}"
        )
    if "prefetch" in extras and (
        name not in ("offload-03", "offload-03-swap") or "stage" not in extras
    ):
        raise SystemExit(
            f"+prefetch needs offload-03 or offload-03-swap with +stage (decode prefetch "
            f"copies into prefill staging's slots), not {spec!r}"
        )
    policies = [x for x in extras if x in ("churn", "hold", "fast")]
    for x in policies:
        if name != "offload-03-swap":
            raise SystemExit(f"+{x} needs offload-03-swap, not {name}")
    if len(policies) > 1:
        raise SystemExit(f"{spec!r}: +churn, +hold and +fast exclude each other")
    if (extras or tree) and name in ("unpatched", "cpu-offload-gb"):
        raise SystemExit(f"{name} runs unpatched vLLM: no variants")
    return name, "+".join(extras), tree or None, per_layer
