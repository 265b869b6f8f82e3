"""A Llama model's weights read from a source: each projection's linear kind chosen by the plan.

Fused QKV and gate/up (one matmul each instead of three and two), the file's own 4-bit blocks
kept as stored for a kind that runs them, block linears mapped back from the packed store, and
with an autotuned plan each kind measured per rows bucket. Only the tensors a chosen kind needs
are read (and dequantized).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.device import describe_device
from engine.errors import InvalidRequestError, ModelFormatError
from engine.model.config import ModelConfig
from engine.model.packed_store import PackedStore, keep_linear, kept_table, packed_linear, packed_tensors
from engine.model.quantization import LinearPlan, LinearRole, describe_linears
from kernels.cpu_features import cpu_features
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.linear_autotune import LinearTuner, TuneCache, TuneKey
from kernels.linear.make_linear import Linear, LinearKind, make_linear


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear  # [q + 2 * kv, hidden]
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


@dataclass(frozen=True)
class LlamaWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: Linear
    layers: list[LayerWeights]
    tuner: LinearTuner | None
    description: str  # each projection's linear kind (and the autotune state), for describe()
    linear_kinds: str  # each projection's linear kind alone: the same at every start of this plan


# Kinds that run a file's own 4-bit blocks as they are stored (not re-quantized).
FILE_BLOCK_KINDS = (LinearKind.INT4, LinearKind.INT4_Q8, LinearKind.TRITON_Q4)


def load_weights(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    plan: LinearPlan,
    stored: Mapping[str, Int4Groups],
    tune_dir: Path | None,
    packed: PackedStore | None,
) -> LlamaWeights:
    """The weights of `config`'s layers from `tensors`, activations in `dtype` on `device`
    (see LlamaModel for the arguments)."""
    gpu_kinds = (LinearKind.FLOAT, LinearKind.TRITON_Q4)
    if device.type != "cpu" and any(k not in gpu_kinds for r in LinearRole for k in plan.candidates(r)):
        raise InvalidRequestError(f"only float and triton_q4 linears run on {device}")
    where = config.name

    def get(name: str, shape: tuple[int, ...], as_dtype: torch.dtype = dtype) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{where}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=as_dtype).contiguous()

    def opt(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return get(name, shape) if name in tensors else None

    built: list[tuple[LinearRole, Linear]] = []
    tuner: LinearTuner | None = None
    if plan.autotuned:
        kinds = tuple(dict.fromkeys(k for r in LinearRole for k in plan.candidates(r)))
        gpu = describe_device(device) if device.type != "cpu" else None
        key = TuneKey.make(cpu_features(), f"{config.name}|{dtype}", kinds, gpu)
        tuner = LinearTuner(TuneCache(key, tune_dir), device)

    def linear(
        role: LinearRole, parts: list[tuple[str, tuple[int, ...]]], bias: torch.Tensor | None = None
    ) -> Linear:
        """One linear over the row-wise concatenation of `parts` (fused QKV, gate/up)."""
        kinds = plan.candidates(role)
        # Quantized kinds quantize from the float32 values, not from a bfloat16 copy.
        as_dtype = dtype if kinds == (LinearKind.FLOAT,) else torch.float32
        shape = (sum(s[0] for _, s in parts), parts[0][1][1])

        @functools.cache
        def exact() -> Int4Groups | None:
            # Split from the file's blocks only for a kind that runs them (and is not kept packed).
            groups = [stored.get(n) for n, _ in parts]
            return Int4Groups.cat([g for g in groups if g is not None]) if all(groups) else None

        @functools.cache
        def weight() -> torch.Tensor:
            # Read (and dequantized) only for a kind that needs the float values.
            weights = [get(n, s, as_dtype) for n, s in parts]
            return weights[0] if len(weights) == 1 else torch.cat(weights).contiguous()

        def build(kind: LinearKind) -> Linear:
            groups = exact() if kind in FILE_BLOCK_KINDS else None
            if groups is not None:
                if groups.shape != shape:
                    raise ModelFormatError(
                        f"{where}: {parts[0][0]} has shape {groups.shape}, expected {shape}"
                    )
                return make_linear(kind, None, bias, stored=groups, device=device)
            w = weight().to(dtype) if kind is LinearKind.FLOAT else weight()
            return make_linear(kind, w, bias, device=device)

        def make(kind: LinearKind) -> Linear:
            if packed is None or kind not in (LinearKind.INT4_Q8, LinearKind.INT8_Q8):
                return build(kind)
            key = f"{'+'.join(n for n, _ in parts)}|{kind.value}"
            kept = packed_linear(packed.get(key), kind, shape, bias)
            if kept is not None:
                return kept
            lin = build(kind)
            keep_linear(packed, key, lin)
            return lin

        lin = tuner.build(kinds, make, shape) if tuner is not None else make(kinds[0])
        built.append((role, lin))
        return lin

    c = config
    h, q, kv = c.hidden_size, c.q_size, c.kv_size
    embed_spec = ("model.embed_tokens.weight", (c.vocab_size, h))
    embed = kept_table(packed, "model.embed_tokens.weight", dtype, lambda: get(*embed_spec))
    final_norm = get("model.norm.weight", (h,))
    head_name = "model.embed_tokens.weight"
    if not c.tie_word_embeddings and "lm_head.weight" in tensors:
        head_name = "lm_head.weight"
    float_head = plan.candidates(LinearRole.HEAD) == (LinearKind.FLOAT,)
    if head_name == "model.embed_tokens.weight" and float_head:
        lm_head = make_linear(LinearKind.FLOAT, embed)  # shares the table
        built.append((LinearRole.HEAD, lm_head))
    else:
        # A quantized tied head is its own copy; lookups keep the float table.
        lm_head = linear(LinearRole.HEAD, [(head_name, (c.vocab_size, h))])
    layers: list[LayerWeights] = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        biases = [
            opt(p + f"self_attn.{n}_proj.bias", (size,)) for n, size in (("q", q), ("k", kv), ("v", kv))
        ]
        present = [b for b in biases if b is not None]
        if present and len(present) != 3:
            raise ModelFormatError(f"{where}: layer {i} has biases on only some of q/k/v")
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (h,)),
                qkv=linear(
                    LinearRole.QKV,
                    [
                        (p + "self_attn.q_proj.weight", (q, h)),
                        (p + "self_attn.k_proj.weight", (kv, h)),
                        (p + "self_attn.v_proj.weight", (kv, h)),
                    ],
                    torch.cat(present) if present else None,
                ),
                o=linear(
                    LinearRole.OUT,
                    [(p + "self_attn.o_proj.weight", (h, q))],
                    opt(p + "self_attn.o_proj.bias", (h,)),
                ),
                ffn_norm=get(p + "post_attention_layernorm.weight", (h,)),
                gate_up=linear(
                    LinearRole.GATE_UP,
                    [
                        (p + "mlp.gate_proj.weight", (c.intermediate_size, h)),
                        (p + "mlp.up_proj.weight", (c.intermediate_size, h)),
                    ],
                ),
                down=linear(LinearRole.DOWN, [(p + "mlp.down_proj.weight", (h, c.intermediate_size))]),
            )
        )
    if packed is not None:
        packed.retain([embed, *packed_tensors([lin for _, lin in built])])
    linear_kinds = description = describe_linears(built)
    if tuner is not None:
        tuner.finish()
        state = f"measured {tuner.measured} shapes" if tuner.measured else "cached"
        if tuner.measured and not tuner.kept:
            state += f", not cached: others used {tuner.busy_share:.0%} of the CPU meanwhile"
        # The file's name alone: GetModelInfo shows this to every caller, and no server path is theirs.
        description += f" (autotuned per rows 1/8/64, {state}: {tuner.cache.path.name})"
    return LlamaWeights(embed, final_norm, lm_head, layers, tuner, description, linear_kinds)
