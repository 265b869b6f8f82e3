"""`python -m benchmarks WORKLOAD`: run a benchmark and print its table."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("workload", choices=["single"], help="single: single-stream decode tok/s")
    parser.add_argument("--workloads", type=Path, default=None, help="path to workloads.json")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.workload == "single":
        from benchmarks.single_stream import run

        print(run(args.new_tokens, args.workloads))


if __name__ == "__main__":
    main()
