"""Linear weights packed for the native kernels, and float tables dequantized from a file's
blocks, kept between starts of the same model file and mapped back in instead of rebuilt.

A first start splits the file's Q4_1 / Q8_0 blocks, repacks them into the kernels' interleaved
layouts, quantizes the head and dequantizes the embedding table: ~0.7 s of a warm restart on a
2-core CPU, most of it first-touch page faults on fresh memory. The results go into one file in
the model's derived-files folder (torch.save); later starts open it with `torch.load(mmap=True)`,
so the tensors are the page cache's pages: nothing is copied, and replicas of one model on one
machine share them. The file is keyed by the native kernels' source digest (a block struct may
change with it); what it does not hold is built as before and the file is rewritten with it. An
unreadable file is ignored, never trusted half-read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model.derived_files import DerivedFiles
from kernels.linear.block_linear import Int4BlockLinear, Int8BlockLinear
from kernels.linear.linear_autotune import TunedLinear
from kernels.linear.linear_kind import Linear, LinearKind
from kernels.native.native_library import BlockLayout, native_library

logger = logging.getLogger(__name__)


@dataclass
class PackedStore:
    """Tensors by key (a linear's source tensors and kind; a table's name and dtype) in one file."""

    derived: DerivedFiles
    path: Path
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _meta: dict[str, int] = field(default_factory=dict)
    _fresh: set[str] = field(default_factory=set)  # keys built by this load, not read from the file

    @staticmethod
    def open(derived: DerivedFiles | None, version: str) -> PackedStore | None:
        """The store of a model file's derived folder (None without one: nothing is kept)."""
        if derived is None:
            return None
        store = PackedStore(derived, derived.packed(version))
        if store.path.is_file():
            try:
                data = torch.load(store.path, mmap=True, weights_only=True)
                tensors, meta = data["tensors"], data["meta"]
                if not isinstance(tensors, dict) or not isinstance(meta, dict):
                    raise ValueError("not a packed store")
                store._tensors = {str(k): v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
                store._meta = {str(k): int(v) for k, v in meta.items()}
            except Exception as exc:  # a damaged or foreign file: build everything again
                logger.warning("ignoring packed weights %s: %s", store.path, exc)
                store._tensors, store._meta = {}, {}
        return store

    def get(self, key: str) -> tuple[int, torch.Tensor] | None:
        """The tensor kept under `key` and its small integer tag (a block layout), or None."""
        tensor = self._tensors.get(key)
        return None if tensor is None else (self._meta.get(key, 0), tensor)

    def put(self, key: str, tensor: torch.Tensor, tag: int = 0) -> None:
        self._tensors[key] = tensor.detach().contiguous()
        self._meta[key] = tag
        self._fresh.add(key)

    def retain(self, used: Sequence[torch.Tensor]) -> None:
        """Drop what this load built and does not run: an autotune builds every candidate kind
        once, and the losers' bytes would only fill the disk and the next start's map. Entries read
        from the file stay (a draft model built from the first layers uses only some of them)."""
        ptrs = {t.data_ptr() for t in used}
        for key in [k for k in self._fresh if self._tensors[k].data_ptr() not in ptrs]:
            del self._tensors[key]
            del self._meta[key]
            self._fresh.discard(key)

    def save(self) -> None:
        """Write the store again if this load added to it (whole, or not at all)."""
        if not self._fresh:
            return
        data = {"tensors": dict(self._tensors), "meta": dict(self._meta)}
        self.derived.publish_written(self.path, lambda tmp: torch.save(data, tmp))
        self._fresh.clear()


_LAYOUT_BITS = 15
FROM_FILE = 16  # tag bit: an int4 linear's blocks are the file's own (not re-quantized)


def packed_linear(
    kept: tuple[int, torch.Tensor] | None,
    kind: LinearKind,
    shape: tuple[int, int],
    bias: torch.Tensor | None,
) -> Int4BlockLinear | Int8BlockLinear | None:
    """The block linear over bytes a store kept (None: nothing kept, no native kernels, or bytes
    that do not fit the shape, which are then packed again)."""
    lib = native_library()
    if kept is None or lib is None:
        return None
    tag, blocks = kept
    try:
        layout = BlockLayout(tag & _LAYOUT_BITS)
        if kind is LinearKind.INT4_Q8:
            int4 = Int4BlockLinear.from_packed(lib, (layout, blocks), shape, bias)
            int4.from_file = bool(tag & FROM_FILE)
            return int4
        if kind is LinearKind.INT8_Q8:
            return Int8BlockLinear.from_packed(lib, (layout, blocks), shape, bias)
    except ValueError as exc:
        logger.warning("packing again: %s", exc)
    return None


def packed_tensors(linears: Sequence[Linear]) -> list[torch.Tensor]:
    """The packed bytes the given linears (or, for tuned ones, their buckets' winners) run."""
    out: list[torch.Tensor] = []
    for lin in linears:
        for one in lin.bucket_linears() if isinstance(lin, TunedLinear) else (lin,):
            if isinstance(one, Int4BlockLinear | Int8BlockLinear):
                out.append(one.packed[1])
    return out


def keep_linear(store: PackedStore, key: str, linear: Linear) -> None:
    """Keep a block linear's packed bytes under `key` (other kinds are not kept)."""
    if isinstance(linear, Int4BlockLinear):
        from_file = linear.from_file
    elif isinstance(linear, Int8BlockLinear):
        from_file = False
    else:
        return
    layout, blocks = linear.packed
    store.put(key, blocks, layout.value | (FROM_FILE if from_file else 0))


def kept_table(
    store: PackedStore | None, name: str, dtype: torch.dtype, make: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """A float table (the embedding) as kept by `store`, else made and kept."""
    if store is None:
        return make()
    key = f"{name}|{str(dtype).removeprefix('torch.')}"
    kept = store.get(key)
    if kept is not None and kept[1].dtype == dtype:
        # Map every page in now (~60 ms for 113 MB): lookups would otherwise fault rows in as new
        # token ids appear, and the engine's memory would seem to grow for as long as it serves.
        kept[1].view(-1)[:: 4096 // kept[1].element_size()].sum()
        return kept[1]
    table = make()
    store.put(key, table)
    return table
