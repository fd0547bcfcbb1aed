"""`x @ W.T` for the few rows of a small decode step (one to a few streams), with the layer's
elementwise step before it folded into the read of x, so a decoder layer at one row runs its
four projections as four launches and no separate norm or activation launches:

- `gemv(x, w)`: plain;
- `gemv(x, w, norm_weight=..., residual=...)`: `rms_norm(x + residual) @ W.T`, also returning
  `x + residual` (the next residual), rounded as `norm_rope.add_rms_norm`;
- `gemv(gate_up, w, silu=True)`: `(silu(gate) * up) @ W.T`, rounded as `norm_rope.silu_mul`.

At one row a projection is all weight reads. Each program owns BLOCK_N output columns (BLOCK_N
rows of W, contiguous along K) and walks K in BLOCK_K steps, one weight tile ahead in
registers; the first tile is read before the PDL wait (weights are constant), so the read
overlaps the previous kernel's tail. The normalised input needs the whole row's RMS: each
program recomputes it from the row (a few KiB from L2). Reductions in fp32, bf16 out.
Tensors in, tensors out; the reference is `gemv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch

MAX_ROWS = 8  # more rows: a tensor-core GEMM reads W once for all of them just as well


@triton.jit
def _input_tile(
    x_ptr,
    r_ptr,
    nw_ptr,
    rows,
    row_ok,
    k,
    k_ok,
    rstd,
    stride_xm,
    stride_rm,
    K: tl.constexpr,
    MODE: tl.constexpr,
    HAS_RES: tl.constexpr,
    dtype: tl.constexpr,
):
    """Rows `[M_PAD, BLOCK_K]` of the projection's input at columns `k`, in fp32 (values of
    `dtype`). MODE 0: x; 1: rms_norm(x + r) * nw (needs `rstd`); 2: silu(x[:, k]) * x[:, K + k]."""
    mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if MODE == 1:
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (w[None, :] * normed).to(dtype)
    elif MODE == 2:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + rows[:, None] * stride_xm + K + k[None, :], mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        x = (act * up.to(tl.float32)).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    M,
    N,
    eps,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_sm,
    K: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)
    pdl_enter(PDL)
    dtype = out_ptr.dtype.element_ty
    rstd = tl.zeros([M_PAD], tl.float32)
    if MODE == 1:  # the row's RMS over all K first; program 0 writes x + r (the residual)
        sq = tl.zeros([M_PAD], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + kk
            mask = row_ok[:, None] & (k < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
            if HAS_RES:
                r = tl.load(r_ptr + rows[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(sum_ptr + rows[:, None] * stride_sm + k[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + kk
        k_ok = k < K
        x = _input_tile(
            x_ptr,
            r_ptr,
            nw_ptr,
            rows,
            row_ok,
            k,
            k_ok,
            rstd,
            stride_xm,
            stride_rm,
            K,
            MODE,
            HAS_RES,
            dtype,
        )
        w_cur = w
        nk = k + BLOCK_K  # the next tile, read before this one is used (nothing past K)
        w = tl.load(w_rows + nk[None, :], mask=col_ok[:, None] & (nk < K)[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w_cur.to(tl.float32)[None, :, :], 2)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
):
    """`x [M, K]` (M <= MAX_ROWS; `[M, 2K]` gate|up with `silu`), `weight [N, K]` row-major ->
    `[M, N]` in x's dtype. With `norm_weight`: returns `(out, x + residual)` (or `(out, x)`
    without a residual) like `add_rms_norm`. block_n / block_k / num_warps are tuning knobs
    (benchmarks/gemm_shapes.py)."""
    m = x.shape[0]
    n, k = weight.shape
    if silu and norm_weight is not None:
        raise ValueError("gemv: norm_weight and silu are exclusive")
    if x.shape[1] != (2 * k if silu else k):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit stride along K")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("gemv: a residual needs norm_weight and x's shape")
    mode = 1 if norm_weight is not None else 2 if silu else 0
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    total = torch.empty_like(x) if residual is not None else x
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        out,
        total,
        m,
        n,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        weight.stride(0),
        out.stride(0),
        total.stride(0),
        K=k,
        M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MODE=mode,
        HAS_RES=residual is not None,
        num_warps=num_warps,
        **pdl_launch(),
    )
    return (out, total) if norm_weight is not None else out


def gemv_reference(x, weight, *, norm_weight=None, residual=None, eps=1e-6, silu=False):
    """The same in plain torch: the unfused ops, then `F.linear` in fp32, rounded once."""
    from kernels.norm_rope import add_rms_norm_reference, silu_mul_reference

    total = None
    if norm_weight is not None:
        x, total = add_rms_norm_reference(x, residual, norm_weight, eps)
    elif silu:
        x = silu_mul_reference(x)
    out = torch.nn.functional.linear(x.float(), weight.float()).to(weight.dtype)
    return (out, total) if norm_weight is not None else out
