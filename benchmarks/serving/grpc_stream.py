"""One streamed dyngen Generate with a token-id prompt, through the Python client."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from benchmarks.serving.timing import RequestTiming
from dyngen_client import Client, Request, Sampling

CALL_TIMEOUT = 900.0


def generate(client: Client, prompt: Sequence[int], output_tokens: int) -> RequestTiming:
    request = Request(
        tuple(prompt), max_new_tokens=output_tokens, ignore_eos=True, sampling=Sampling(temperature=0.0)
    )
    sent = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    try:
        for event in client.generate(request, timeout=CALL_TIMEOUT):
            if event.HasField("delta") and event.delta.token_ids:
                chunks.append(time.perf_counter())
                tokens += len(event.delta.token_ids)
            elif event.HasField("finished"):
                tokens = max(tokens, event.finished.new_tokens)
    except grpc.RpcError as exc:
        return RequestTiming(
            sent, tuple(chunks), tokens, output_tokens, f"{exc.code().name}: {exc.details()}"
        )
    return RequestTiming(sent, tuple(chunks), tokens, output_tokens, None)
