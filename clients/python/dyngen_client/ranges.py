"""Integer fields checked against their protobuf types before a request is built: protobuf's own
refusal ("Value out of range: -1") names no field, and a caller should learn which one it was."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING

from google.protobuf.descriptor import Descriptor, FieldDescriptor

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_BOUNDS: Mapping[int, tuple[str, int, int]] = {
    FieldDescriptor.TYPE_UINT32: ("uint32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: ("uint64", 0, 2**64 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
}


def check_integers(values: Mapping[str, object], message: Descriptor, path: str = "") -> None:
    """ValueError naming the field (`path` + name, with an index in a repeated field) of the first
    value that its integer field of `message` cannot hold; None values and other fields pass."""
    for name, value in values.items():
        field = message.fields_by_name.get(name)
        if field is None or field.type not in _BOUNDS or value is None:
            continue
        kind, low, high = _BOUNDS[field.type]
        items = list(value) if field.is_repeated and isinstance(value, tuple | list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                where = f"{path}{name}[{i}]" if field.is_repeated else f"{path}{name}"
                raise ValueError(f"{where} must be an integer in [{low}, {high}] ({kind}), got {item!r}")


def check_fields(obj: DataclassInstance, message: Descriptor, path: str = "") -> None:
    """check_integers over a dataclass's fields, each checked against the field of its name."""
    check_integers({f.name: getattr(obj, f.name) for f in fields(obj)}, message, path)
