"""Triton kernels for attention over the paged KV cache (launched by kernels.attention.triton_attention).

Memory layout assumed (the PagedKVCache layout): per layer K and V are
[num_pages, kv_heads, PAGE_SIZE, head_dim], head-major pages with head_dim
contiguous; the other strides are passed in (page, head, offset in page). A token's
slot is page * PAGE_SIZE + offset, and key j of a sequence lives in page
table[j // PAGE_SIZE] at offset j % PAGE_SIZE. Keys are fetched BLOCK_N at a time
through that formula, so a block may straddle pages and any page size works; within
a page one head's keys are a contiguous [PAGE_SIZE, head_dim] run.

One program serves one K/V head of one sequence and all the query heads that share
it (grouped-query attention): K/V are read once per group, never per query head.
Softmax is the online (flash) form in float32; a fully masked block or an empty
sequence is kept finite by never subtracting -inf from -inf.

With QUANT (an int8 cache, kernels.attention.kv_layer) K/V are int8 and each key's scale sits at
[page, head, offset] of a [num_pages, kv_heads, PAGE_SIZE] float16 tensor; the kernels
load both and dequantize in registers, so an int8 cache moves a quarter of float32's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    seq_lens_ptr,
    seq_ids_ptr,
    q_rows_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ko,
    stride_vp,
    stride_vh,
    stride_vo,
    stride_ksp,
    stride_ksh,
    stride_vsp,
    stride_vsh,
    stride_tb,
    stride_ot,
    num_splits,
    scale,
    PAGE_SIZE: tl.constexpr,
    PER_KV: tl.constexpr,
    PER_KV_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Decode (one query token): grid (sequences, kv_heads, splits); each split covers SPLIT_LEN keys.

    Writes the split's running max, sum and unnormalised output per query head to the
    partial buffers [n, heads, splits(, head_dim)]; decode_reduce_kernel combines them.
    With a single split (SINGLE_SPLIT) it writes the final output itself.
    """
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    row = tl.load(q_rows_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)

    hh = tl.arange(0, PER_KV_P2)
    h_ok = hh < PER_KV
    heads = kvh * PER_KV + hh
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0
    )
    q = q.to(tl.float32) * scale

    # This program's K/V head; its keys are then addressed by (page, offset in page).
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    ks_head = ks_ptr + kvh.to(tl.int64) * stride_ksh
    vs_head = vs_ptr + kvh.to(tl.int64) * stride_vsh
    m = tl.full([PER_KV_P2], float("-inf"), tl.float32)
    l_sum = tl.zeros([PER_KV_P2], tl.float32)
    acc = tl.zeros([PER_KV_P2, HEAD_DIM], tl.float32)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, seq_len)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(tables_ptr + seq * stride_tb + offs // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        in_page = offs % PAGE_SIZE
        k_rows = k_head + page * stride_kp + in_page * stride_ko
        k = tl.load(k_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        v_rows = v_head + page * stride_vp + in_page * stride_vo
        v = tl.load(v_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        if QUANT:
            # int8 K/V times their per-token scales, in registers (exact in float32).
            k_s = tl.load(ks_head + page * stride_ksp + in_page, mask=valid, other=0.0).to(tl.float32)
            v_s = tl.load(vs_head + page * stride_vsp + in_page, mask=valid, other=0.0).to(tl.float32)
            k = k * k_s[:, None]
            v = v * v_s[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], 2)
        s = tl.where(valid[None, :], s, float("-inf"))
        # Online softmax step (inlined: nested jit calls are slow under the interpreter).
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m = m_new

    if SINGLE_SPLIT:
        # The whole sequence in one split: normalise and write the output, no reduction.
        o = tl.where(l_sum[:, None] > 0.0, acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None], 0.0)
        out = out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
        return
    n_heads = tl.num_programs(1) * PER_KV
    base = (i * n_heads + heads) * num_splits + split
    tl.store(part_m_ptr + base, m, mask=h_ok)
    tl.store(part_l_ptr + base, l_sum, mask=h_ok)
    tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=h_ok[:, None])


