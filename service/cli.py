"""The `dyngen` command line.

`dyngen generate` runs the model in-process (service/generate_cli.py); `dyngen serve` serves the
model over gRPC; `dyngen cluster` runs replicas behind HAProxy. Errors dyngen raises on purpose
are printed as one line on stderr with exit status 2; nothing is printed as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from engine.errors import DyngenError


class OneLineParser(argparse.ArgumentParser):
    """A refused flag is one line, as every other refusal at start is (argparse's own error prints
    the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `dyngen` parser; a subcommand's own flags are built only for that subcommand (`command`)
    or for all (None), so `dyngen serve` loads nothing of `generate`'s (the client's command line)."""
    from service.config import add_serve_arguments

    parser = OneLineParser(prog="dyngen", description="Serve and run language models with dyngen.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    shows_defaults = argparse.ArgumentDefaultsHelpFormatter  # each flag's help ends with its default
    gen = sub.add_parser(
        "generate", help="run the model in-process and print the completion", formatter_class=shows_defaults
    )
    if command in (None, "generate"):
        from service.generate_cli import add_generate_arguments

        add_generate_arguments(gen)
    serve = sub.add_parser(
        "serve",
        help="serve the model over gRPC (health, reflection, metrics)",
        formatter_class=shows_defaults,
    )
    if command in (None, "serve"):
        add_serve_arguments(serve)
    cluster = sub.add_parser(
        "cluster",
        help="N serve replicas behind HAProxy on this machine (a local try)",
        formatter_class=shows_defaults,
    )
    if command in (None, "cluster"):
        from service.cluster import add_cluster_arguments

        add_cluster_arguments(cluster)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)
    args = build_parser(command).parse_args(words)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "serve":
            from service.config import config_from_args
            from service.device_check import check_device
            from service.engine_spawn import EarlyEngine

            config = config_from_args(args)
            check_device(config.device)  # before anything starts: one line and exit 2 if it is not there
            # The engine's imports are most of a start: they begin now, beside the front end's.
            early = EarlyEngine.start(config.engine_config().to_json())
            from service.frontend.server import main as serve_main

            return serve_main(config, early)
        if args.command == "cluster":
            from service.cluster import run_cluster

            return run_cluster(args)
        from service.generate_cli import CliError, run_generate

        try:
            return run_generate(args)
        except CliError as exc:
            print(f"dyngen: error: {exc}", file=sys.stderr)
            return 2
    except DyngenError as exc:
        print(f"dyngen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
