"""`x @ W^T` for few rows (decode steps: 1 to 128 tokens) in Triton, split over the whole GPU.

At these shapes a projection reads its weight once and does almost no arithmetic: its time
is the weight's bytes over the memory bandwidth the launch reaches. cuBLAS picks tiles that
leave many of the H200's 132 multiprocessors idle for the Higgs shapes (Nsight Compute read
well under the DRAM bandwidth, docs/perf-log/) and add a separate split-K reduction launch.
Here the grid is (output tiles, K splits), each program streams its `[BN, K / SPLIT]` weight
slab through a pipelined loop, and the last program of an output tile to finish (counted with
an atomic) adds the partials in split order, so the result does not depend on which program
finished last. Measured on the H200 it beats cuBLAS at one row and not at 64 rows
(docs/perf-log/), so the engine uses it for steps of up to 16 tokens, with TMA tiles on
Hopper; over float8 operands it beats torch._scaled_mm at 64 to 128 rows, so fp8 weights take
it up to 128 rows by default (the plan's few_row_fp8_rows). More rows (up to 512, a step's
default token budget) go in blocks of 128, each block its own programs over the same weight
tile (adjacent, so the tile is read from DRAM about once): a lever for the mixed steps of
128 to 256 streams, since at 128 rows torch._scaled_mm took 14 and 27 us for o and down
against our 10 and 15 (H200, docs/perf-log/2026-12-06-session-27.md). Timed from 144 to 400
rows it lost to torch._scaled_mm at every projection (H100, 2026-12-07-session-34.md), so
the engine keeps it to 128 rows by default.
Tensors in, tensor out; the reference is `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import hopper_or_later, pdl_enter, pdl_launch

# x tiles of up to 128 rows (the fp32 accumulator [BN, 128]: skinny_tiles gives 8 warps from
# BN = 128, so at most 128 registers a thread); more rows go in blocks of TILE_ROWS, up to
# MAX_ROWS (a step's default token budget: engine/config.py)
TILE_ROWS = 128
MAX_ROWS = 512


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in x's dtype, rounded where norm_rope.silu_mul rounds."""
    act = (gate.to(tl.float32) / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _dot(w, x, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands: full-precision products, as F.linear without TF32
        return tl.dot(w, x, acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _x_tile(x_cols, k, m_ok, hi, K, GATED: tl.constexpr, MASK_K: tl.constexpr):
    """x's `[BK, BM]` tile at columns k (rows past M, and with MASK_K columns from hi on,
    read as zeros); with GATED, silu(gate) * up of the `[gate | up]` halves."""
    x_ok = m_ok[None, :] & (k < hi)[:, None] if MASK_K else m_ok[None, :]
    x = tl.load(x_cols + k[:, None], mask=x_ok, other=0.0)
    if GATED:
        x = _silu_mul(x, tl.load(x_cols + K + k[:, None], mask=x_ok, other=0.0))
    return x


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, up_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
    stride_wn, stride_om, stride_ps, M_BLOCKS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr,
    TMA: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (N / BN x M_BLOCKS, SPLIT): x's rows in blocks of BM, the blocks of one weight tile
    # in adjacent programs (they run together, so the tile comes from DRAM about once and
    # from L2 for the others; M_BLOCKS = 1, a launch argument Triton specializes, folds away).
    # The tile is transposed (acc[n, m] = W[n, :] . x[m, :]) so that the weight's rows are
    # the tensor-core tile's tall side and the few x rows its narrow one.
    # With TMA, x_ptr / up_ptr / w_ptr are tensor descriptors (x and up `[M, K]`, blocks
    # `[BM, BK]`; w `[N, K]`, blocks `[BN, BK]`): the copy engine fetches whole tiles, rows
    # and columns past the ends read as zeros. FP8: w and x are float8 with fp32 scales per
    # weight row (ws_ptr) and per x row (xs_ptr): the tensor cores' fp8 dot with fp32 sums
    # (widened to fp32 products where the output is fp32: the CPU interpreter), both scales
    # applied to the sums, the arithmetic of torch._scaled_mm with row-wise scales.
    pid, split = tl.program_id(0), tl.program_id(1)
    tile, block = pid // M_BLOCKS, pid % M_BLOCKS
    n = tile * BN + tl.arange(0, BN)
    m = block * BM + tl.arange(0, BM)
    n_ok, m_ok = n < N, m < M
    per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK  # K columns per split, whole BK chunks
    lo = split * per
    hi = tl.minimum(K, lo + per)
    if not TMA:
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        x_cols = x_ptr + m[None, :] * stride_xm
    pdl_enter(PDL)
    acc = tl.zeros([BN, BM], tl.float32)
    if TMA:
        for k0 in range(lo, hi, BK):
            w = w_ptr.load([tile * BN, k0])
            x = x_ptr.load([block * BM, k0])
            if GATED:  # x holds [gate | up]
                x = _silu_mul(x, up_ptr.load([block * BM, k0]))
            if FP8 and IEEE:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = _dot(w, tl.trans(x), acc, IEEE)
    else:
        for k0 in range(lo, hi, BK):
            k = k0 + tl.arange(0, BK)
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < hi)[None, :], other=0.0)
            x = _x_tile(x_cols, k, m_ok, hi, K, GATED, not EVEN_K)
            if FP8 and IEEE:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = _dot(w, x, acc, IEEE)
    if FP8:
        w_scale = tl.load(ws_ptr + n, mask=n_ok, other=0.0)
        acc *= w_scale[:, None] * tl.load(xs_ptr + m, mask=m_ok, other=0.0)[None, :]
    out_at = out_ptr + m[None, :] * stride_om + n[:, None]
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        # partials [SPLIT, M_BLOCKS x BM, N] (fp32); the last program of this output tile (the
        # weight tile's row block) adds them in order
        part_at = part_ptr + m[None, :] * N + n[:, None]
        tl.store(part_at + split * stride_ps, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial stored before the count (release)
        counter = count_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
            tl.debug_barrier()
            tl.store(counter, 0)  # zero again for the next launch
            total = tl.zeros([BN, BM], tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(
                    part_at + s * stride_ps, mask=out_ok, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)


def tma_supported(device, element_size: int, *row_lengths: int) -> bool:
    """Whether `skinny_gemm(tma=True)` can serve inputs with these row lengths (K, elements of
    `element_size` bytes) on `device`: compute capability 9.0+ and 16-byte rows."""
    return hopper_or_later(device) and all(n * element_size % 16 == 0 for n in row_lengths)


def skinny_tiles(m: int, n: int, k: int, tma: bool = False, element_size: int = 2) -> dict:
    """Default tile settings for an `[m, k] @ [n, k]^T` product, from the H200 sweep at one
    row (benchmarks/gemm_shapes.py --ours, docs/perf-log/). Wide outputs (96+ tiles of
    64 weight rows) are not split and stream 256 columns a step; narrow ones with a long K
    are split about every 1,600 columns (tiles of 128 rows from K = 8,192). These rules give
    the sweep's best setting at each Higgs projection (qkv, o, gate-up, down, audio head).
    With `tma` the wide outputs take the TMA sweep's best at one row instead (qkv: four
    stages; gate-up, 19,456 rows: 128-row tiles of 128 columns, eight warps). Taller x tiles
    (more than 16 rows) drop pipeline stages to fit the shared memory, down to two, then
    halve the chunk of columns. fp8 operands take the fp8 sweeps' winners where they found
    better (`_fp8_sweep_tiles`). Otherwise, up to 64 rows the budget
    reckons two bytes an element, fp8 operands too (the measured fp8 defaults are those
    tiles); above, `element_size` bytes (only fp8 weights take this kernel there), and eight
    warps where the fp32 accumulator holds 16,384 elements (128 a thread, not 256)."""
    bm = min(TILE_ROWS, max(16, triton.next_power_of_2(m)))
    swept = _fp8_sweep_tiles(bm, n, k, tma) if element_size == 1 else None
    if swept is not None:
        return swept
    warps = 4
    if triton.cdiv(n, 64) >= 96 and tma and n >= 16384:
        bn, bk, split, stages, warps = 128, 128, 1, 3, 8
    elif triton.cdiv(n, 64) >= 96:
        bn, bk, split, stages = 64, 256, 1, 4 if tma else 3
    else:
        bn, bk, stages = (128 if k >= 8192 else 64), 128, 4
        split = max(1, min(triton.cdiv(k, 128), round(k / 1600)))
    size = element_size if bm > 64 else 2
    if bn * bm >= 16384:
        warps = 8
    # each stage holds a weight and an x tile; the epilogue an fp32 [bn, bm] tile
    while stages * (bn + bm) * bk * size + bn * bm * 4 > 220 * 1024:
        if stages > 2:
            stages -= 1
        elif bk > 64:
            bk //= 2
        else:
            break
    return dict(block_m=bm, block_n=bn, block_k=bk, split=split, num_warps=warps, num_stages=stages)


def _fp8_sweep_tiles(bm: int, n: int, k: int, tma: bool) -> dict | None:
    """Tiles for float8 operands in 64- and 128-row tiles (33-128 rows): the H200 sweep's
    winners (benchmarks/fp8_gemm.py --sweep, docs/perf-log/2026-12-06-session-27.md), each
    8-30% faster than the two-byte rules above: narrow outputs (o, down) and qkv stream
    64-row weight slabs of 256 columns in four stages (qkv in 64-row tiles: 512 columns, three),
    the narrow ones split in three; gate-up's TMA tiles take four warps and four stages at
    64 rows. They fit the shared memory in fp8 bytes (each compiled and ran there). In 16-
    and 32-row tiles (1-32 rows) the narrow outputs' tiles are the same: the H100 sweep's
    winners there (docs/perf-log/2026-12-07-session-31.md; o 8.8 / 9.2 us, down 13.5 / 14.1
    at 16 / 32 rows against 9.7 / 10.2 and 15.4 / 16.3 for the two-byte rules with TMA); qkv
    and gate-up gained under 0.4 us there and keep the rules. None where the rules above won
    or nothing was measured (gate-up at 128 rows or without TMA, narrow K)."""
    if k < 2048:  # measured at the Higgs widths (K 2,560 to 9,728) only
        return None
    wide = triton.cdiv(n, 64) >= 96
    if wide and bm < 64:
        return None
    if wide and n >= 16384:  # gate-up
        if bm == 64 and tma:
            return dict(block_m=64, block_n=128, block_k=128, split=1, num_warps=4, num_stages=4)
        return None
    bk, stages = (512, 3) if wide and bm == 64 else (256, 4)
    split = 1 if wide else 3
    return dict(block_m=bm, block_n=64, block_k=bk, split=split, num_warps=4, num_stages=stages)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor | None = None,
    gated: bool = False,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
    split: int = 1,
    num_warps: int = 4,
    num_stages: int = 4,
    tma: bool = False,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x [M, K] @ weight [N, K]^T -> [M, N]` in x's dtype (fp32 accumulation), for M up to
    MAX_ROWS, in blocks of `block_m` rows (at most TILE_ROWS) that each read the weight tile.
    `counters`: int32, at least `ceil(N / block_n) * ceil(M / block_m)`, all zero; every launch
    leaves them zero (allocate once, share between launches on one stream and graph replays).
    `gated`: x is `[M, 2K]` = [gate | up] and the product is `silu_mul(x) @ weight^T` (the MLP's
    activation folded into the down projection). Tile knobs as `skinny_tiles`, which gives the
    defaults the engine uses; `tma`: tiles fetched by the copy engine (Hopper tensor memory
    access, through tensor descriptors; needs 16-byte aligned rows) instead of per-thread loads
    (faster on the H200 at 1 to 16 rows, slower at 64: docs/perf-log/). `weight_scale`,
    `x_scale`: fp32, one per output row of `weight` and one per row of `x`, for float8 operands
    (W ~ weight * weight_scale, rows ~ x * x_scale): half the weight bytes streamed; the output
    in `out_dtype` (bf16 on a GPU; fp32 widens the operands and multiplies in fp32, for the CPU
    interpreter, whose bf16 and fp8 products are wrong)."""
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    if x.shape[1] != (2 * k if gated else k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x [M, K], weight [N, K], K contiguous: got {x.shape}, {weight.shape}")
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (x.dtype == torch.float8_e4m3fn) or (
        fp8 and (weight_scale is None or x_scale is None or gated)
    ):
        raise ValueError("float8 operands: both, with weight_scale and x_scale, not gated")
    block_m = block_m or min(TILE_ROWS, max(16, triton.next_power_of_2(m)))
    if block_m > TILE_ROWS:
        raise ValueError(f"block_m is at most {TILE_ROWS}, got {block_m}")
    m_blocks = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, block_n) * m_blocks
    if split > 1 and (counters.dtype != torch.int32 or counters.numel() < tiles):
        raise ValueError(f"counters must be int32 with at least {tiles} elements")
    out_dtype = out_dtype or x.dtype
    out = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out
    parts = out  # unused without a split
    if split > 1:
        parts = torch.empty(split, m_blocks * block_m, n, dtype=torch.float32, device=x.device)
    x_arg, up_arg, w_arg = x, x, weight
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if (x.stride(0) * x.element_size()) % 16 or (k * x.element_size()) % 16:
            raise ValueError("tma needs rows (and for gated, the up half) 16-byte aligned")
        x_arg = TensorDescriptor.from_tensor(x[:, :k], [block_m, block_k])
        up_arg = TensorDescriptor.from_tensor(x[:, k:], [block_m, block_k]) if gated else x_arg
        w_arg = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _skinny_gemm_kernel[(tiles, split)](
        x_arg,
        up_arg,
        w_arg,
        weight_scale if fp8 else out,
        x_scale if fp8 else out,
        out,
        parts,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        parts.stride(0) if split > 1 else 0,
        m_blocks,
        BM=block_m,
        BN=block_n,
        BK=block_k,
        SPLIT=split,
        EVEN_K=k % block_k == 0,  # whole chunks: every split's columns lie below K
        IEEE=out.dtype == torch.float32,
        GATED=gated,
        TMA=tma,
        FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(),
    )
    return out
