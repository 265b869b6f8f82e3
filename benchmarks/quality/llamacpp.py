"""llama.cpp's quality on the same file and text, for `python -m benchmarks quality`.

Uses the peers' llama.cpp build (`python -m benchmarks peers --setup-only` makes it) and adds
its two tools to it: `llama-quantize --allow-requantize FILE F32` writes the file's weights
dequantized (llama.cpp's own float reference), and `llama-perplexity --kl-divergence` scores
the Q4_1 file against that reference's stored logits: perplexity ratio, mean KL divergence
and top-1 agreement. Its protocol is its own: its tokenizer, windows of 512 tokens whose
second halves are scored; the text is the same prose.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.llamacpp import LlamaCppPeer
from benchmarks.peers.process import PeerError, run_logged
from benchmarks.peers.run import default_cache_dir

TOOLS = ("llama-perplexity", "llama-quantize")
WINDOW = 512
THREADS = "2"


@dataclass(frozen=True)
class LlamaCppQuality:
    ppl: float
    ppl_ratio: float  # PPL(Q4_1) / PPL(F32)
    kld: float
    top1: float  # "Same top p", a fraction


def parse(output: str) -> LlamaCppQuality:
    """The figures of `llama-perplexity --kl-divergence`'s summary."""

    def number(pattern: str) -> float:
        found = re.search(pattern, output)
        if found is None:
            raise PeerError(f"llama-perplexity printed no {pattern!r}")
        return float(found.group(1))

    return LlamaCppQuality(
        ppl=number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
        ppl_ratio=number(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)"),
        kld=number(r"Mean\s+KLD:\s*([-\d.e]+)"),
        top1=number(r"Same top p:\s*([\d.]+)") / 100,
    )


def measure(model: Path, text: str, tokens: int, cache: Path | None = None) -> LlamaCppQuality:
    """Score `model` (a quantized GGUF) on `text` against its own F32 requantization."""
    peer = LlamaCppPeer((cache or default_cache_dir()) / "llama.cpp")
    build, bin_dir = peer.build, peer.build / "bin"
    if not (build / "CMakeCache.txt").is_file():
        raise PeerError("llama.cpp is not set up: run `python -m benchmarks peers --setup-only` first")
    log = peer.log("quality")
    if not all((bin_dir / t).is_file() for t in TOOLS):
        run_logged(["cmake", "--build", build, "-j", THREADS, "--target", *TOOLS], log, timeout=3600)
    work = peer.root / "quality"
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / f"{model.stem}-F32.gguf"
    if not f32.is_file():
        run_logged([bin_dir / "llama-quantize", "--allow-requantize", model, f32, "F32"], log)
    text_file = work / "prose.txt"
    text_file.write_text(text)
    chunks = str(max(1, tokens // WINDOW))
    base = work / f"{model.stem}-{chunks}.kld"
    common: list[str | Path] = ["-f", text_file, "-c", str(WINDOW), "--chunks", chunks, "-t", THREADS]
    if not base.is_file():
        run_logged([bin_dir / "llama-perplexity", "-m", f32, *common, "--kl-divergence-base", base], log)
    done = subprocess.run(
        [str(c) for c in (bin_dir / "llama-perplexity", "-m", model, *common, "--kl-divergence-base", base)]
        + ["--kl-divergence"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise PeerError(f"llama-perplexity failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse(done.stdout + done.stderr)


def row(model: Path, text: str, tokens: int) -> str:
    """The quality table's llama.cpp row (its columns: plan, linears, perplexity, vs float, KLD,
    top-1, the same over second halves, gate, seconds), or a row saying why there is none. Its
    figures are over second halves of windows: they go in both places."""
    try:
        q = measure(model, text, tokens)
    except (PeerError, OSError, subprocess.SubprocessError) as exc:
        return f"| llama.cpp Q4_1 | not measured: {str(exc).splitlines()[0]} | | | | | | | |"
    return (
        f"| llama.cpp Q4_1 (vs its own F32 of the file; second halves of its windows) | the file's blocks "
        f"| {q.ppl:.3f} | {(q.ppl_ratio - 1) * 100:+.2f}% | {q.kld:.4f} | {q.top1 * 100:.1f}% "
        f"| {q.kld:.4f}, {q.top1 * 100:.1f}% | | |"
    )