@triton.jit
def decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    q_rows_ptr,
    out_ptr,
    stride_ot,
    num_splits,
    PER_KV: tl.constexpr,
    PER_KV_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Combine the splits of one sequence's query heads sharing a K/V head: grid (sequences, kv_heads)."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(q_rows_ptr + i).to(tl.int64)
    hh = tl.arange(0, PER_KV_P2)
    heads = kvh * PER_KV + hh
    sp = tl.arange(0, SPLITS_P2)
    ok = (hh < PER_KV)[:, None] & (sp < num_splits)[None, :]  # [heads, splits]
    d = tl.arange(0, HEAD_DIM)
    n_heads = tl.num_programs(1) * PER_KV
    base = (i * n_heads + heads)[:, None] * num_splits + sp[None, :]
    m = tl.load(part_m_ptr + base, mask=ok, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + base, mask=ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + base[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None], other=0.0
    )
    m_all = tl.max(m, 1)
    m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
    w = tl.exp(m - m_safe[:, None])
    total = tl.sum(l_sum * w, 1)
    o = tl.sum(acc * w[:, :, None], 1)
    o = tl.where(total[:, None] > 0.0, o / tl.where(total > 0.0, total, 1.0)[:, None], 0.0)
    out = out_ptr + row * stride_ot + heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(hh < PER_KV)[:, None])


