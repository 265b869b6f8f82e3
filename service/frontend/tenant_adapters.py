"""Which LoRA adapters a caller sees, with authentication on: the server's own (--lora, shared)
and the ones its tenant loaded. A tenant's adapter lives in the engine under its name plus "~"
and a digest of the tenant; callers' names cannot hold "~", so no request reaches another
tenant's adapter by naming it. Without authentication every adapter is everyone's."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb

SCOPE = "~"


def caller_name(engine_name: str) -> str:
    """The name a caller gave (the engine's name less any tenant scope)."""
    return engine_name.split(SCOPE, 1)[0]


class TenantAdapters:
    def __init__(self, scoped: bool) -> None:
        self.scoped = scoped
        self._own: dict[str, set[str]] = {}  # tenant -> names it loaded

    def _suffix(self, tenant: str) -> str:
        return SCOPE + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:12]

    def own_name(self, tenant: str, name: str) -> str:
        """The engine's name for an adapter `tenant` loads as `name`."""
        return name + self._suffix(tenant) if self.scoped else name

    def loaded(self, tenant: str, name: str) -> None:
        if self.scoped:
            self._own.setdefault(tenant, set()).add(name)

    def unloaded(self, tenant: str, name: str) -> None:
        if self.scoped:
            self._own.get(tenant, set()).discard(name)

    def engine_name(self, tenant: str, name: str) -> str:
        """What a request's `adapter` names: the tenant's own adapter of that name, else the shared one."""
        if self.scoped and name in self._own.get(tenant, ()):
            return self.own_name(tenant, name)
        return name

    def unloadable_name(self, tenant: str, name: str) -> str | None:
        """The engine's name of an adapter `tenant` may unload (None: none of its own)."""
        if not self.scoped:
            return name
        return self.own_name(tenant, name) if name in self._own.get(tenant, ()) else None

    def visible(self, tenant: str, infos: Iterable[pb.AdapterInfo]) -> list[pb.AdapterInfo]:
        """The adapters `tenant` can name, under the names it gives them."""
        suffix = self._suffix(tenant)
        out: list[pb.AdapterInfo] = []
        for info in infos:
            if self.scoped and not info.shared and not info.name.endswith(suffix):
                continue
            shown = pb.AdapterInfo()
            shown.CopyFrom(info)
            shown.name = caller_name(info.name)
            out.append(shown)
        return sorted(out, key=lambda i: (i.name, not i.shared))
