# SPDX-License-Identifier: Apache-2.0
"""Is an offload run's output the unpatched server's, up to its own run-to-run noise?

The GPU correctness tests compare engine runs (`eodev.engine_probe` results: per task, the
greedy token ids, their logprobs and the prompt logprobs). Greedy tokens must be identical.
Logprob differences are compared with the largest difference between two runs of the
unpatched server (identical runs, another prefill chunk, another batching), per statistic.

Configurations that run the unpatched server's kernel calls (offload-01: the same call on
host memory; offload-03 with swap off: one call over all experts, rows at fixed positions)
are held to the noise itself. Two kinds change the floating-point work by design, and get
`REORDERED_SUM_TOLERANCE` times the noise:
- offload-02 runs two Marlin calls, each over a subset of the experts, so the kernel tiles a
  row's work differently from the unpatched call (one split layer differs from the whole layer
  by one bf16 ulp; the top-k sum is one reduction since patch 0004): 0.29.0's Marlin MoE
  kernel splits each block's K loop over thread blocks by the number of valid blocks in the
  call (`parallel` in csrc/moe/marlin_moe_wna16/marlin_template.h), and two calls over
  disjoint experts each have fewer than the unsplit call;
- offload-03 with runtime swap moves rows while it runs, so the kernel's blocks run in
  another order from step to step.
Measured on an H200 (2026-12-01, `bench/results/2026-12-05-gpu-tests-h200.md`), those
rounding differences flip a near-tied top-k pick now and then, and a flipped pick moves one
token's logprob by 0.04-0.18: offload-02 decode max 0.061 and offload-03 with swap prompt max
0.175 against unpatched maxima of 0.055 and 0.122, with means at or below the noise's
(except offload-02 at prefill chunk 512: prompt mean 1.6x). A wrong expert row or scale
changes greedy tokens and moves logprobs by whole units, far outside this tolerance.

The reference build measured the same thing: logprob differences against no
offload of 0.005-0.024, against 0.004-0.021 between two no-offload servers, a maximum 1.14x
the noise's; here offload-02 and the swap's decode maxima are 1.11-1.12x (every H200 run
of 2026-12-01 and 2026-12-02). The
tolerance is the decision (2026-12-01) that the target "no larger than the unpatched noise"
holds configurations that reorder sums by design to this bound, not to the noise itself: no
two-call split can meet the noise exactly on 0.29.0's Marlin (above), and offload-03 without
swap, which makes the unpatched call, is held to 1x.

A noise measured from few pairs of engine processes is itself a small sample, and an engine
that runs the same kernels on the same bytes as its reference (prefill staging against no
staging, the PLE table in host memory against it in VRAM, offload-01 and pipeline parallel 2
on Qwen4Exp) is one more sample of it: such checks get `SAME_KERNELS_TOLERANCE`. Measured on
an H200 (2026-12-03, two runs of the Qwen4Exp test model): the decode logprobs of engines
with identical kernels take a few discrete outcomes; the four unpatched pairs' largest decode
difference was 0.0217 in both runs, and the PLE table's engine landed 0.0260 (1.20x) from
the unpatched server in one run and from its in-VRAM twin in the other. Prefill staging
against either of two engines without it was up to 1.13x their one-pair noise
(`tests/cpu/data/h200-runs/`). A wrong row, slot or scale moves logprobs by tenths to whole
units, past this tolerance.

Models with recurrent layers (Qwen4Exp's Gated DeltaNet) are judged by `PER_PROMPT_STATS`:
the maxima as above, and per prompt (decode: per request) the mean difference, its largest
over the prompts. One rounding flip at position p changes the layer's recurrent state, so
every later token of that prompt differs a little: the mean over all tokens of all prompts
then measures where the first flip fell more than how far the outputs drift. Measured on an
H200 (2026-12-03, Qwen4Exp test model, `tests/cpu/data/h200-runs/qwen4exp-tiny-int4/`):
offload-02 matched the unpatched prompt logprobs exactly up to position 240 of the
1,749-token prompt and differed a little on most tokens after it (pooled prompt mean 0.0047,
5x the noise's 0.00094, whose flips fell in 255-token prompts at positions 7 and 39); per
prompt, its largest mean was 0.0064 against the unpatched server's 0.0101.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

STATS = ("decode_max", "decode_mean", "prompt_max", "prompt_mean")
# for models whose recurrent layers carry one flip to every later token (see above)
PER_PROMPT_STATS = ("decode_max", "decode_mean_worst", "prompt_max", "prompt_mean_worst")
# how far past the unpatched noise a configuration that reorders sums may go (see above)
REORDERED_SUM_TOLERANCE = 2.0
# how far past a noise of few pairs an engine with its reference's very kernels may go (above)
SAME_KERNELS_TOLERANCE = 1.5


def diff_runs(a: Mapping, b: Mapping, tasks: Iterable[str] = ("c1", "c2")) -> dict:
    """Token equality and per-token |logprob| differences (decode and prompt) of two runs:
    over all tokens (max, mean) and the largest per-request mean (`*_mean_worst`)."""
    same, dec, pre = True, [], []
    for task in tasks:
        outs = zip(a["tasks"][task]["outputs"], b["tasks"][task]["outputs"], strict=True)
        for x, y in outs:
            same &= x["token_ids"] == y["token_ids"]
            dec.append([abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)])
            pre.append(
                [
                    abs(p - q)
                    for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"], strict=True)
                    if p is not None and q is not None
                ]
            )
    dec, pre = [d for d in dec if d], [d for d in pre if d]
    if not dec or not pre:
        raise ValueError("the runs hold no decode or no prompt logprobs to compare")
    out = {"tokens_identical": same}
    for kind, seqs in (("decode", dec), ("prompt", pre)):
        flat = [d for seq in seqs for d in seq]
        out[f"{kind}_max"] = max(flat)
        out[f"{kind}_mean"] = sum(flat) / len(flat)
        out[f"{kind}_mean_worst"] = max(sum(seq) / len(seq) for seq in seqs)
    return out


def noise(pairs: Mapping[str, tuple[Mapping, Mapping]]) -> dict:
    """The unpatched server's own noise: per statistic, the largest difference between two of
    its runs (`pairs`: name -> (run, run)); every pair's numbers are kept for the report."""
    if not pairs:
        raise ValueError("the noise needs at least one pair of unpatched runs")
    diffs = {name: diff_runs(a, b) for name, (a, b) in pairs.items()}
    keys = dict.fromkeys((*STATS, *PER_PROMPT_STATS))
    return {**{k: max(d[k] for d in diffs.values()) for k in keys}, "pairs": diffs}


def failures(
    diff: Mapping, noise_: Mapping, tolerance: float = 1.0, stats: Iterable[str] = STATS
) -> list[str]:
    """What makes `diff` (offload vs unpatched) more than the noise allows on `stats`; empty
    if nothing. 1e-6 absorbs float32 printing of identical values."""
    if tolerance < 1.0:
        raise ValueError(f"tolerance {tolerance} < 1 would be stricter than the noise itself")
    out = [] if diff["tokens_identical"] else ["greedy tokens differ from the unpatched server"]
    for k in stats:
        bound = tolerance * noise_[k] + 1e-6
        if diff[k] > bound:
            out.append(f"{k} {diff[k]:.4g} > {tolerance:g} x unpatched noise {noise_[k]:.4g}")
    return out
