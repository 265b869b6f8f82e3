"""Triton kernel for y = x @ W^T with W kept 4-bit: dequantized in registers inside the K loop
(launched by kernels.linear.triton_q4_linear).

Weight layout (W is [N, K], K a multiple of the group size 32):

    packed  uint8   [N, K // 2]   byte j of row n holds q[n, 2j] (low nibble) and q[n, 2j + 1] (high)
    scale   float16 [N, K // 32]  w[n, k] = scale[n, k // 32] * q[n, k] + offset[n, k // 32]
    offset  float16 [N, K // 32]

One program computes a [BLOCK_M, BLOCK_N] tile of y. Each step of the K loop reads BLOCK_K // 2
bytes of each of its BLOCK_N weight rows (every byte once), splits them into the even columns (low
nibbles) and the odd ones (high nibbles), dequantizes both halves in float32 with their groups'
scale and offset, and multiplies them by the matching even and odd columns of x: two dots of depth
BLOCK_K // 2 into one float32 accumulator. No interleave or reshape is needed, and weights never
exist in memory in more than 4 bits (plus 4 bytes per group of 32).

Float32 activations multiply float32 weights (ieee: no tf32); bfloat16 and float16 activations
multiply the weights rounded to their dtype (tensor cores), accumulating in float32. The output
(+ bias, added in float32) is rounded once to y's dtype, which is x's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def q4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    offset_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W^T (+ bias); grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).

    x and y have contiguous rows (column stride 1); scale and offset share their strides. BLOCK_K
    is a multiple of 32; EVEN_K says K is a multiple of BLOCK_K (no K mask); UPCAST_DOT gives the
    dots float32 operands (the interpreter: numpy has no bfloat16).
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    j = tl.arange(0, BLOCK_K // 2)  # bytes (column pairs) per step
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    p_rows = packed_ptr + rn.to(tl.int64)[:, None] * stride_pn
    g_rows = rn.to(tl.int64)[:, None] * stride_sn
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        byte = k0 // 2 + j  # byte index in the row: columns 2 * byte and 2 * byte + 1
        group = k0 // 32 + j // 16  # 16 bytes per group of 32 columns
        if EVEN_K:
            w_ok = n_ok[:, None]
            x_ok = m_ok[:, None]
        else:
            k_ok = (byte < K // 2)[None, :]
            w_ok = n_ok[:, None] & k_ok
            x_ok = m_ok[:, None] & k_ok
        b = tl.load(p_rows + byte[None, :], mask=w_ok, other=0)
        s = tl.load(scale_ptr + g_rows + group[None, :], mask=w_ok, other=0.0).to(tl.float32)
        o = tl.load(offset_ptr + g_rows + group[None, :], mask=w_ok, other=0.0).to(tl.float32)
        w_even = (b & 0xF).to(tl.float32) * s + o  # [BLOCK_N, BLOCK_K // 2]
        w_odd = (b >> 4).to(tl.float32) * s + o
        x_even = tl.load(x_rows + 2 * byte[None, :], mask=x_ok, other=0.0)  # [BLOCK_M, BLOCK_K // 2]
        x_odd = tl.load(x_rows + 2 * byte[None, :] + 1, mask=x_ok, other=0.0)
        if UPCAST_DOT:
            # The GPU path's roundings (weights to x's dtype), in float32 operands.
            acc += tl.dot(
                x_even.to(tl.float32), tl.trans(w_even.to(dt).to(tl.float32)), input_precision="ieee"
            )
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd.to(dt).to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(w_even.to(dt)), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(w_odd.to(dt)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_at = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
