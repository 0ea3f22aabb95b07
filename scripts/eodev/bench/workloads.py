# SPDX-License-Identifier: Apache-2.0
"""Prompts and workloads of a suite run.

Prompts come from a file (.jsonl: one object per line with "prompt" (text or token ids) and an
optional "domain"; any other file: one text prompt per line) or from a make-test-model
checkpoint (held-out conversations of every domain of its plan, sent as token ids).

Workloads, per repeat (repeat 0 is the warm-up, never measured):
- fresh: `per_domain` prompts of every domain, each sent once in the whole run: every repeat
  gets its own prompts (cycled, and marked reused, only when a file has too few);
- repeat: the first prompt of every domain, `per_domain` times, the same in every repeat;
- long: one long prompt per stream (`long_tokens` tokens), different in every repeat, sent
  with a fresh cache_salt so that prefix caching cannot shorten its prefill (TTFT).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("fresh", "repeat", "long")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    prompt: str | tuple[int, ...]

    def payload(self) -> str | list[int]:
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    max_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    reused: bool = False


class PromptSource:
    """Prompts per domain, plus a long prompt per repeat."""

    def __init__(self, by_domain: dict[str, list[Prompt]], describe: str):
        if not by_domain or not all(by_domain.values()):
            raise ValueError("no prompts")
        self.by_domain = by_domain
        self.describe = describe

    @property
    def domains(self) -> list[str]:
        return list(self.by_domain)

    def long_prompt(self, index: int, tokens: int) -> tuple[Prompt, dict[str, Any]]:
        """The index-th long prompt and the request fields it needs."""
        flat = [p for ps in self.by_domain.values() for p in ps]
        texts, words, i = [], 0, index
        while words < tokens:  # every word is at least one token in a word-piece vocabulary
            text = flat[i % len(flat)].payload()
            assert isinstance(text, str)
            texts.append(text)
            words += len(text.split())
            i += 1
        prompt = Prompt(f"long-{index}", "long", " ".join(texts))
        # the server keeps exactly `tokens` tokens of it
        return prompt, {"truncate_prompt_tokens": tokens}


class FilePrompts(PromptSource):
    def __init__(self, path: pathlib.Path):
        by_domain: dict[str, list[Prompt]] = {}
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        for n, line in enumerate(lines):
            if path.suffix == ".jsonl":
                row = json.loads(line)
                raw = row.get("prompt", row.get("text"))
                if raw is None:
                    raise ValueError(f"{path}:{n + 1}: no 'prompt' or 'text'")
                domain = str(row.get("domain", "text"))
                value: str | tuple[int, ...] = raw if isinstance(raw, str) else tuple(raw)
            else:
                domain, value = "text", line
            by_domain.setdefault(domain, []).append(
                Prompt(f"{domain}-{len(by_domain[domain])}", domain, value)
            )
        super().__init__(by_domain, f"file {path}")
        self.token_prompts = any(not isinstance(p.prompt, str) for p in self.all())

    def all(self) -> list[Prompt]:
        return [p for ps in self.by_domain.values() for p in ps]

    def long_prompt(self, index: int, tokens: int) -> tuple[Prompt, dict[str, Any]]:
        if self.token_prompts:
            flat = [t for p in self.all() for t in p.prompt]
            start = (index * 7919) % len(flat)
            ids = [flat[(start + j) % len(flat)] for j in range(tokens)]
            return Prompt(f"long-{index}", "long", tuple(ids)), {}
        return super().long_prompt(index, tokens)


class SyntheticPrompts(PromptSource):
    """Held-out conversations of a make-test-model checkpoint, as token ids."""

    def __init__(self, model_dir: pathlib.Path, per_domain: int, length: int, seed: int = 21):
        from ..testmodel import data
        from ..testmodel.plant import load_plan

        self.plan = load_plan(model_dir)
        self.length = length
        by_domain = {
            d: [
                Prompt(f"{d}-{i}", d, tuple(c.token_ids))
                for i, c in enumerate(
                    data.conversations(self.plan, d, "heldout", per_domain, length, seed)
                )
            ]
            for d in self.plan.planting.domains
        }
        super().__init__(by_domain, f"make-test-model {model_dir.name} held-out, seed {seed}")

    def long_prompt(self, index: int, tokens: int) -> tuple[Prompt, dict[str, Any]]:
        from ..testmodel import data

        domains = self.plan.planting.domains
        ids: list[int] = []
        k = 0
        while len(ids) < tokens:
            d = domains[k % len(domains)]
            conv = next(
                data.conversations(self.plan, d, "heldout", 1, 256, seed=1000 + index * 97 + k)
            )
            ids.extend(conv.token_ids)
            k += 1
        return Prompt(f"long-{index}", "long", tuple(ids[:tokens])), {}


def requests(
    source: PromptSource,
    workload: str,
    rep: int,
    per_domain: int,
    streams: int,
    max_tokens: int,
    long_tokens: int,
    long_max_tokens: int,
    salt: str | None,
) -> list[Request]:
    """The requests of one repeat (rep 0: the warm-up) of a workload."""
    out: list[Request] = []
    if workload == "long":
        for s in range(streams):
            prompt, extra = source.long_prompt(rep * streams + s, long_tokens)
            if salt is not None:
                extra = dict(extra, cache_salt=f"{salt}-{rep}-{s}")
            out.append(Request(prompt, long_max_tokens, extra))
        return out
    for j in range(per_domain):
        for ps in source.by_domain.values():
            if workload == "fresh":
                i = rep * per_domain + j
                out.append(Request(ps[i % len(ps)], max_tokens, reused=i >= len(ps)))
            elif workload == "repeat":
                out.append(Request(ps[0], max_tokens))
            else:
                raise ValueError(f"unknown workload {workload!r}; expected one of {WORKLOADS}")
    return out
