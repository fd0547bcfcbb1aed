"""`x @ W.T` for a handful of rows (a decode step of one to a few streams), streaming the
weight once at as close to memory bandwidth as the shape allows.

At one row a linear layer is a matrix-vector product: all its time is reading W. Each program
owns BLOCK_N output columns (BLOCK_N rows of W, each contiguous along K) and walks K in
BLOCK_K steps, multiplying elementwise against the M input rows and reducing in fp32; no
tensor cores and no split-K, so one launch writes the bf16 result directly. Knows nothing of
models: tensors in, tensor out. The reference is `torch.nn.functional.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # beyond this, a tensor-core GEMM reads W once for all rows just as well


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for start in range(0, K, BLOCK_K):
        k = start + kk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None])
        else:
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + k[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [M, N, K]
        acc += tl.sum(prod, 2)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x `[M, K]` (M <= MAX_ROWS, unit stride along K), weight `[N, K]` (row-major) ->
    `[M, N]` in x's dtype. block_n / block_k / num_warps / num_stages are tuning knobs
    (benchmarks/gemm_shapes.py)."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"gemv: x has {k} columns, weight {k_w}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit stride along K")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
