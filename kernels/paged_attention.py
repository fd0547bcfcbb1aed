"""Paged variable-length attention for mixed batches, in Triton: prefill rows attend to their
cached prefix and to themselves (causal), decode rows are chunks of one token, all in one
launch.

Grid: (sequence, query block, KV head). One program handles BLOCK_M query tokens of one
sequence for the G query heads sharing one KV head (GQA), so its tile has BLOCK_M * G rows.
The number of query blocks comes from `max_query_len`: a CUDA graph freezes it, which is why
an unconstrained capture must use the bucket's token count (see docs/graphs.md). Knows
nothing of requests or schedulers: tensors in, tensor out.

Layouts: q/out `[T, Hq, D]`; k_cache/v_cache `[num_blocks, page, Hkv, D]`; query_start_loc
`[B + 1]`; seq_lens `[B]` (sequence b's queries are its last q_len positions); block_tables
`[B, max_pages]`. Sequences with no queries (padding) do nothing.

`paged_decode_attention_fused` runs the same kernel for decode-only batches with the q/k-norm +
RoPE and K/V store of norm_rope.py as a prologue of each program. Split-KV decode for few
sequences: paged_decode.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_store import to_cache
from kernels.launch import pdl_enter, pdl_launch
from kernels.norm_rope import norm_rope_rows

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(page, n, kv_head, PAGE: tl.constexpr, stride_kb, stride_ks, stride_kh):
    """Element offsets of keys `n` (their cache pages `page`) of one KV head: `[BLOCK_N]`."""
    return page.to(tl.int64) * stride_kb + (n % PAGE) * stride_ks + kv_head * stride_kh


@triton.jit
def _load_k(k_ptr, offs, d, n_ok, K_ROWS: tl.constexpr):
    """K tile as `[D, N]` for `q @ k`: loaded either as it lies (`[N, D]` rows of one token,
    then transposed) or directly transposed; which is faster is a tuning knob."""
    if K_ROWS:
        return tl.trans(tl.load(k_ptr + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0))
    return tl.load(k_ptr + offs[None, :] + d[:, None], mask=n_ok[None, :], other=0.0)


@triton.jit
def _load_v(v_ptr, offs, d, n_ok, DTYPE: tl.constexpr):
    """V tile `[N, D]` for `p @ v`, in DTYPE. A float8 tile goes through a select on the mask
    (a no-op: masked rows load as 0) that makes Triton widen it in registers and stage it in
    shared memory as fp16, read back with ldmatrix.trans; without it Triton stages float8 and
    reads the transposed operand a byte at a time (ld.shared.b8, 32 a thread per 32-key tile,
    in the sm_90 code tests/kernels/test_sm90_compile.py reads)."""
    v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    if v_ptr.dtype.element_ty == tl.float8e4nv:
        return tl.where(n_ok[:, None], v.to(DTYPE), 0.0)
    return v.to(DTYPE)


@triton.jit
def _program_ids(HEADS_FIRST: tl.constexpr):
    """(sequence, query block, KV head) of a one-pass program. With HEADS_FIRST the grid is
    (KV heads, query blocks, sequences): the programs of one sequence's heads are launched
    next to each other and read the same token rows of the cache (the heads of a token are
    adjacent in the default layout) at about the same time."""
    if HEADS_FIRST:
        return tl.program_id(2), tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _flat_program_ids(qsl_ptr, num_seqs, BLOCK_M: tl.constexpr):
    """(sequence, query block, KV head) of a program of the flat grid (query blocks of all
    sequences, KV heads). Sequence s owns the programs from qsl[s] // BLOCK_M + s on: at
    least its cdiv(q_len, BLOCK_M) blocks, and never another sequence's, so every query
    block has a program whatever the lengths. Found by binary search over query_start_loc:
    the last s whose first program is at or before this one."""
    block = tl.program_id(0)
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= block:
            lo = mid
        else:
            hi = mid - 1
    return lo, block - (tl.load(qsl_ptr + lo) // BLOCK_M + lo), tl.program_id(1)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    num_seqs,  # FLAT only
    qkv_ptr,  # FUSED only, like the six below (the q/k-norm + RoPE kernel's inputs)
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    eps,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ROWS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    FUSED: tl.constexpr,  # decode only: q/k norm + RoPE and the K/V store first (see below)
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    FUSED_ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,  # page ids read one tile ahead (see the loop)
    FLAT: tl.constexpr,  # grid (query blocks of all sequences, KV heads): _flat_program_ids
    ROWS: tl.constexpr,  # sequences served: ALL_ROWS, DECODE_ROWS or PROMPT_ROWS (paged_attention)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    if FLAT:
        seq, mblock, kv_head = _flat_program_ids(qsl_ptr, num_seqs, BLOCK_M)
    else:
        seq, mblock, kv_head = _program_ids(HEADS_FIRST)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mblock * BLOCK_M >= q_len:
        return
    if ROWS == 1 and q_len != 1:  # DECODE_ROWS
        return
    if ROWS == 2 and q_len == 1:  # PROMPT_ROWS
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len
    if FUSED:
        tl.device_assert(q_len <= 1, "the fused decode launch takes one query token a sequence")
        # Decode rows only (q_len 1): this program's share of the q/k-norm + RoPE kernel
        # (norm_rope.py), for its G query heads and its KV head, from the fused qkv row; q to
        # q_ptr, k and v into the cache at the token's slot. The barrier makes those stores
        # visible to the whole program before it reads them back below.
        f_j = tl.arange(0, FUSED_ROWS)
        f_head = tl.where(f_j < G, kv_head * G + f_j, tl.where(f_j == G, HQ, HQ + HKV) + kv_head)
        f_row = qkv_ptr + q_start.to(tl.int64) * (HQ + 2 * HKV) * D + f_head[:, None] * D
        o1, o2, x1, x2 = norm_rope_rows(
            f_row,
            f_j < G,
            (f_j < G + 2)[:, None],
            qw_ptr,
            kw_ptr,
            cos_ptr,
            sin_ptr,
            tl.load(pos_ptr + q_start),
            eps,
            D,
            q_ptr.dtype.element_ty,
        )
        half = tl.arange(0, D // 2)
        f_q = q_ptr + q_start * stride_qt + f_head[:, None] * stride_qh + half[None, :]
        tl.store(f_q, o1, mask=(f_j < G)[:, None])
        tl.store(f_q + D // 2, o2, mask=(f_j < G)[:, None])
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
        keep = slot >= PAGE  # slots in the reserved block 0 are padding rows
        at = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + kv_head * stride_kh
        is_k, is_v = ((f_j == G) & keep)[:, None], ((f_j == G + 1) & keep)[:, None]
        cdtype = k_ptr.dtype.element_ty
        cols = at + half[None, :] + 0 * f_j[:, None]  # one row per tile row, masked to k / v
        tl.store(k_ptr + cols, to_cache(o1, cdtype), mask=is_k)
        tl.store(k_ptr + cols + D // 2, to_cache(o2, cdtype), mask=is_k)
        tl.store(v_ptr + cols, to_cache(x1, cdtype), mask=is_v)
        tl.store(v_ptr + cols + D // 2, to_cache(x2, cdtype), mask=is_v)
        tl.debug_barrier()

    # A float8 cache is widened to fp16, and q and p meet it in fp16: e4m3 pairs widen to
    # fp16 in one instruction (cvt.rn.f16x2.e4m3x2; to bf16 each value takes one more) and fp16
    # holds every e4m3 value exactly.
    OPERAND: tl.constexpr = (
        tl.float16 if k_ptr.dtype.element_ty == tl.float8e4nv else q_ptr.dtype.element_ty
    )
    rows = tl.arange(0, BLOCK_M * G)
    token = mblock * BLOCK_M + rows // G  # query token within the sequence
    head = kv_head * G + rows % G
    row_ok = token < q_len
    q_pos = first_pos + token
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(OPERAND)

    m_i = tl.full([BLOCK_M * G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * G], tl.float32)
    acc = tl.zeros([BLOCK_M * G, D], tl.float32)
    kv_end = tl.minimum(seq_len, first_pos + (mblock + 1) * BLOCK_M)  # causal horizon of the tile
    pages = bt_ptr + seq * stride_bt
    if PREFETCH:  # the first tile's page ids before the loop, each next tile's inside it
        n0 = tl.arange(0, BLOCK_N)  # not named n: n may be int64 in the loop (kv_end's type)
        page = tl.load(pages + n0 // PAGE, mask=n0 < kv_end, other=0)
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        if PREFETCH:
            # this tile's page ids came with the previous iteration: the K/V addresses do not
            # wait on a load of this iteration, so the loads can be issued (and pipelined) early
            offs = _kv_offsets(page, n, kv_head, PAGE, stride_kb, stride_ks, stride_kh)
            n_next = n + BLOCK_N
            page = tl.load(pages + n_next // PAGE, mask=n_next < kv_end, other=0)
        else:
            page = tl.load(pages + n // PAGE, mask=n_ok, other=0)
            offs = _kv_offsets(page, n, kv_head, PAGE, stride_kb, stride_ks, stride_kh)
        k = _load_k(k_ptr, offs, d, n_ok, K_ROWS).to(OPERAND)
        s = tl.dot(q, k) * qk_scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(v_ptr, offs, d, n_ok, OPERAND)
        acc = acc * alpha[:, None] + tl.dot(p.to(OPERAND), v)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _check_same_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address V with K's strides (one offset per key for both)."""
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache need the same strides, got {k_cache.stride()} and "
            f"{v_cache.stride()} (pass kv_cache[0] and kv_cache[1] of one cache)"
        )


