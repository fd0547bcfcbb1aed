"""Split-KV paged attention for decode-only batches of few sequences: each (sequence, KV head)
takes `splits` programs, each over a slice of the context, and a second launch combines their
partial softmax sums. With few sequences the one-pass kernel (paged_attention.py) would leave
most of the GPU idle (one program per sequence and KV head); the launch depends on the number
of sequences, never on their lengths, so it is graph-safe. Tensors in, tensor out; the
reference is `paged_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch
from kernels.paged_attention import _LOG2E, _check_same_strides, _kv_offsets, _load_k, _load_v


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    part_o_ptr,
    part_ml_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    G: tl.constexpr,
    HQ: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    K_ROWS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PREFETCH: tl.constexpr,  # page ids read one tile ahead, as in the one-pass kernel
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # Decode rows only (one query token per sequence): KV range split over SPLITS programs.
    # Grid (sequences, KV heads, splits), or (KV heads, splits, sequences) with HEADS_FIRST.
    if HEADS_FIRST:
        kv_head, split, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == q_start:
        return  # a padding sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(seq_len, lo + chunk)
    r = tl.arange(0, ROWS)
    row_ok = r < G
    head = kv_head * G + r
    d = tl.arange(0, D)
    # a float8 cache: q, k, p and v in fp16, as in the one-pass kernel (paged_attention.py)
    OPERAND: tl.constexpr = (
        tl.float16 if k_ptr.dtype.element_ty == tl.float8e4nv else q_ptr.dtype.element_ty
    )
    q = tl.load(
        q_ptr + q_start * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(OPERAND)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    pages = bt_ptr + seq * stride_bt
    if PREFETCH:  # the first tile's page ids before the loop, each next tile's inside it
        n0 = lo + tl.arange(0, BLOCK_N)
        page = tl.load(pages + n0 // PAGE, mask=n0 < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PREFETCH:  # the K/V addresses do not wait on a load of this iteration
            offs = _kv_offsets(page, n, kv_head, PAGE, stride_kb, stride_ks, stride_kh)
            n_next = n + BLOCK_N
            page = tl.load(pages + n_next // PAGE, mask=n_next < hi, other=0)
        else:
            page = tl.load(pages + n // PAGE, mask=n_ok, other=0)
            offs = _kv_offsets(page, n, kv_head, PAGE, stride_kb, stride_ks, stride_kh)
        k = _load_k(k_ptr, offs, d, n_ok, K_ROWS).to(OPERAND)
        s = tl.where(n_ok[None, :], tl.dot(q, k) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(v_ptr, offs, d, n_ok, OPERAND)
        acc = acc * alpha[:, None] + tl.dot(p.to(OPERAND), v)
        m_i = m_new
    # partials: [num_seqs, Hq, SPLITS, D] (unnormalised) and [num_seqs, Hq, SPLITS, 2] (m, l)
    base = (seq * HQ + head) * SPLITS + split
    tl.store(part_o_ptr + base[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,
    part_ml_ptr,
    o_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == q_start:
        return
    sp = tl.arange(0, SPLITS)
    base = (seq * HQ + head) * SPLITS + sp
    m = tl.load(part_ml_ptr + base * 2)
    denom = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(denom > 0, tl.exp2(m - m_max), 0.0)  # empty splits (m -inf, denom 0) weigh 0
    d = tl.arange(0, D)
    parts = tl.load(part_o_ptr + base[:, None] * D + d[None, :])
    out = tl.sum(parts * w[:, None], 0) / tl.sum(denom * w, 0)
    tl.store(o_ptr + q_start * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def decode_splits(num_seqs: int, num_kv_heads: int, target_programs: int = 264) -> int:
    """KV splits per sequence for a decode-only launch: enough programs to fill the GPU."""
    splits = target_programs // max(1, num_seqs * num_kv_heads)
    return 1 if splits < 2 else min(32, triton.next_power_of_2(splits) // 2 * 2)


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    splits: int,
    out=None,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    k_rows: bool = False,
    heads_first: bool = False,
    prefetch_pages: bool = False,
):
    """Decode rows only (every sequence has 0 or 1 query token), split-KV: `splits` programs
    per (sequence, KV head) each take a slice of the context; a second launch combines them.
    The launch depends on the number of sequences, never on their lengths. block_n /
    num_warps / num_stages / k_rows / heads_first (grid order) / prefetch_pages (page ids
    read a tile ahead, so the K/V loads can be pipelined) are tuning knobs, the same numbers
    whichever way (benchmarks/attention_shapes.py)."""
    num_seqs = seq_lens.shape[0]
    _, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    _check_same_strides(k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    part_o = torch.empty(num_seqs, hq, splits, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_seqs, hq, splits, 2, dtype=torch.float32, device=q.device)
    grid = (hkv, splits, num_seqs) if heads_first else (num_seqs, hkv, splits)
    _decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        part_o,
        part_ml,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        G=group,
        HQ=hq,
        ROWS=max(16, triton.next_power_of_2(group)),
        D=d,
        PAGE=page,
        BLOCK_N=max(block_n, page),
        SPLITS=splits,
        K_ROWS=k_rows,
        HEADS_FIRST=heads_first,
        PREFETCH=prefetch_pages,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(),
    )
    _decode_reduce_kernel[(num_seqs, hq)](
        part_o,
        part_ml,
        out,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        HQ=hq,
        D=d,
        SPLITS=splits,
        **pdl_launch(),
    )
    return out
