"""`python -m benchmarks serving`: goodput of dyngen, vLLM-CPU and llama.cpp, each behind its own server.

Each engine in turn: its server starts, warms up, and runs every trace's rate sweep (sweep.py);
then it stops and the next starts. The peers are set up as `benchmarks peers` sets them up (in
the same cache directory). Before each sweep the run waits for an idle machine. The report has
a table per trace, a plot of p99 latencies against rate (PNG), and one goodput line per trace.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.idle import wait_for_idle
from benchmarks.peers import llamacpp as peer_llamacpp
from benchmarks.peers import vllm as peer_vllm
from benchmarks.peers.process import PeerError, progress
from benchmarks.peers.run import default_cache_dir
from benchmarks.serving import servers
from benchmarks.serving.sweep import (
    KNEE_STEPS,
    RateResult,
    Slo,
    goodput,
    knee,
    requests_needed,
    sweep,
    warm_up,
)
from benchmarks.serving.trace import TRACES, Trace, build

DYNGEN, VLLM, LLAMACPP = "dyngen", "vLLM-CPU", "llama.cpp"
# The SLO for a 2-core CPU machine: a first token within 2 s (a ~1k-token prompt alone takes
# 0.6-0.7 s to prefill here) and no stream standing still for more than 200 ms (a batch-64
# decode step alone is ~70 ms).
SLO_TTFT = 2.0
SLO_ITL = 0.2


@dataclass(frozen=True)
class Options:
    cache_dir: Path
    traces: tuple[str, ...]
    engines: tuple[str, ...]
    first_rate: float
    max_rate: float
    seconds: float
    slo: Slo
    seed: int
    serve_args: tuple[str, ...]
    vllm_dtype: str
    plot: Path
    workloads: Path | None


@dataclass
class Board:
    results: dict[tuple[str, str], list[RateResult]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _vllm_dtype(choice: str) -> str:
    if choice != "auto":
        return choice
    from kernels.cpu_features import cpu_features

    # bfloat16 where the CPU computes it natively (W1: 1283 vs 800 tok/s in float32 on Zen 5);
    # emulated bfloat16 is 5x slower than float32 (peers.md).
    return "bfloat16" if cpu_features().native_bf16 else "float32"


def _servers(
    options: Options, gguf: Path
) -> Iterator[tuple[str, Callable[[], AbstractContextManager[servers.Send]]]]:
    logs = options.cache_dir / "logs"
    if "dyngen" in options.engines:
        yield DYNGEN, lambda: servers.dyngen(options.serve_args, logs / "serving-dyngen.log")
    if "vllm" in options.engines:
        peer, _ = peer_vllm.setup(options.cache_dir, gguf)
        dtype = _vllm_dtype(options.vllm_dtype)
        yield f"{VLLM} {dtype}", lambda: servers.vllm(peer, dtype, logs / "serving-vllm.log")
    if "llamacpp" in options.engines:
        lpeer, _ = peer_llamacpp.setup(options.cache_dir)
        yield f"{LLAMACPP} Q4_1", lambda: servers.llamacpp(lpeer, gguf)


def _progress_of(what: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        progress(f"{what}: {line}")

    return say


def run(options: Options) -> str:
    from engine.model.shipped_model import default_model_path
    from engine.model.tokenizer import HFTokenizer

    gguf = default_model_path()
    tokenizer = HFTokenizer(gguf)
    count = requests_needed(options.first_rate, options.max_rate, options.seconds)
    traces = {name: build(name, tokenizer, count, options.seed, options.workloads) for name in options.traces}
    board = Board()
    names = iter(_servers(options, gguf))
    while True:
        try:
            got = next(names, None)
        except (PeerError, OSError) as error:
            board.failures.append(str(error).splitlines()[0])
            progress(f"setup FAILED: {error}")
            continue
        if got is None:
            break
        engine, start = got
        progress(f"{engine}: starting its server")
        try:
            with start() as send:
                for name, trace in traces.items():
                    warm_up(send, trace)
                    wait = wait_for_idle(0.15, 120.0)
                    progress(f"{engine} {name}: {wait.describe()}")
                    board.results[(engine, name)] = sweep(
                        send,
                        trace,
                        options.first_rate,
                        options.max_rate,
                        options.seconds,
                        options.slo,
                        options.seed,
                        _progress_of(f"{engine} {name}"),
                    )
        except (PeerError, OSError, SystemExit) as error:
            board.failures.append(f"{engine}: {str(error).splitlines()[0]}")
            progress(f"{engine} FAILED: {error}")
    return report(board, traces, options)


def _table(board: Board, trace: str, slo: Slo) -> list[str]:
    lines = [
        "| engine | offered req/s | served req/s | tok/s | TTFT p50 / p99 s | inter-token p50 / p99 ms "
        "| TPOT p50 ms | errors | SLO |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for (engine, name), results in board.results.items():
        if name != trace:
            continue
        for r in sorted(results, key=lambda r: r.rate):
            lines.append(
                f"| {engine} | {r.rate:.2f} | {r.served_rate:.2f} | {r.tokens / r.seconds:.0f} "
                f"| {r.ttft(50):.2f} / {r.ttft(99):.2f} | {r.itl(50) * 1000:.0f} / {r.itl(99) * 1000:.0f} "
                f"| {r.tpot(50) * 1000:.0f} | {r.errors} | {'yes' if r.meets(slo) else 'no'} |"
            )
    return lines


def _ratio_line(
    board: Board, trace: str, slo: Slo, what: str, measure: Callable[[Sequence[RateResult], Slo], float]
) -> str:
    ours = next((measure(r, slo) for (e, n), r in board.results.items() if e == DYNGEN and n == trace), 0.0)
    peers = [(measure(r, slo), e) for (e, n), r in board.results.items() if e != DYNGEN and n == trace]
    if not peers:
        return f"{what} {trace}: dyngen {ours:.2f} req/s, best peer (none ran) 0.00 req/s, n/a"
    best, name = max(peers)
    ratio = f"{ours / best if best > 0 else math.inf:.2f}x"  # "infx": the peer met the SLO at no rate
    return f"{what} {trace}: dyngen {ours:.2f} req/s, best peer ({name}) {best:.2f} req/s, {ratio}"


def goodput_line(board: Board, trace: str, slo: Slo) -> str:
    """Served requests per second while the SLO held (sweep.goodput), dyngen against the best peer."""
    return _ratio_line(board, trace, slo, "goodput", goodput)


def knee_line(board: Board, trace: str, slo: Slo) -> str:
    """The highest offered rates that met the SLO (sweep.knee), dyngen against the best peer."""
    return _ratio_line(board, trace, slo, "offered knee", knee)


def served_line(board: Board, trace: str, slo: Slo) -> str:
    """Each engine's served rate at its highest SLO-meeting offered rate: how far below the offered
    rate each engine actually completed requests."""
    cells = []
    for (engine, name), results in board.results.items():
        if name != trace:
            continue
        passing = [r for r in results if r.meets(slo)]
        if passing:
            top = max(passing, key=lambda r: r.rate)
            cells.append(f"{engine} {top.served_rate:.2f} req/s at {top.rate:.2f} offered")
        else:
            cells.append(f"{engine} none")
    return f"served at the knee {trace}: " + "; ".join(cells)


def plot(board: Board, traces: Sequence[str], slo: Slo, path: Path) -> str:
    if not traces:
        return "plot: no trace ran"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 2, figsize=(11, 4 * len(traces)), squeeze=False)
    for row, trace in enumerate(traces):
        for col, (what, limit) in enumerate(
            (("TTFT p99 s", slo.ttft_p99), ("inter-token p99 ms", slo.itl_p99 * 1000))
        ):
            ax = axes[row][col]
            for (engine, name), results in board.results.items():
                if name != trace:
                    continue
                ordered = sorted(results, key=lambda r: r.rate)
                ys = [r.ttft(99) if col == 0 else r.itl(99) * 1000 for r in ordered]
                ax.plot([r.rate for r in ordered], ys, marker="o", label=engine)
            ax.axhline(limit, color="grey", linestyle="--", label="SLO")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("offered rate, requests/s")
            ax.set_ylabel(what)
            ax.set_title(f"{trace} trace: {what}")
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot: {path}"


def report(board: Board, traces: dict[str, Trace], options: Options) -> str:
    import torch

    from engine import defaults
    from kernels.cpu_features import cpu_features

    lines = [
        f"CPU: {cpu_features().summary()}",
        f"torch {torch.__version__}; dyngen serve flags: {shlex.join(options.serve_args) or '(defaults)'}",
        f"dyngen's step budget (defaults, unless the flags above set them): --chunk-size "
        f"{defaults.MAX_CHUNK_SIZE} tokens per forward, --prefill-while-decoding "
        f"{defaults.PREFILL_WHILE_DECODING} prompt tokens in a forward with decode steps, --prefill-alone-ms "
        f"{defaults.PREFILL_ALONE_MS:g} of prompt work in one without, all counted from depth 0 (a token at "
        "depth d costs 1 + d/P of one at depth 0, P and a token's time timed at the server's start); "
        f"--prompt-reserve {defaults.PROMPT_RESERVE:g} of it left to shorter prompts",
        f"SLO: {options.slo.describe()}; inter-token = the gap between streamed chunks carrying tokens",
        f"rates double from {options.first_rate:g}/s until one misses the SLO, then {KNEE_STEPS} bisect the "
        "knee (geometric means of the highest pass and lowest miss); "
        f"~{options.seconds:g} s of Poisson arrivals per rate (seed {options.seed}); every request "
        f"greedy, EOS ignored, at most {servers.MAX_RUNNING} running per engine",
    ]
    for name, trace in traces.items():
        lines += ["", f"### {name} trace: {trace.describe()}", "", *_table(board, name, options.slo)]
    lines += ["", plot(board, list(traces), options.slo, options.plot)]
    lines += [f"FAILED {f}" for f in board.failures]
    lines += ["", *(served_line(board, name, options.slo) for name in traces)]
    lines += ["", *(knee_line(board, name, options.slo) for name in traces)]
    lines += ["", *(goodput_line(board, name, options.slo) for name in traces)]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks serving",
        description="served goodput on a chat and an editing trace: dyngen vs vLLM-CPU and llama.cpp servers",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=default_cache_dir(), help="the peers' cache (as `peers`)"
    )
    parser.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated: {', '.join(TRACES)}")
    parser.add_argument("--engines", default="dyngen,vllm,llamacpp", help="comma-separated")
    parser.add_argument("--first-rate", type=float, default=0.25, help="requests/s of the first rate")
    parser.add_argument("--max-rate", type=float, default=32.0)
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--slo-ttft", type=float, default=SLO_TTFT, help="p99 time to first token, s")
    parser.add_argument("--slo-itl", type=float, default=SLO_ITL, help="p99 inter-token latency, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="", help="extra `dyngen serve` flags, one string")
    parser.add_argument("--vllm-dtype", default="auto", help="auto: bfloat16 on a CPU with native bf16")
    parser.add_argument("--plot", type=Path, default=Path("serving.png"))
    parser.add_argument("--workloads", type=Path, default=None)
    args = parser.parse_args(argv)
    options = Options(
        cache_dir=args.cache_dir.expanduser().resolve(),
        traces=tuple(t for t in args.traces.split(",") if t),
        engines=tuple(e for e in args.engines.split(",") if e),
        first_rate=args.first_rate,
        max_rate=args.max_rate,
        seconds=args.seconds,
        slo=Slo(args.slo_ttft, args.slo_itl),
        seed=args.seed,
        serve_args=tuple(shlex.split(args.serve_args)),
        vllm_dtype=args.vllm_dtype,
        plot=args.plot,
        workloads=args.workloads,
    )
    print(run(options))
