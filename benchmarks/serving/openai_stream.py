"""One streamed `/v1/completions` call with token-id prompts (vLLM's and llama.cpp's servers).

Plain http.client: each `data:` line of the server-sent events is one chunk; a chunk whose
choice has text counts as carrying tokens. The final usage (stream_options) gives the count.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Sequence

from benchmarks.serving.timing import RequestTiming

CALL_TIMEOUT = 900.0


def complete(port: int, model: str, prompt: Sequence[int], output_tokens: int) -> RequestTiming:
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    counted_chunks = 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            return RequestTiming(sent, (), 0, output_tokens, f"HTTP {reply.status}: {reply.read()[:200]!r}")
        while True:
            line = reply.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            usage = event.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens", tokens))
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                chunks.append(now)
                counted_chunks += 1
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestTiming(sent, tuple(chunks), tokens, output_tokens, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    return RequestTiming(sent, tuple(chunks), tokens or counted_chunks, output_tokens, None)