@triton.jit
def prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    q_lens_ptr,
    q_starts_ptr,
    seq_ids_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ko,
    stride_vp,
    stride_vh,
    stride_vo,
    stride_ksp,
    stride_ksh,
    stride_vsp,
    stride_vsh,
    stride_tb,
    stride_ot,
    scale,
    PAGE_SIZE: tl.constexpr,
    PER_KV: tl.constexpr,
    PER_KV_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Several query tokens per sequence (prefill chunk, k+1-token verification): grid (sequences, kv_heads, query blocks).

    The block's BLOCK_Q tokens x PER_KV_P2 heads form the rows of one tile; query i of a
    sequence sits at position seq_len - q_len + i and sees keys 0..position, i.e. the
    earlier pages and itself (its K/V are written before attention). Keys past the last
    row's position are never read.
    """
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    qblk = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq)

    r = tl.arange(0, BLOCK_Q * PER_KV_P2)
    qi = qblk * BLOCK_Q + r // PER_KV_P2
    hh = r % PER_KV_P2
    r_ok = (qi < q_len) & (hh < PER_KV)
    heads = kvh * PER_KV + hh
    pos = seq_len - q_len + qi
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=r_ok[:, None],
        other=0.0,
    )

    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    ks_head = ks_ptr + kvh.to(tl.int64) * stride_ksh
    vs_head = vs_ptr + kvh.to(tl.int64) * stride_vsh
    m = tl.full([BLOCK_Q * PER_KV_P2], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * PER_KV_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * PER_KV_P2, HEAD_DIM], tl.float32)
    end = tl.minimum(seq_len - q_len + tl.minimum((qblk + 1) * BLOCK_Q, q_len), seq_len)
    for n0 in range(0, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(tables_ptr + seq * stride_tb + offs // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        in_page = offs % PAGE_SIZE
        k_rows = k_head + page * stride_kp + in_page * stride_ko
        v_rows = v_head + page * stride_vp + in_page * stride_vo
        k = tl.load(k_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if QUANT:
            # Dequantized in registers to the queries' dtype, as the torch path rounds them.
            k_s = tl.load(ks_head + page * stride_ksp + in_page, mask=valid, other=0.0).to(tl.float32)
            v_s = tl.load(vs_head + page * stride_vsp + in_page, mask=valid, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_s[:, None]).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_s[:, None]).to(q_ptr.dtype.element_ty)
        else:  # a float16 cache under other queries: computed in the queries' dtype
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        # The interpreter's dot is wrong on bfloat16 (numpy has none): give it float32 operands.
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            # ieee: float32 caches keep float32 products (tf32 would lose bits the torch path keeps).
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale
        visible = (offs[None, :] <= pos[:, None]) & valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if UPCAST_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new

    o = tl.where(l_sum[:, None] > 0.0, acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None], 0.0)
    out_rows = (q_start + qi).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * stride_ot + heads[:, None] * HEAD_DIM + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None],
    )


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_tokens,
    stride_kt,
    stride_vt,
    stride_kcp,
    stride_kch,
    stride_kco,
    stride_vcp,
    stride_vch,
    stride_vco,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Scatter BLOCK_T tokens' K and V rows (kv_heads * head_dim, contiguous) into their slots.

    A token's row is read whole, then each head's head_dim piece goes to its own
    [page, head, offset] position: the heads of one slot are a page stride apart.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    e = tl.arange(0, ROW_P2)
    ok = t_ok[:, None] & (e < ROW)[None, :]
    slot = tl.load(slots_ptr + t, mask=t_ok, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    head = (e // HEAD_DIM).to(tl.int64)
    dim = e % HEAD_DIM
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + e[None, :], mask=ok)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + e[None, :], mask=ok)
    k_dst = (page * stride_kcp + in_page * stride_kco)[:, None] + (head * stride_kch + dim)[None, :]
    v_dst = (page * stride_vcp + in_page * stride_vco)[:, None] + (head * stride_vch + dim)[None, :]
    tl.store(k_cache_ptr + k_dst, k, mask=ok)
    tl.store(v_cache_ptr + v_dst, v, mask=ok)


@triton.jit
def write_kv_int8_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    ks_ptr,
    vs_ptr,
    slots_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kch,
    stride_kco,
    stride_vcp,
    stride_vch,
    stride_vco,
    stride_ksp,
    stride_ksh,
    stride_vsp,
    stride_vsh,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Quantize and scatter BLOCK_T tokens' K and V of one head: grid (token blocks, kv_heads).

    Per token and head: scale = absmax / 127 rounded to float16 (at least its smallest
    normal), q = floor(x / scale + 0.5) clamped to [-127, 127]; the same arithmetic as
    kernels.attention.kv_layer.quantize_kv, so both paths store the same bytes.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    t_ok = t < num_tokens
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slots_ptr + t, mask=t_ok, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    t64 = t.to(tl.int64)
    _write_int8_head(
        k_ptr,
        k_cache_ptr,
        ks_ptr,
        t64,
        t_ok,
        h,
        page,
        in_page,
        d,
        stride_kt,
        stride_kh,
        stride_kcp,
        stride_kch,
        stride_kco,
        stride_ksp,
        stride_ksh,
    )
    _write_int8_head(
        v_ptr,
        v_cache_ptr,
        vs_ptr,
        t64,
        t_ok,
        h,
        page,
        in_page,
        d,
        stride_vt,
        stride_vh,
        stride_vcp,
        stride_vch,
        stride_vco,
        stride_vsp,
        stride_vsh,
    )


@triton.jit
def _write_int8_head(
    x_ptr,
    cache_ptr,
    scale_ptr,
    t64,
    t_ok,
    h,
    page,
    in_page,
    d,
    stride_xt,
    stride_xh,
    stride_cp,
    stride_ch,
    stride_co,
    stride_sp,
    stride_sh,
):
    """One of K/V for write_kv_int8_kernel: load the tokens' head rows, quantize, store rows and scales."""
    x = tl.load(
        x_ptr + (t64 * stride_xt + h * stride_xh)[:, None] + d[None, :], mask=t_ok[:, None], other=0.0
    )
    q, scale = _quantize_rows(x)
    row = page * stride_cp + h * stride_ch + in_page * stride_co
    tl.store(cache_ptr + row[:, None] + d[None, :], q, mask=t_ok[:, None])
    tl.store(scale_ptr + page * stride_sp + h * stride_sh + in_page, scale, mask=t_ok)


@triton.jit
def _quantize_rows(x):
    """[rows, head_dim] -> (int8 rows, float16 scale per row): symmetric absmax / 127, half up."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 127.0, 6.103515625e-05).to(tl.float16)  # float16 tiny
    q = tl.floor(x / scale.to(tl.float32)[:, None] + 0.5)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return q.to(tl.int8), scale
