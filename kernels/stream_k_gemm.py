"""`x @ W^T` for up to 128 rows in Triton, its weight streamed by one program per multiprocessor.

The split-K GEMM (kernels/skinny_gemm.py) launches (output tiles x splits) programs; the Higgs
projections give 40 to 304 of them, so the last wave of the H200's 132 multiprocessors runs
partly empty (gate-up at 128-row tiles: 152 programs, 1.15 waves), the same quantisation that
keeps cuBLAS at 80-120 busy multiprocessors (docs/PERFORMANCE.md). Here the flat space of
(output tile, K chunk) units is cut into one contiguous, equal share per program ("stream-K").
A tile whose units all fall in one share is stored directly; a tile cut between shares leaves
an fp32 partial per share, and the program that brings the last one adds them in share order
(the same bits whichever program finishes first). Tensors in, tensor out; reference `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch
from kernels.skinny_gemm import _dot, _silu_mul, _x_tile


@triton.jit
def _share_of(unit, programs, units):
    """The program whose share [p * units // programs, (p + 1) * units // programs) holds unit."""
    return ((unit + 1) * programs - 1) // units


@triton.jit
def _tile_shares(tile, kt, programs, units):
    """The first and last program whose shares hold units of tile."""
    return _share_of(tile * kt, programs, units), _share_of(tile * kt + kt - 1, programs, units)


@triton.jit
def _count_share(
    tile, part_at, count_ptr, out_ptr, programs, units, kt, N, m, m_ok, stride_om,
    BN: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Counts this program's partial of tile in; the program that brings the last one adds
    them in share order into out and zeroes the tile's counter."""
    q_first, q_last = _tile_shares(tile, kt, programs, units)
    if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == q_last - q_first:
        tl.debug_barrier()  # the other shares' partials read after the count (acquire)
        tl.store(count_ptr + tile, 0)  # every share is in: zero again for the next launch
        total = tl.zeros([BN, BM], tl.float32)
        for q in range(q_first, q_last + 1):
            slot = 2 * q + ((q * units // programs) // kt != tile).to(tl.int32)
            total += tl.load(part_at + slot * BN * BM, cache_modifier=".cg")
        n = tile * BN + tl.arange(0, BN)
        out_ok = (n < N)[:, None] & m_ok[None, :]
        out_at = out_ptr + m[None, :] * stride_om + n[:, None]
        tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _stream_k_gemm_kernel(
    x_ptr, up_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
    stride_om, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, GATED: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (programs,). Units are numbered tile-major (tile * kt + chunk); program p owns
    # [start, end). Its first tile may begin before start and its last end after end: those
    # two leave partials, in the program's slots 2p and 2p + 1 of part_ptr ([2 * programs, BN,
    # BM] fp32); every tile between is whole. The tile is transposed (acc[n, m]) as in
    # skinny_gemm: the weight's rows are the tensor-core tile's tall side. With TMA, x_ptr /
    # up_ptr / w_ptr are tensor descriptors (blocks [BM, BK] and [BN, BK]).
    p, programs = tl.program_id(0), tl.num_programs(0)
    kt = tl.cdiv(K, BK)
    units = tl.cdiv(N, BN) * kt
    start = p * units // programs
    end = (p + 1) * units // programs
    first = start // kt
    m = tl.arange(0, BM)
    m_ok = m < M
    part_at = part_ptr + tl.arange(0, BN)[:, None] * BM + m[None, :]  # one [BN, BM] slot
    if not TMA:
        x_cols = x_ptr + m[None, :] * stride_xm
    pdl_enter(PDL)
    acc = tl.zeros([BN, BM], tl.float32)
    for u in range(start, end):
        tile = u // kt
        k0 = (u - tile * kt) * BK
        if TMA:
            w = w_ptr.load([tile * BN, k0])
            x = x_ptr.load([0, k0])
            if GATED:  # x holds [gate | up]
                x = _silu_mul(x, up_ptr.load([0, k0]))
            acc = _dot(w, tl.trans(x), acc, IEEE)
        else:
            n = tile * BN + tl.arange(0, BN)
            k = k0 + tl.arange(0, BK)
            w_at = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
            if EVEN_K:
                w = tl.load(w_at, mask=(n < N)[:, None], other=0.0)
            else:
                w = tl.load(w_at, mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            acc = _dot(w, _x_tile(x_cols, k, m_ok, K, K, GATED, not EVEN_K), acc, IEEE)
        if (u == tile * kt + kt - 1) | (u == end - 1):  # this program's part of the tile ends
            if (u == tile * kt + kt - 1) & (tile * kt >= start):  # the whole tile
                n = tile * BN + tl.arange(0, BN)
                out_ok = (n < N)[:, None] & m_ok[None, :]
                out_at = out_ptr + m[None, :] * stride_om + n[:, None]
                tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
            else:  # a partial; counted after the loop (a barrier here stops the pipelining)
                tl.store(part_at + (2 * p + (tile != first).to(tl.int32)) * BN * BM, acc)
            acc = tl.zeros([BN, BM], tl.float32)
    tl.debug_barrier()  # every thread's partials stored before they are counted (release)
    last = (end - 1) // kt
    if (start > first * kt) | (end < first * kt + kt):  # the first tile was cut
        _count_share(
            first, part_at, count_ptr, out_ptr, programs, units, kt, N, m, m_ok, stride_om,
            BN, BM,
        )  # fmt: skip
    if (last != first) & (end < last * kt + kt):  # so was the last
        _count_share(
            last, part_at, count_ptr, out_ptr, programs, units, kt, N, m, m_ok, stride_om,
            BN, BM,
        )  # fmt: skip


def stream_k_tiles(m: int, n: int, k: int) -> dict:
    """Default tile settings for an `[m, k] @ [n, k]^T` product on the H200 (placeholder until
    the sweep: 128 weight rows x 128 columns a unit, as many stages as the shared memory holds,
    one program per multiprocessor)."""
    bm = max(16, triton.next_power_of_2(m))
    bn, bk, stages, warps = 128, 128, 4, 4 if bm <= 32 else 8
    while stages > 2 and stages * (bn + bm) * bk * 2 + bn * bm * 4 > 220 * 1024:
        stages -= 1
    return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def stream_k_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor | None = None,
    gated: bool = False,
    block_m: int | None = None,
    block_n: int = 128,
    block_k: int = 128,
    programs: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
    tma: bool = False,
) -> torch.Tensor:
    """`x [M, K] @ weight [N, K]^T -> [M, N]` in x's dtype (fp32 accumulation), M up to 128.
    `counters`: int32 zeros, at least `ceil(N / block_n)`; every launch leaves them zero.
    `programs`: the grid (default: the device's multiprocessors; never more than the units).
    `gated` and `tma` as in `skinny_gemm` (x = [gate | up]; tiles through tensor descriptors)."""
    m, (n, k) = x.shape[0], weight.shape
    if x.shape[1] != (2 * k if gated else k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x [M, K], weight [N, K], K contiguous: got {x.shape}, {weight.shape}")
    if m > 128:
        raise ValueError(f"stream_k_gemm takes at most 128 rows, got {m}")
    block_m = block_m or max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, block_n)
    if counters.dtype != torch.int32 or counters.numel() < tiles:
        raise ValueError(f"counters must be int32 with at least {tiles} elements")
    if programs is None:
        programs = _multiprocessors(x.device)
    programs = max(1, min(programs, tiles * triton.cdiv(k, block_k)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    parts = torch.empty(2 * programs, block_n, block_m, dtype=torch.float32, device=x.device)
    x_arg, up_arg, w_arg = x, x, weight
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if (x.stride(0) * x.element_size()) % 16 or (k * x.element_size()) % 16:
            raise ValueError("tma needs rows (and for gated, the up half) 16-byte aligned")
        x_arg = TensorDescriptor.from_tensor(x[:, :k], [block_m, block_k])
        up_arg = TensorDescriptor.from_tensor(x[:, k:], [block_m, block_k]) if gated else x_arg
        w_arg = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _stream_k_gemm_kernel[(programs,)](
        x_arg,
        up_arg,
        w_arg,
        out,
        parts,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BM=block_m,
        BN=block_n,
        BK=block_k,
        EVEN_K=k % block_k == 0,
        IEEE=x.dtype == torch.float32,
        GATED=gated,
        TMA=tma,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(),
    )
    return out


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few programs, enough to cut tiles between shares
    return torch.cuda.get_device_properties(device).multi_processor_count
