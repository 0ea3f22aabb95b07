# SPDX-License-Identifier: Apache-2.0
"""A word-level tokenizer for the synthetic vocabulary, built locally with `tokenizers`.

Words are separated by spaces and each word is one token ("▁word", Metaspace style), so the text
of a conversation encodes back to exactly its token ids and decodes to the same text.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .plant import SPECIAL_TOKENS, Plan

METASPACE = "▁"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def build(plan: Plan) -> Tokenizer:
    vocab = {}
    for i, word in enumerate(plan.vocabulary):
        vocab[word if word in SPECIAL_TOKENS else METASPACE + word] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def save(plan: Plan, out: pathlib.Path, max_length: int) -> None:
    build(plan).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
