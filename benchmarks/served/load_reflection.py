"""A method's request and response types from the server's own reflection service.

The load tool never reads a local .proto or the committed stubs: like ghz and grpcurl it asks
the server (grpc.reflection.v1alpha) for the file that defines the service and builds message
classes from those descriptors, so it can call whatever the running server speaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


class ReflectionError(LookupError):
    """The server has no reflection, or no such service or method."""


@dataclass(frozen=True)
class ReflectedMethod:
    path: str  # "/dyngen.v1.Generator/Generate", as it goes on the wire
    request_type: type[Message]
    response_type: type[Message]
    server_streaming: bool
    client_streaming: bool


def split_call(call: str) -> tuple[str, str]:
    """ghz's --call: "package.Service.Method" or "package.Service/Method"."""
    service, sep, method = call.replace("/", ".").rpartition(".")
    if not sep or not service or not method:
        raise ReflectionError(f"--call must be package.Service.Method, got {call!r}")
    return service, method


def resolve(channel: grpc.Channel, call: str, timeout: float = 30.0) -> ReflectedMethod:
    service_name, method_name = split_call(call)
    database = ProtoReflectionDescriptorDatabase(channel)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        services = database.get_services()
    except grpc.FutureTimeoutError:
        raise ReflectionError(f"no connection to the server within {timeout:g} s") from None
    except grpc.RpcError as exc:
        raise ReflectionError(f"server reflection failed: {exc.code().name}: {exc.details()}") from None
    if service_name not in services:
        raise ReflectionError(f"the server has no service {service_name!r} (it has: {', '.join(services)})")
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName(service_name)
    method = service.methods_by_name.get(method_name)
    if method is None:
        known = ", ".join(service.methods_by_name)
        raise ReflectionError(f"{service_name} has no method {method_name!r} (it has: {known})")
    return ReflectedMethod(
        path=f"/{service.full_name}/{method.name}",
        request_type=message_factory.GetMessageClass(method.input_type),
        response_type=message_factory.GetMessageClass(method.output_type),
        server_streaming=method.server_streaming,
        client_streaming=method.client_streaming,
    )
