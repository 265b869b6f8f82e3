"""Triton kernels for the per-token work around attention: RMSNorm with the residual add, rotary in place.

Both work on BLOCK_T rows per program (a row = one token's hidden vector, or one
token's heads) and read/write through row strides, so they run on views such as the
Q and K slices of the fused QKV output without a copy. Arithmetic is float32 with a
rounding to the tensors' dtype wherever torch's ops in that dtype round, so results
match the torch path (and the interpreter, which cannot do bfloat16 arithmetic, runs them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    stride_x,
    stride_res,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    HIDDEN_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """res += x (in res's dtype, as the model's residual stream), then out = rms_norm(res) * w.

    Normalises in float32 and rounds to the activations' dtype before the weight, as
    engine.model.llama.rms_norm (and the reference) do.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, HIDDEN_P2)
    ok = (t < num_rows)[:, None] & (c < HIDDEN)[None, :]
    t64 = t.to(tl.int64)
    dt = res_ptr.dtype.element_ty
    x = tl.load(x_ptr + t64[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + t64[:, None] * stride_res + c[None, :], mask=ok, other=0.0).to(tl.float32)
    total = (res + x).to(dt)
    tl.store(res_ptr + t64[:, None] * stride_res + c[None, :], total, mask=ok)
    tf = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tf * tf, 1) / HIDDEN + eps)
    normed = (tf * rstd[:, None]).to(dt).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < HIDDEN, other=0.0).to(tl.float32)
    out = (w[None, :] * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t64[:, None] * stride_out + c[None, :], out, mask=ok)


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_table,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Rotate x [T, heads, 2 * HALF] in place (halves layout: pair i is (i, i + HALF)).

    cos/sin are the model's tables [positions, 2 * HALF] whose halves are equal; each
    token reads its row at positions[t].
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    h = tl.arange(0, HEADS_P2)
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos[:, None] * stride_table + i[None, :], mask=t_ok[:, None], other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_table + i[None, :], mask=t_ok[:, None], other=0.0)
    ok = t_ok[:, None, None] & (h < HEADS)[None, :, None]
    at = x_ptr + t.to(tl.int64)[:, None, None] * stride_xt + h[None, :, None] * stride_xh + i[None, None, :]
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    c3 = c.to(tl.float32)[:, None, :]
    s3 = s.to(tl.float32)[:, None, :]
    # Same products and roundings as RotaryEmbedding.apply: x * cos + rotate_half(x) * sin.
    y1 = (x1 * c3).to(dt).to(tl.float32) + (-x2 * s3).to(dt).to(tl.float32)
    y2 = (x2 * c3).to(dt).to(tl.float32) + (x1 * s3).to(dt).to(tl.float32)
    tl.store(at, y1.to(dt), mask=ok)
    tl.store(at + HALF, y2.to(dt), mask=ok)
