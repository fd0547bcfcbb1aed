"""`x @ W.T` for the few rows of a small decode step (one to a few streams), with the decoder
layer's elementwise steps folded into the projections so that a layer at one row is four
projection launches plus attention, every one of them PDL-capable (kernels/launch.py):

- `gemv(x, w)`: plain;
- `gemv(r, w, norm_weight=nw, partials=p)`: `rms_norm(r) * nw @ W.T` for the residual stream
  `r`, whose per-row sum of squares arrives as partial sums `p` from the launch that wrote `r`;
- `gemv(x, w, gated=True)`: W is `[gate; up]` (`[2I, K]`): `silu(x @ Wg.T) * (x @ Wu.T)`;
- `gemv(x, w, residual=r)`: `(x @ W.T + r, partials)`: the next residual stream and its
  per-program sums of squares (summed in a fixed order by the next launch: deterministic).

Rounding follows the unfused layer (norm_rope.py: add + RMSNorm, SiLU-mul; each projection
rounded to the model dtype before the next step). Each program owns BLOCK_N output columns
(BLOCK_N rows of W, contiguous along K) and walks K one weight tile ahead in registers; the
first tile is read before the PDL wait (weights are constant). Tensors in, tensors out; the
reference is `gemv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch

MAX_ROWS = 8  # more rows: a tensor-core GEMM reads W once for all of them just as well


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    nw_ptr,
    part_in_ptr,
    res_ptr,
    part_out_ptr,
    M,
    N,
    NUM_PARTS,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    K: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (gate columns when GATED)
    col_ok = cols < N
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + N * stride_wn  # GATED: W's up half starts N rows down
    first = col_ok[:, None] & (kk < K)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=first, other=0.0)
    wu = w
    if GATED:
        wu = tl.load(up_rows + kk[None, :], mask=first, other=0.0)
    pdl_enter(PDL)
    dtype = out_ptr.dtype.element_ty
    rstd = tl.zeros([M_PAD], tl.float32)
    if NORM:  # the row's sum of squares from the partial sums of the launch that wrote x
        p = tl.arange(0, PARTS_PAD)
        part_mask = row_ok[:, None] & (p < NUM_PARTS)[None, :]
        parts = tl.load(part_in_ptr + rows[:, None] * NUM_PARTS + p[None, :], mask=part_mask)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(part_mask, parts, 0.0), 1) / K + eps)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + kk
        k_ok = k < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (nw[None, :] * normed).to(dtype)
        x = x.to(tl.float32)[:, None, :]
        nk = k + BLOCK_K  # the next tile, read before this one is used (nothing past K)
        nmask = col_ok[:, None] & (nk < K)[None, :]
        w_cur = w
        w = tl.load(w_rows + nk[None, :], mask=nmask, other=0.0)
        acc += tl.sum(x * w_cur.to(tl.float32)[None, :, :], 2)
        if GATED:
            wu_cur = wu
            wu = tl.load(up_rows + nk[None, :], mask=nmask, other=0.0)
            acc_up += tl.sum(x * wu_cur.to(tl.float32)[None, :, :], 2)
    out_mask = row_ok[:, None] & col_ok[None, :]
    y = acc.to(dtype)
    if GATED:  # as silu_mul on the rounded projections
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    if RESIDUAL:  # the next residual stream, and this program's share of its sum of squares
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        yf = tl.where(out_mask, y.to(tl.float32), 0.0)
        tl.store(part_out_ptr + rows * tl.num_programs(0) + pid, tl.sum(yf * yf, 1), mask=row_ok)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=out_mask)


# (block_n, block_k, num_warps) per weight shape (rows, K), from benchmarks/gemm_shapes.py --gemv
# on the H200 at one row; other shapes take DEFAULT_TILE.
TILES = {
    (6144, 2560): (8, 512, 4),
    (2560, 4096): (4, 512, 2),
    (19456, 2560): (4, 512, 2),  # gate/up, gated: two weight tiles a step
    (2560, 9728): (4, 512, 2),
}
DEFAULT_TILE = (8, 256, 4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
):
    """`x [M, K]` (M <= MAX_ROWS, unit stride along K), `weight [N, K]` row-major -> `[M, N]`
    (`[M, N / 2]` when `gated`) in x's dtype; with `residual`, `(out, partials [M, P])`. See
    the module docstring for the modes. `tile` = (block_n, block_k, num_warps) overrides the
    shape's tuned tile (benchmarks/gemm_shapes.py)."""
    m, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    if weight.shape[1] != k or (gated and weight.shape[0] % 2):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit stride along K")
    if (norm_weight is None) != (partials is None):
        raise ValueError("gemv: norm_weight and partials go together")
    if partials is not None and (partials.shape[0] != m or not partials.is_contiguous()):
        raise ValueError(f"gemv: partials must be a contiguous [{m}, P]")
    if residual is not None and (gated or tuple(residual.shape) != (m, n)):
        raise ValueError(f"gemv: a residual must be [{m}, {n}] and excludes gated")
    block_n, block_k, num_warps = tile or TILES.get(tuple(weight.shape), DEFAULT_TILE)
    grid = triton.cdiv(n, block_n)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part_out = (
        torch.empty(m, grid, device=x.device, dtype=torch.float32) if residual is not None else out
    )
    num_parts = partials.shape[1] if partials is not None else 1
    _gemv_kernel[(grid,)](
        x,
        weight,
        out,
        norm_weight if norm_weight is not None else x,
        partials if partials is not None else x,
        residual if residual is not None else x,
        part_out,
        m,
        n,
        num_parts,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        K=k,
        M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PARTS_PAD=triton.next_power_of_2(num_parts),
        NORM=norm_weight is not None,
        GATED=gated,
        RESIDUAL=residual is not None,
        num_warps=num_warps,
        **pdl_launch(),
    )
    return (out, part_out) if residual is not None else out


def square_sums(x: torch.Tensor) -> torch.Tensor:
    """Partial sums of squares of `x [M, K]` as one part per row (`[M, 1]`, fp32): what a
    `gemv(..., residual=...)` would have handed on, for a stream written by other means."""
    return x.float().pow(2).sum(-1, keepdim=True)


def gemv_reference(x, weight, *, norm_weight=None, eps=1e-6, gated=False, residual=None):
    """The unfused ops in plain torch (norm from the whole row; `partials` play no part)."""
    from kernels.norm_rope import add_rms_norm_reference, silu_mul_reference

    if norm_weight is not None:
        x = add_rms_norm_reference(x, None, norm_weight, eps)[0]
    out = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
    if gated:
        out = silu_mul_reference(out)
    if residual is not None:
        out = (out.float() + residual.float()).to(out.dtype)
    return out