def check_decode_inputs(qkv, positions, slots, k_cache, num_heads, num_kv_heads, d) -> None:
    """The shapes the fused decode launches (q/k-norm + RoPE inside attention) rely on."""
    t = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or not qkv.is_contiguous():
        raise ValueError(f"qkv must be a contiguous [T, {(num_heads + 2 * num_kv_heads) * d}]")
    if tuple(slots.shape) != (t,) or tuple(positions.shape) != (t,):
        raise ValueError(f"one slot and one position per token: {t} tokens")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, d) or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache must be [blocks, page, {num_kv_heads}, {d}], D contiguous")


# which sequences a launch serves (the kernel's ROWS): a mixed step may give its decode rows
# and its prompt rows each a launch with its own query tile (engine/attention.py)
ALL_ROWS, DECODE_ROWS, PROMPT_ROWS = 0, 1, 2


def query_block_size(max_query_len: int, group: int) -> int:
    """Query tokens per program: tiles of at least 16 rows (tl.dot's minimum), 64 rows for
    prefill-sized queries."""
    small = max(1, 16 // group)
    return small if max_query_len <= small else max(small, 64 // group)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    k_rows: bool = True,
    heads_first: bool = False,
    prefetch_pages: bool = False,
    flat_grid: bool = False,
    rows: int = ALL_ROWS,
) -> torch.Tensor:
    """Attention of every query row over its sequence's paged K/V; returns `[T, Hq, D]`.
    block_n / num_warps / num_stages / k_rows / heads_first (grid order) / prefetch_pages
    (each tile's page ids read one iteration ahead) are tuning knobs
    (benchmarks/attention_shapes.py); block_n is rounded up to a whole page. A mixed batch in
    one launch gives decode rows a tall tile too; `rows` splits it into two launches (the
    engine's split_mixed_attention: slower with a bf16 cache on the H200, 1-2 ms a step
    faster with a float8 one on an H100; docs/perf-log/).
    `flat_grid`: one program per query block that can exist, cdiv(T, block) + sequences of
    them (T = q's rows), instead of sequences x cdiv(max_query_len, block): a 256-token graph
    of 256 decodes launches 272 programs a KV head, not 4,096 of which 3,840 return at once.
    The launch then depends on no query bound (heads_first does not apply).
    `rows`: DECODE_ROWS serves only sequences of one query token, PROMPT_ROWS only the others
    (rows of sequences not served are left as `out` had them), ALL_ROWS every sequence."""
    if rows not in (ALL_ROWS, DECODE_ROWS, PROMPT_ROWS):
        raise ValueError(f"rows must be ALL_ROWS, DECODE_ROWS or PROMPT_ROWS, got {rows!r}")
    knobs = (block_n, num_warps, num_stages, k_rows, heads_first, prefetch_pages, flat_grid)
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    return _launch(*args, max_query_len, out, None, knobs, rows)


def paged_decode_attention_fused(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    k_rows: bool = True,
    heads_first: bool = False,
    prefetch_pages: bool = False,
) -> torch.Tensor:
    """Decode rows only (every sequence has 0 or 1 query token; more is an error the kernel
    asserts in debug builds): `qk_norm_rope_store` (kernels/norm_rope.py: q/k RMSNorm + RoPE
    from the fused qkv `[T, (Hq + 2 Hkv) * D]`, k and v into the cache at `slots`) and
    `paged_attention` in one launch, each program doing its own heads' share first. The same
    arithmetic as the two launches (bit for bit under the interpreter; on a GPU the RMSNorm
    sum may be reduced in another order, so within rounding); tokens of no sequence
    (padding) get no q and no output row. Knobs as `paged_attention`."""
    t, d = qkv.shape[0], q_weight.shape[0]
    check_decode_inputs(qkv, positions, slots, k_cache, num_heads, num_kv_heads, d)
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    fused = (qkv, q_weight, k_weight, cos, sin, positions, slots, eps)
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    knobs = (block_n, num_warps, num_stages, k_rows, heads_first, prefetch_pages, False)
    return _launch(*args, 1, out, fused, knobs, ALL_ROWS)


def _launch(
    q,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    out,
    fused,
    knobs,
    rows,
):
    num_seqs = seq_lens.shape[0]
    _, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    _check_same_strides(k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    block_m = query_block_size(max_query_len, group)
    mblocks = triton.cdiv(max(max_query_len, 1), block_m)
    block_n, num_warps, num_stages, k_rows, heads_first, prefetch, flat = knobs
    if flat:
        grid = (triton.cdiv(q.shape[0], block_m) + num_seqs, hkv)
    else:
        grid = (hkv, mblocks, num_seqs) if heads_first else (num_seqs, mblocks, hkv)
    # the fused prologue's inputs; unused (any tensor) without it
    qkv, qw, kw, cos, sin, positions, slots, eps = fused or (q,) * 7 + (0.0,)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_seqs,
        qkv,
        qw,
        kw,
        cos,
        sin,
        positions,
        slots,
        eps,
        G=group,
        D=d,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=max(16, page, block_n),
        K_ROWS=k_rows,
        HEADS_FIRST=heads_first,
        FUSED=fused is not None,
        HQ=hq,
        HKV=hkv,
        FUSED_ROWS=triton.next_power_of_2(group + 2),
        PREFETCH=prefetch,
        FLAT=flat,
        ROWS=rows,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(),
    )
    return out


def paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale):
    """Plain torch, one sequence at a time, fp32: the definition the kernel is tested against."""
    out = torch.zeros_like(q)
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        start, end, seq_len = qsl[b], qsl[b + 1], lens[b]
        if end == start:
            continue
        pages = block_tables[b, : math.ceil(seq_len / page)].long()
        k = k_cache[pages].reshape(-1, hkv, q.shape[2])[:seq_len].float()
        v = v_cache[pages].reshape(-1, hkv, q.shape[2])[:seq_len].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qb = q[start:end].float()
        scores = torch.einsum("thd,nhd->htn", qb, k) * scale
        pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[start:end] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v).to(q.dtype)
    return out
