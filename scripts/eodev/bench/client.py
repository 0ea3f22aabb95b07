# SPDX-License-Identifier: Apache-2.0
"""Streaming client for an OpenAI-compatible /v1/completions endpoint.

Each request records when it was sent (t0) and, per SSE chunk, its arrival time and how many
tokens it carried. Tokens are counted from the chunk's `token_ids` (vLLM: `return_token_ids`)
or, where a server does not send them, from its `logprobs` entries; never from SSE events.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp

COUNT_MODES = ("token_ids", "logprobs")


def api_headers() -> dict[str, str]:
    """The headers every request carries: the server's API key from VLLM_API_KEY (the
    variable the server and the compose files read), when set."""
    key = os.environ.get("VLLM_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


class RequestFailed(RuntimeError):
    pass


def greedy_body(model: str, prompt: str | list[int], max_tokens: int, seed: int) -> dict:
    """The greedy, fixed-length completion every tool here asks for: temperature 0, a fixed
    seed, no early stop, token ids returned."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def completion_body(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    seed: int,
    count_via: str,
    extra: dict[str, Any] | None = None,
) -> dict:
    """A greedy, fixed-length streaming request (temperature 0, ignore_eos, fixed seed)."""
    body = greedy_body(model, prompt, max_tokens, seed)
    body.update(stream=True, stream_options={"include_usage": True})
    if count_via == "logprobs":
        body["logprobs"] = 0
    body.update(extra or {})
    return body


def chunk_tokens(choice: dict, count_via: str) -> tuple[int | None, list[int] | None]:
    """(tokens in one streamed choice, their ids if sent); (None, None) when the chunk has text
    but nothing to count tokens with."""
    ids = choice.get("token_ids")
    if count_via == "token_ids" and ids is not None:
        return len(ids), list(ids)
    lp = choice.get("logprobs")
    if count_via == "logprobs" and lp is not None:
        return len(lp.get("tokens") or lp.get("token_logprobs") or []), ids
    if not choice.get("text"):
        return 0, []  # e.g. the last chunk, with only a finish reason
    return None, None


async def stream_completion(
    http: aiohttp.ClientSession, base_url: str, body: dict, count_via: str
) -> dict:
    """Send one streaming request; the raw record of what arrived when (perf_counter seconds).

    Record: t0, chunks [[arrival, tokens], ...] (tokens > 0 or first/last only), token_ids,
    text, prompt_tokens, usage, finish_reason, events, count_via, error (None when it worked).
    """
    rec: dict[str, Any] = {
        "count_via": count_via,
        "chunks": [],
        "token_ids": [],
        "text": "",
        "events": 0,
        "prompt_tokens": None,
        "usage": None,
        "finish_reason": None,
        "error": None,
    }
    rec["t0"] = time.perf_counter()
    try:
        async with http.post(base_url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                rec["error"] = f"HTTP {resp.status}: {text[:300]}"
                return rec
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                rec["events"] += 1
                if "error" in event and not event.get("choices"):
                    rec["error"] = f"stream error: {json.dumps(event['error'])[:300]}"
                    return rec
                if event.get("usage"):
                    rec["usage"] = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("prompt_token_ids") is not None:
                        rec["prompt_tokens"] = len(choice["prompt_token_ids"])
                    n, ids = chunk_tokens(choice, count_via)
                    if n is None:
                        rec["error"] = (
                            f"a chunk has text but no {count_via}: cannot count tokens "
                            "(ask the server for token ids or logprobs)"
                        )
                        return rec
                    if n:
                        rec["chunks"].append([now, n])
                        rec["token_ids"].extend(ids or [])
                    rec["text"] += choice.get("text") or ""
                    rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    if rec["error"] is None and not rec["chunks"]:
        rec["error"] = "the stream ended without a token"
    if rec["usage"] and rec["prompt_tokens"] is None:
        rec["prompt_tokens"] = rec["usage"].get("prompt_tokens")
    return rec


async def probe_count_mode(
    http: aiohttp.ClientSession, base_url: str, model: str, prompt: str | list[int]
) -> str:
    """Which way this server lets us count tokens: token_ids if its chunks carry them, else
    logprobs; RequestFailed if neither works."""
    errors = []
    for mode in COUNT_MODES:
        rec = await stream_completion(
            http, base_url, completion_body(model, prompt, 4, 0, mode), mode
        )
        if rec["error"] is None:
            return mode
        errors.append(f"{mode}: {rec['error']}")
    raise RequestFailed("cannot count tokens on this server; " + "; ".join(errors))


def get_json(url: str, timeout: float = 30.0) -> Any:
    req = urllib.request.Request(url, headers=api_headers())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def post_json(url: str, body: dict, timeout: float = 600.0) -> Any:
    """POST a JSON body, return the JSON answer; RequestFailed on an HTTP error."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **api_headers()},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as e:
        raise RequestFailed(f"{url}: HTTP {e.code}: {e.read().decode()[:300]}") from e
    except (urllib.error.URLError, OSError) as e:
        raise RequestFailed(f"{url}: {e}") from e


def served_model(base_url: str) -> str:
    """The first model id /v1/models lists."""
    try:
        models = get_json(base_url.rstrip("/") + "/v1/models")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RequestFailed(f"{base_url}/v1/models: {e}") from e
    data = models.get("data") or []
    if not data:
        raise RequestFailed(f"{base_url}/v1/models lists no model")
    return data[0]["id"]
