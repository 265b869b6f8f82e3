"""Who is calling: bearer tokens and/or mTLS client certificates, resolved to a tenant name.

- Tokens (`--auth-tokens-file`): lines `<tenant> <token>` (`#` comments). A call must carry
  `authorization: Bearer <token>`; the token is compared with every known token in
  constant time, so timing reveals neither which token nor how much of one matched.
- mTLS (`--tls-client-ca`): the TLS layer refuses clients without a certificate signed by
  the CA; the certificate's common name is the tenant (unless a token names one).
- Neither: every caller is the one anonymous tenant "".

The tenant owns the jobs it creates (others get NOT_FOUND) and salts its prefix cache.
Health checks stay open (probes carry no credentials); everything else needs a tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from dyngen_client.errors import ErrorReason, Failure

# Health stays open for probes; the Generator's handlers resolve the tenant themselves (and refuse
# without one), so the interceptor guards the rest (reflection) and no call is checked twice.
UNGUARDED = ("/grpc.health.v1.Health/", "/dyngen.v1.Generator/")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class AuthConfigError(Exception):
    """The tokens file is missing or malformed."""


DENIED = "missing or invalid bearer token (send 'authorization: Bearer <token>')"


@dataclass(frozen=True)
class Authenticator:
    tokens: tuple[tuple[str, bytes], ...] = ()  # (tenant, token)
    mtls: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.tokens) or self.mtls

    @staticmethod
    def load(tokens_file: str | None, mtls: bool) -> Authenticator:
        tokens: list[tuple[str, bytes]] = []
        if tokens_file:
            try:
                lines = Path(tokens_file).read_text().splitlines()
            except OSError as exc:
                raise AuthConfigError(f"cannot read the tokens file {tokens_file}: {exc.strerror}") from exc
            for n, raw in enumerate(lines, 1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2 or len(parts[1]) < 16:
                    raise AuthConfigError(
                        f"{tokens_file}:{n}: expected '<tenant> <token>' with a token of 16+ characters"
                    )
                tokens.append((parts[0], parts[1].encode()))
            if not tokens:
                raise AuthConfigError(f"{tokens_file} holds no token")
        return Authenticator(tuple(tokens), mtls)

    def token_tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The tenant whose bearer token the call carries, or None."""
        presented = b""
        for key, value in metadata or ():
            if key.lower() == "authorization":
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if text[:7].lower() == "bearer ":
                    presented = text[7:].strip().encode("latin-1", "replace")
        if not presented:
            return None
        found: str | None = None
        for tenant, token in self.tokens:  # no early exit: every token is compared
            if hmac.compare_digest(presented, token) and found is None:
                found = tenant
        return found

    def tenant(
        self,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        auth_context: Mapping[str, Iterable[bytes]],
    ) -> str | None:
        """The caller's tenant; None when authentication is on and the call proves none."""
        if not self.enabled:
            return ""
        if self.tokens:
            return self.token_tenant(metadata)
        names = list(auth_context.get("x509_common_name", ()))
        return names[0].decode("utf-8", "replace") if names else None

    @property
    def denied(self) -> str:
        """What a refused caller is told it lacks (the same from every RPC)."""
        return DENIED if self.tokens else "no client certificate with a common name (the tenant)"


def cache_salt(tenant: str, salt: str) -> str:
    """The salt the engine mixes into page hashes: tenants never share prefix pages."""
    if not tenant and not salt:
        return ""
    return hashlib.blake2b(f"{tenant}\x00{salt}".encode(), digest_size=16).hexdigest()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to services that do not authenticate by themselves (reflection) without a valid
    bearer token: UNAUTHENTICATED before their handler runs."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNGUARDED):
            return handler
        if self.auth.token_tenant(handler_call_details.invocation_metadata) is not None:
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler[Req, Resp]) -> grpc.RpcMethodHandler[Req, Resp]:
    """A handler of the same shape as `handler` that only refuses."""

    async def deny(request: object, context: grpc.aio.ServicerContext[Req, Resp]) -> None:
        failure = Failure(grpc.StatusCode.UNAUTHENTICATED, DENIED, ErrorReason.UNAUTHENTICATED)
        await context.abort(failure.code, failure.message, failure.trailing_metadata())

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, des, ser)
    return grpc.unary_unary_rpc_method_handler(deny, des, ser)
