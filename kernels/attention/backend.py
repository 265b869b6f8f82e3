"""The attention seam: one typed dispatch in front of the torch and Triton paths.

A backend is asked once per forward to prepare for a batch (page tables, lengths and
masks are the same for every layer), and the prepared object is then called once per
layer with that layer's queries and cache view (kernels.attention.kv_layer.KVLayer: K/V, and their
scales when the cache is int8). New K/V are written into their page slots
before attention, so a prefill chunk attends to itself as well as to earlier pages.
"""

from __future__ import annotations

import enum
import os
from typing import Protocol, assert_never

import torch

from kernels.attention.batch import AttentionBatch
from kernels.attention.kv_layer import KVLayer


class AttentionKind(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    NATIVE = "native"  # CPU: the native decode kernel for decode steps, torch for the rest


class PreparedAttention(Protocol):
    def write_kv(self, cache: KVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's k, v ([T, kv_heads, head_dim]) into the layer's cache slots
        (quantized there, with their scales, when the cache is int8)."""
        ...

    def attend(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        """q [T, heads, head_dim] against the paged cache -> [T, heads * head_dim] in q's dtype."""
        ...


class AttentionBackend(Protocol):
    def prepare(
        self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> PreparedAttention: ...


def triton_available() -> bool:
    """Whether the triton package imports (it is absent or broken on some hosts)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention_problem(kind: AttentionKind, device: torch.device) -> str | None:
    """Why `kind` cannot run on `device` (a user's flag, refused at load); None if it can."""
    if kind is AttentionKind.AUTO and device.type == "cpu":
        # Native or torch, both run here: resolving it would build the native library now, on the
        # loading thread, instead of beside the weights (2.5 s of a first start).
        return None
    concrete = resolve_attention(kind, device)
    if concrete is AttentionKind.NATIVE and device.type != "cpu":
        return f"--attention native runs on the CPU only, not on {device}"
    if concrete is AttentionKind.TRITON:
        if not triton_available():
            return "--attention triton: the triton package does not import here"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return (
                "--attention triton on the CPU runs only under the Triton interpreter: set "
                "TRITON_INTERPRET=1 (slow; it is how the GPU path is checked without a GPU)"
            )
    return None


def resolve_attention(kind: AttentionKind, device: torch.device) -> AttentionKind:
    """The concrete kind AUTO stands for on `device`: Triton on CUDA when it imports; native on
    the CPU when the native kernels build; else torch."""
    match kind:
        case AttentionKind.AUTO:
            if device.type == "cuda" and triton_available():
                return AttentionKind.TRITON
            if device.type == "cpu":
                from kernels.native.native_library import native_library

                if native_library() is not None:
                    return AttentionKind.NATIVE
            return AttentionKind.TORCH
        case AttentionKind.TORCH | AttentionKind.TRITON | AttentionKind.NATIVE:
            return kind
        case _:
            assert_never(kind)


def select_attention(kind: AttentionKind, device: torch.device) -> AttentionBackend:
    """The backend for a cache on `device`; an explicit kind forces that backend.

    TRITON on a CPU device only runs under TRITON_INTERPRET=1 (the tests' set-up);
    without it the first launch raises with that hint.
    """
    match resolve_attention(kind, device):
        case AttentionKind.TORCH:
            from kernels.attention.torch_attention import TorchPagedAttention

            return TorchPagedAttention()
        case AttentionKind.TRITON:
            # Imported only when chosen: importing decorates the kernels, which reads
            # TRITON_INTERPRET at that moment.
            from kernels.attention.triton_attention import TritonPagedAttention

            return TritonPagedAttention()
        case AttentionKind.NATIVE:
            from kernels.attention.native_attention import NativePagedAttention
            from kernels.native.native_library import native_library, native_unavailable_reason

            lib = native_library()
            if lib is None:
                raise RuntimeError(
                    f"native attention needs the native kernels: {native_unavailable_reason()}"
                )
            return NativePagedAttention(lib)
        case AttentionKind.AUTO:
            raise AssertionError("resolve_attention never returns AUTO")
        case other:
            assert_never(other)
