# SPDX-License-Identifier: Apache-2.0
"""KV cache and recurrent state of one pipeline rank for one request at --max-model-len: what
vLLM 0.29.0 checks against --kv-cache-memory-bytes at start-up (v1/core/kv_cache_utils.py:955),
and so what decides whether it starts and how long a request the cache holds.

- QSA main K/V is a `FullAttentionSpec` in VRAM (models/qwen4_exp/nvidia/qsa.py:331-339):
  2 x kv_heads x head_dim x 2 B per token.
- Its compressed index keys one BF16 row of indexer_head_dim per compress_ratio tokens
  (common/qsa_cache.py:784-796), its raw-key ring one block of compress_ratio rows per request
  (:763-781).
- Gated DeltaNet conv + SSM state and the PLE short-conv state are Mamba specs of 2 pages each in
  `--mamba-cache-mode align` (v1/kv_cache_interface.py:883-895), every page padded to the
  attention page of the block size vLLM picks for the hybrid model (platforms/interface.py:767).
- The null block vLLM holds back (one page per layer of a KV group) is not counted: leave a
  margin.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_shape import ModelShape
from .serving import Serving


@dataclass
class KV:
    """KV cache and recurrent state of one rank for one request at max_model_len."""

    qsa_kv: int  # main K/V of the QSA (or plain full-attention) layers
    qsa_index: int  # compressed index keys and raw-key rings
    gdn_state: int  # Gated DeltaNet conv + SSM state
    ple_state: int  # PLE short-conv state
    per_token: int  # bytes per context token on this rank
    fixed: int  # bytes per request that do not grow with the context

    @property
    def one_request(self) -> int:
        return self.qsa_kv + self.qsa_index + self.gdn_state + self.ple_state


def kv_for_rank(shape: ModelShape, layers: range, s: Serving) -> KV:
    """KV of one request at max_model_len on the rank holding `layers`, in whole pages: for a
    hybrid model vLLM picks the attention block size (a multiple of 16 tokens) whose page holds
    the largest Mamba state, and pads every Mamba page to it (platforms/interface.py:767-945);
    the smaller QSA index specs are scaled up to the same page (unify in kv_cache_utils.py)."""
    d = shape.dtype_bytes
    n_full = sum(1 for i in layers if shape.layer_types[i] == "full_attention")
    n_qsa = sum(1 for i in layers if shape.is_qsa_layer(i))
    n_gdn = sum(1 for i in layers if shape.layer_types[i] == "linear_attention")
    n_ple = sum(1 for i in layers if shape.ple_dense_id(i) is not None)
    attn_tok = 2 * shape.num_kv_heads * shape.head_dim * d  # one layer, one token
    kd = shape.linear_num_key_heads * shape.linear_key_head_dim
    vd = shape.linear_num_value_heads * shape.linear_value_head_dim
    gdn_page = (
        (2 * kd + vd) * (shape.linear_conv_kernel_dim - 1)
        + shape.linear_num_value_heads * shape.linear_value_head_dim * shape.linear_key_head_dim
    ) * d
    ple_page = (
        shape.hidden_size * shape.hc_count * (shape.ple_conv_kernel_size - 1) * shape.ngram_size * d
    )
    hybrid = "linear_attention" in shape.layer_types
    mamba_page = max(gdn_page if hybrid else 0, ple_page if shape.ple_layer_ids else 0)
    block = 16
    if mamba_page and attn_tok:
        block = 16 * -(-mamba_page // (16 * attn_tok))
    page = block * attn_tok if mamba_page else 0
    qsa_kv = n_full * -(-s.max_model_len // block) * block * attn_tok
    cr = max(shape.indexer_compress_ratio, 1)
    idx_row = shape.indexer_head_dim * d
    idx_bytes = -(-s.max_model_len // cr) * idx_row  # compressed keys of one layer
    ring = cr * idx_row
    if page:
        idx_bytes = -(-idx_bytes // page) * page
        ring = page
    pages = 2 if s.mamba_cache_mode == "align" else 1
    gdn = n_gdn * pages * (page or gdn_page)
    ple = n_ple * pages * (page or ple_page)
    return KV(
        qsa_kv=qsa_kv,
        qsa_index=n_qsa * (idx_bytes + ring),
        gdn_state=gdn,
        ple_state=ple,
        per_token=n_full * attn_tok + n_qsa * idx_row // cr,
        fixed=n_qsa * ring + gdn + ple,
    )
