# SPDX-License-Identifier: Apache-2.0
"""GPU smoke test: the unpatched pinned vLLM serves a make-test-model INT4 checkpoint (Marlin
MoE, CUDA graphs on) and decodes; the experts its routers pick are the planted ones.

    EO_VLLM_SITE=/tmp/site python3 -m pytest tests/gpu/test_smoke.py -m gpu -s
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import heldout_prompts, plan_of
from eodev import gpu_harness as gh
from eodev.testmodel.stats import cold_share, count_picks_from_ids, least_used

pytestmark = pytest.mark.gpu


def test_unpatched_vllm_serves_the_int4_test_model(int4_model):
    plan = plan_of(int4_model)
    prompts = heldout_prompts(plan)
    res = gh.run_engine(
        "smoke-unpatched",
        {
            "model": str(int4_model),
            "engine": gh.engine(enable_return_routed_experts=True),
            "tasks": [
                {
                    "kind": "greedy",
                    "name": "greedy",
                    "prompts": prompts,
                    "max_tokens": 64,
                    "routed_experts": True,
                    "prompt_logprobs": False,
                },
                {
                    "kind": "decode_timing",
                    "name": "decode",
                    "prompts": prompts[:2],
                    "max_tokens": 128,
                    "warmup": 1,
                    "repeats": 1,
                },
            ],
        },
        patched=False,
    )
    mem = res["memory"]
    assert mem["moe_layers"] == plan.geometry.num_layers
    assert mem["moe_methods"] == ["AutoGPTQMoEMethod"]  # GPTQ INT4 ...
    assert mem["moe_kernels"] == ["MarlinExperts"]  # ... through Marlin MoE
    outs = res["tasks"]["greedy"]["outputs"]

    # greedy decoding follows the planted successor chain
    match = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected = [int(plan.successor[prompt[-1]])]
        while len(expected) < len(out["token_ids"]):
            expected.append(int(plan.successor[expected[-1]]))
        match += sum(a == b for a, b in zip(out["token_ids"], expected, strict=True))
        total += len(expected)
    assert match / total > 0.95, f"{match}/{total} decoded tokens follow the planted chain"

    # the routers pick the planted experts: compare vLLM's own record of every token's picks
    agree = picks = 0
    recorded = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = np.array(out["routed_experts"])  # (tokens, layers, top_k)
        seq = np.array(prompt + out["token_ids"])[: ids.shape[0]]
        for layer in range(plan.geometry.num_layers):
            planned = plan.router_topk(layer, seq)
            agree += sum(len(set(a) & set(b)) for a, b in zip(ids[:, layer], planned, strict=True))
            picks += planned.size
        recorded.append(ids)
    assert agree / picks > 0.97, f"router agreement with the plan {agree / picks:.4f}"

    counts = count_picks_from_ids(np.concatenate(recorded), plan.geometry.num_experts)
    cold = cold_share(least_used(counts, 0.1), counts)
    assert cold < 0.015, f"least-used 10% of experts got {cold:.2%} of the picks"

    decode = res["tasks"]["decode"]
    gh.log(
        f"smoke: start-up {res['startup_s']:.0f} s, decode {decode['decode_tok_s']} tok/s, "
        f"TPOT p50 {decode['tpot_ms_p50']:.2f} ms, router agreement {agree / picks:.4f}, "
        f"planted-chain match {match}/{total}, least-used 10% share {cold:.3%}"
    )
