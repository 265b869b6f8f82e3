"""Which LoRA adapters a caller sees, with authentication on: the server's own (--lora, shared)
and the ones its tenant loaded. A tenant's adapter lives in the engine under its name plus "~"
and a digest of the tenant; callers' names cannot hold "~", so no request reaches another
tenant's adapter by naming it. Without authentication every adapter is everyone's."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Mapping

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb

SCOPE = "~"
_DIGEST = 12  # hex digits of the tenant's digest after SCOPE
_SCOPED = re.compile(re.escape(SCOPE) + f"[0-9a-f]{{{_DIGEST}}}")


def caller_name(engine_name: str) -> str:
    """The name a caller gave (the engine's name less any tenant scope)."""
    return engine_name.split(SCOPE, 1)[0]


def unscoped(text: str) -> str:
    """`text` (an engine's message or description) with every adapter named as its caller named it:
    the tenant digests are the service's own and mean nothing to a caller."""
    return _SCOPED.sub("", text)


class TenantAdapters:
    """The names; which adapters a tenant loaded is read from `loads` (the engine client's record of
    LoadAdapter calls, engine name -> folder) and `loading` (its loads in flight), the one place
    that knows it."""

    def __init__(self, scoped: bool, loads: Mapping[str, str], loading: Collection[str] = ()) -> None:
        self.scoped = scoped
        self._loads = loads
        self._loading = loading

    def held(self, tenant: str) -> int:
        """How many adapters `tenant` holds of its own, loaded or loading."""
        suffix = self._suffix(tenant)
        return sum(1 for name in (*self._loads, *self._loading) if name.endswith(suffix))

    def _suffix(self, tenant: str) -> str:
        return SCOPE + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST]

    def own_name(self, tenant: str, name: str) -> str:
        """The engine's name for an adapter `tenant` loads as `name`."""
        return name + self._suffix(tenant) if self.scoped else name

    def _owns(self, tenant: str, name: str) -> bool:
        return self.own_name(tenant, name) in self._loads

    def engine_name(self, tenant: str, name: str) -> str:
        """What a request's `adapter` names: the tenant's own adapter of that name, else the shared one."""
        return self.own_name(tenant, name) if self.scoped and self._owns(tenant, name) else name

    def unloadable_name(self, tenant: str, name: str) -> str | None:
        """The engine's name of an adapter `tenant` may unload (None: none of its own)."""
        if not self.scoped:
            return name
        return self.own_name(tenant, name) if self._owns(tenant, name) else None

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
            shown.description = unscoped(info.description)
            out.append(shown)
        return sorted(out, key=lambda i: (i.name, not i.shared))
