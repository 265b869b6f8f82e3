"""`python -m benchmarks load`: a gRPC load test that speaks ghz's flags, for where ghz is not installed.

    python -m benchmarks load --insecure --call dyngen.v1.Generator.Generate -c 64 -n 256 \\
        -d '{"text": "Story number {{.RequestNumber}}", "max_new_tokens": 128}' 127.0.0.1:50051

The method's types come from the server's reflection only (no local .proto, no stubs), the
data is rendered per request ({{.RequestNumber}}, {{.WorkerID}}, ...), and the report is
ghz's summary or its JSON (-O json), plus time to first token and inter-token latency for
streams. Defaults are ghz's: -c 50, -n 200, -t 20s, one connection, TLS unless --insecure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpc
from google.protobuf import json_format

from benchmarks.served.load_reflection import ReflectionError, resolve
from benchmarks.served.load_report import make_report, summary, to_json
from benchmarks.served.load_runner import LoadPlan, build_request, run_load
from benchmarks.served.load_template import CallData, TemplateError, check_template, parse_duration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks load",
        description="Load-test a gRPC method found by server reflection; ghz's flags and report.",
    )
    p.add_argument("host", help="HOST:PORT of the server")
    p.add_argument("--call", required=True, help="package.Service.Method (or package.Service/Method)")
    p.add_argument("--insecure", action="store_true", help="plaintext (default: TLS)")
    p.add_argument("--cacert", default=None, help="PEM CA that signed the server (TLS)")
    p.add_argument("--cert", default=None, help="client certificate (mTLS)")
    p.add_argument("--key", default=None, help="client private key (mTLS)")
    p.add_argument("-c", "--concurrency", type=int, default=50, help="workers sending at once (50)")
    p.add_argument("-n", "--total", type=int, default=200, help="requests to send (200); ignored with -z")
    p.add_argument("-z", "--duration", default="0", help="run this long (e.g. 30s, 1m), then stop")
    p.add_argument("-t", "--timeout", default="20s", help="deadline of each call (20s; 0 = none)")
    p.add_argument("-d", "--data", default=None, help="request as JSON; a template ({{.RequestNumber}})")
    p.add_argument("-D", "--data-file", type=Path, default=None, help="request JSON from a file")
    p.add_argument("-m", "--metadata", default=None, help="request metadata as a JSON object (a template)")
    p.add_argument("--connections", type=int, default=1, help="channels the workers share (1)")
    p.add_argument(
        "-O", "--format", choices=["summary", "json", "pretty"], default="summary", help="summary or json"
    )
    p.add_argument("-o", "--output", type=Path, default=None, help="write the report here (default: stdout)")
    return p


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if args.insecure:
        return None

    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(read(args.cacert), read(args.key), read(args.cert))


def plan_from_args(args: argparse.Namespace) -> LoadPlan:
    if args.concurrency < 1 or args.total < 1 or args.connections < 1:
        raise TemplateError("-c, -n and --connections must be at least 1")
    if args.data is not None and args.data_file is not None:
        raise TemplateError("give -d or -D, not both")
    data = args.data_file.read_text() if args.data_file is not None else (args.data or "{}")
    check_template(data)
    if args.metadata:
        check_template(args.metadata)
    duration = parse_duration(args.duration) or None
    timeout = parse_duration(args.timeout) or None
    credentials = _credentials(args)
    channel = (
        grpc.secure_channel(args.host, credentials)
        if credentials is not None
        else grpc.insecure_channel(args.host)
    )
    with channel:
        method = resolve(channel, args.call)
    return LoadPlan(
        target=args.host,
        method=method,
        data=data,
        metadata=args.metadata,
        concurrency=args.concurrency,
        total=None if duration is not None else args.total,
        duration=duration,
        timeout=timeout,
        connections=args.connections,
        credentials=credentials,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
        build_request(plan, CallData(0, "g0c0"))  # data that does not fit the message fails here, once
    except (TemplateError, ReflectionError, OSError, json_format.ParseError, ValueError) as exc:
        print(f"load: error: {exc}", file=sys.stderr)
        return 1
    started = datetime.now(UTC)
    run = asyncio.run(run_load(plan))
    report = make_report(run)
    if args.format == "summary":
        text = summary(report)
    else:
        options: dict[str, object] = {
            "call": args.call,
            "host": args.host,
            "insecure": args.insecure,
            "total": plan.total,
            "concurrency": plan.concurrency,
            "connections": plan.connections,
            "duration": round(plan.duration * 1e9) if plan.duration else 0,
            "timeout": round(plan.timeout * 1e9) if plan.timeout else 0,
            "data": plan.data,
            "metadata": plan.metadata,
        }
        text = to_json(report, options, started)
    if args.output is not None:
        args.output.write_text(text + ("" if text.endswith("\n") else "\n"))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
