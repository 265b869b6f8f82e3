"""Llama-family decoder over the paged KV cache.

Plain tensors, no nn.Module: the forward is a straight loop over layers with fused
QKV and gate/up projections (one matmul each instead of three and two; llama_weights.py
builds them). Every token of a flattened batch (prefill chunks and decode steps together)
goes through the same batched ops; only attention looks at sequence boundaries, through
the prepared attention of the kernels dispatch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.cache.kv_cache import KVCacheKind, PagedKVCache
from engine.errors import InvalidRequestError
from engine.forward_batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.llama_weights import FILE_BLOCK_KINDS, LayerWeights, load_weights
from engine.model.packed_store import PackedStore
from engine.model.quantization import LinearPlan
from engine.model.rope import RotaryEmbedding
from engine.model.weight_source import LazyInt4, LazyTensors, WeightSource
from kernels.attention.backend import AttentionBackend, AttentionKind, resolve_attention, select_attention
from kernels.attention.native_attention import NativePagedAttention
from kernels.linear.block_linear import BlockLinear
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.linear_autotune import LinearTuner, TunedLinear, bucket
from kernels.linear.make_linear import Linear, LinearKind
from kernels.native.native_library import (
    CACHE_DTYPES,
    DecodeLayer,
    DecodeStep,
    LayerStack,
    LinearDesc,
    NativeLibrary,
    native_library,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the activations' dtype, as the reference does.
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        attention: AttentionKind = AttentionKind.AUTO,
        plan: LinearPlan | None = None,
        stored_int4: Mapping[str, Int4Groups] | None = None,
        tune_dir: Path | None = None,
        packed: PackedStore | None = None,
    ) -> None:
        """`plan` picks each projection's linear kind (float in `dtype` by default);
        `stored_int4` holds the file's own 4-bit groups by tensor name, used by INT4 linears;
        `tune_dir` is where an autotuned plan caches its choices (default: the user's cache);
        `packed` keeps block linears' packed bytes and the embedding table between starts."""
        self.config = config
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.plan = plan if plan is not None else LinearPlan.uniform(LinearKind.FLOAT)
        w = load_weights(
            config,
            tensors,
            dtype,
            self.device,
            self.plan,
            {} if stored_int4 is None else stored_int4,  # not `or`: a lazy map's truth reads every weight
            tune_dir,
            packed,
        )
        self.embed = w.embed
        self.final_norm = w.final_norm
        self.lm_head: Linear = w.lm_head
        self.layers: list[LayerWeights] = w.layers
        self.tuner: LinearTuner | None = w.tuner
        self._linears_description = w.description
        # What runs (name, activations' dtype, each projection's kind), without the autotune's
        # state: the same at every start of this plan, so it keys timings kept between starts.
        self.timing_key = f"{config.name}|{dtype}|{w.linear_kinds}"
        freq_factors = tensors.get("rope_freqs")
        self.rope = RotaryEmbedding(config, dtype, freq_factors)
        self.rope.to(self.device)
        self.attention: AttentionBackend = select_attention(attention, self.device)
        # The fused Triton kernels (residual add + norm, rotary in place) go with Triton attention.
        self.fused = resolve_attention(attention, self.device) is AttentionKind.TRITON
        # On the CPU in float32 the native kernels do the same fusions (one call each where eager
        # torch runs 3-9 small ops: at one token per step, dispatch costs more than the math).
        self.native: NativeLibrary | None = None
        if not self.fused and self.device.type == "cpu" and dtype == torch.float32:
            self.native = native_library()
        # Per rows bucket, the layers as the step's one native call takes them (None: not possible);
        # for one cache at a time (its tensors are in the descriptions).
        self._decode_layers: dict[int, LayerStack | None] = {}
        self._decode_cache: PagedKVCache | None = None

    @staticmethod
    def from_source(
        source: WeightSource,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        progress: bool = True,
        attention: AttentionKind = AttentionKind.AUTO,
        num_layers: int | None = None,
        plan: LinearPlan | None = None,
        tune_dir: Path | None = None,
        packed: PackedStore | None = None,
    ) -> LlamaModel:
        """Load a model; `num_layers` keeps only the first layers (a cheap draft model of the same vocabulary).

        With INT4 in `plan`, weights the file stores in 4-bit blocks are kept as stored."""
        config = source.config
        if num_layers is not None:
            if not 1 <= num_layers <= config.num_layers:
                raise InvalidRequestError(f"num_layers must be in [1, {config.num_layers}], got {num_layers}")
            config = replace(config, num_layers=num_layers)
        # No bar at all without progress: even a disabled one makes tqdm's multiprocessing lock, a
        # named semaphore that an engine process killed later leaves behind.
        bar = (
            tqdm(
                total=source.tensor_count(),
                desc=f"loading {source.path.name}",
                unit="tensor",
                file=sys.stderr,
                leave=False,
            )
            if progress
            else None
        )
        lazy = source.tensor_map()
        # The last two kept: a tied head asks for the embedding table right after the lookups did.
        tensors = LazyTensors(
            list(lazy),
            functools.lru_cache(maxsize=2)(lazy.__getitem__),
            lambda _: None if bar is None else bar.update(),
        )
        stored: Mapping[str, Int4Groups] = {}
        if plan is not None and any(plan.uses(k) for k in FILE_BLOCK_KINDS):
            stored = LazyInt4(list(tensors), source.stored_int4)
        try:
            return LlamaModel(config, tensors, dtype, device, attention, plan, stored, tune_dir, packed)
        finally:
            if bar is not None:
                bar.close()

    def describe(self) -> str:
        """What runs, for logs and GetModelInfo: activations dtype and each projection's linear kind."""
        return f"{str(self.dtype).removeprefix('torch.')} activations; {self._linears_description}"

    def new_cache(
        self, num_pages: int, page_size: int, kind: KVCacheKind = KVCacheKind.FLOAT
    ) -> PagedKVCache:
        """A cache for this model: K/V in its dtype (FLOAT) or int8 with per-token scales (INT8)."""
        from engine.cache.kv_cache import CacheShape

        c = self.config
        shape = CacheShape(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        return PagedKVCache(shape, self.dtype, self.device, kind)

    @property
    def _native_ops(self) -> NativeLibrary | None:
        """The native fused ops, unless the Triton ones are in use."""
        return None if self.fused else self.native

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._native_ops is not None:
            return self._native_ops.add_rms_norm(x, None, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + delta (the residual stream) and its RMSNorm with `weight`."""
        if self._native_ops is not None:
            # In place into x, which this forward owns (it starts as a copy of the embeddings).
            return x, self._native_ops.add_rms_norm(x, delta.contiguous(), weight, self.config.rms_norm_eps)
        if self.fused:
            from kernels.triton_fused import add_rms_norm

            return x, add_rms_norm(delta, x, weight, self.config.rms_norm_eps)  # adds into x in place
        x = x + delta
        return x, rms_norm(x, weight, self.config.rms_norm_eps)

    def _native_layers(self, rows: int, cache: PagedKVCache) -> LayerStack | None:
        """The layers for `NativeLibrary.decode_layers` at `rows` rows, if every projection runs a
        bias-free block linear there, attention is the native one and the cache is one the fused layer
        writes: float32, float16, bfloat16, or int8 with float16 scales."""
        if self._decode_cache is not cache:
            self._decode_layers, self._decode_cache = {}, cache
        key = bucket(rows)
        if key in self._decode_layers:
            return self._decode_layers[key]

        def desc(lin: Linear) -> LinearDesc | None:
            chosen = lin.for_rows(rows) if isinstance(lin, TunedLinear) else lin
            return chosen.native_desc() if isinstance(chosen, BlockLinear) else None

        layers: list[DecodeLayer] | None = []
        first = cache.layer(0)
        usable = isinstance(self.attention, NativePagedAttention) and (
            first.k.dtype in CACHE_DTYPES or first.quantized
        )
        for i, layer in enumerate(self.layers if usable else []):
            d = [desc(layer.qkv), desc(layer.o), desc(layer.gate_up), desc(layer.down)]
            qkv, o, gate_up, down = d
            if qkv is None or o is None or gate_up is None or down is None or layers is None:
                layers = None
                break
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
            kv = cache.layer(i)
            layers.append(
                DecodeLayer(qkv, o, gate_up, down, layer.ffn_norm, nxt, kv.k, kv.v, kv.k_scale, kv.v_scale)
            )
        self._decode_layers[key] = LayerStack(layers) if usable and layers else None
        return self._decode_layers[key]

    def tile_attention(self, page_size: int) -> bool:
        """Whether a bfloat16 or int8 cache with `page_size` would be attended on AMX tiles (the native
        attention's condition): what `--kv-cache auto` weighs (engine.cache.kv_cache.choose_kv_cache)."""
        c = self.config
        return isinstance(self.attention, NativePagedAttention) and self.attention.tiles_for(
            c.num_heads, c.num_kv_heads, c.head_dim, page_size
        )

    def row_invariant(self, kv_cache: KVCacheKind, page_size: int) -> bool:
        """Whether a token's logits are the same bits however many rows its step carries (so drafts,
        batch neighbours and prefill chunking change no token): every projection and the head are
        block linears, whose native kernels compute each row alone, over the native attention of a
        cache the fused layer writes. Float linears go to BLAS, which rounds apart by row count."""
        if self._native_ops is None or self._native_layers(1, self.new_cache(1, page_size, kv_cache)) is None:
            return False
        head = self.lm_head.for_rows(1) if isinstance(self.lm_head, TunedLinear) else self.lm_head
        return isinstance(head, BlockLinear)

    def _native_decode(self, batch: ForwardBatch, cache: PagedKVCache, native: NativeLibrary) -> torch.Tensor:
        """A step with one native call for all layers (see _native_layers for when): decode rows, and
        chunks (a verification's drafts, short prefills) a token per row."""
        c = self.config
        layers = self._native_layers(batch.num_tokens, cache)
        assert layers is not None
        row_seq, seq_lens = batch.query_rows()
        step = DecodeStep(
            rows=batch.num_tokens,
            positions=batch.positions.contiguous(),
            slots=batch.slot_mapping.contiguous(),
            page_tables=batch.page_tables.contiguous(),
            seq_lens=seq_lens,
            row_seq=row_seq,
            cos=self.rope.cos,
            sin_signed=self.rope.sin_signed,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            page_size=cache.page_size,
            eps=c.rms_norm_eps,
            attn_scale=c.head_dim**-0.5,
        )
        x = self._embed(batch)
        h = self._norm(x, self.layers[0].attn_norm)
        native.decode_layers(step, x, h, layers)
        last = self._norm(x[batch.logits_indices], self.final_norm)
        return self.lm_head(last).to(torch.float32).contiguous()

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's input embeddings: the table's rows, and a job's own vectors where it gave some."""
        x = self.embed[batch.input_ids]
        if batch.embeds is not None:
            rows, values = batch.embeds
            x[rows] = values.to(x.dtype)
        return x

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run one flattened batch; returns contiguous float32 logits [len(logits_indices), vocab]."""
        c = self.config
        native_ops = self._native_ops
        if (
            native_ops is not None
            and batch.lora is None  # the fused layer has no adapter deltas
            and self._native_layers(batch.num_tokens, cache) is not None
        ):
            return self._native_decode(batch, cache, native_ops)
        tokens = batch.num_tokens
        q_size, kv_size = c.q_size, c.kv_size
        attn = self.attention.prepare(batch, c.num_heads, c.num_kv_heads, self.dtype)
        native = self._native_ops
        if native is None:
            cos, sin = self.rope.tables(batch.positions)
        x = self._embed(batch)
        h = self._norm(x, self.layers[0].attn_norm)
        lora = batch.lora
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            if lora is not None:
                lora.apply_(i, "qkv", h, qkv, native)
            if native is not None:
                qkv = qkv.contiguous()
                native.rotary_(
                    qkv,
                    c.num_heads + c.num_kv_heads,
                    c.head_dim,
                    self.rope.cos,
                    self.rope.sin_signed,
                    batch.positions,
                )
                q = qkv[:, :q_size].view(tokens, c.num_heads, c.head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(tokens, c.num_kv_heads, c.head_dim)
            elif self.fused:
                # Imported here, not at the top: importing decorates the kernels, which reads
                # TRITON_INTERPRET (see kernels.attention.backend.select_attention).
                from kernels.triton_fused import rotary_

                qkv = qkv.contiguous()  # the in-place rotary kernel wants head_dim contiguous
                q = qkv[:, :q_size].view(tokens, c.num_heads, c.head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(tokens, c.num_kv_heads, c.head_dim)
                rotary_(q, self.rope.cos, self.rope.sin, batch.positions)
                rotary_(k, self.rope.cos, self.rope.sin, batch.positions)
            else:
                # Q and K heads side by side, rotated by one call.
                qk = qkv[:, : q_size + kv_size].view(tokens, c.num_heads + c.num_kv_heads, c.head_dim)
                qk = self.rope.apply(qk, cos, sin)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_size + kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
            attn.write_kv(cache.layer(i), k, v)
            o = attn.attend(q, cache.layer(i))
            out = layer.o(o)
            if lora is not None:
                lora.apply_(i, "o", o.reshape(tokens, -1), out.view(tokens, -1), native)
            x, h = self._add_norm(x, out, layer.ffn_norm)
            down_lora = lora is not None and lora.touches(i, "down")
            if native is not None:
                gate_up = layer.gate_up(h).contiguous()
                if lora is not None:
                    lora.apply_(i, "gate_up", h, gate_up, native)
                down = layer.down.for_rows(tokens) if isinstance(layer.down, TunedLinear) else layer.down
                if isinstance(down, BlockLinear) and gate_up.dtype is torch.float32 and not down_lora:
                    delta = down.silu_call(gate_up)  # no [tokens, inter] activations in memory
                else:
                    act = native.silu_mul(gate_up)
                    delta = layer.down(act)
            else:
                gate_up = layer.gate_up(h)
                if lora is not None:
                    lora.apply_(i, "gate_up", h, gate_up, native)
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
                delta = layer.down(act)
            if lora is not None and down_lora:
                lora.apply_(i, "down", act, delta, native)
            if i + 1 < len(self.layers):
                x, h = self._add_norm(x, delta, self.layers[i + 1].attn_norm)
            else:
                x = x + delta
        last = self._norm(x[batch.logits_indices], self.final_norm)
        # Row-major whatever layout the head's matmul chose: the sampler reduces along rows,
        # ~5x slower over a transposed view than the copy costs.
        return self.lm_head(last).to(torch.float32).contiguous()
