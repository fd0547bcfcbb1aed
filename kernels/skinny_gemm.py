"""`y = x @ W.T` for few rows (decode batches of 1..256 tokens) and large weights, in Triton.

At such shapes a GEMM is a stream over the weight matrix: the kernel gives every SM several
independent column tiles and a deep load pipeline so the weights flow at memory bandwidth,
instead of a few large tiles. `W` keeps the checkpoint's `[out, in]` layout.
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
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + (k + rk)[None, :],
            mask=(rm[:, None] < M) & ((k + rk)[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + (k + rk)[:, None],
            mask=(rn[None, :] < N) & ((k + rk)[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(x, w, acc)
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int = 64,
    block_k: int = 128,
    num_stages: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """x `[M, K]` @ weight `[N, K]`.T -> `[M, N]` in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
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
        num_stages=num_stages,
        num_warps=num_warps,
    )
    return y
