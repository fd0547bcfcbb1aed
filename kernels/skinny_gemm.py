"""`y = x @ W.T` for few rows (decode batches of 1..256 tokens) and large weights, in Triton.

At such shapes a GEMM is a stream over the weight matrix. Every program owns a `BLOCK_N`
column tile and a `1 / SPLIT_K` share of the reduction, so that even a narrow output
(2,560 columns) gives every SM several independent weight streams; with `SPLIT_K > 1` the
partial sums are added atomically into an fp32 buffer and cast at the end. `W` keeps the
checkpoint's `[out, in]` layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_steps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(first, last):
        k = step * BLOCK_K + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + k[:, None],
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(x, w, acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_stages: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """x `[M, K]` @ weight `[N, K]`.T -> `[M, N]` in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](
        x,
        weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_stages=num_stages,
        num_warps=num_warps,
    )
    return y if split_k == 1 else y.to(x.dtype)
