"""Per-row (per-token) dynamic float8 quantization of a projection's input, in one launch:
each row's absolute maximum sets its scale (amax / 448, the e4m3 maximum) and the row is
stored as `round(x * (448 / amax))` in float8 e4m3, ready for a row-wise scaled fp8 matmul.

`quantize_row` is the shared device function: kernels that produce a projection's input (the
residual add + RMSNorm in norm_rope.py) call it on their output tile, so the input is
quantized where it is made instead of in a launch of its own. Tensors in, tensors out; the
reference is `quantize_rows_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12  # an all-zero row (padding) gets this scale's quotient: zeros, never NaN


@triton.jit
def round_to_e4m3(v):
    """fp32 `v` (|v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still as
    fp32, so the cast that follows is exact. Rounded here rather than by the cast because
    Triton's CPU interpreter rounds an fp8 cast without carrying into the exponent (124.3
    became 64, not 128): with this the interpreter and the GPU store the same bytes."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)  # a >= 0: no sign bit; a <= 448: no overflow below
    # normal e4m3 (a >= 2**-6): keep 3 of fp32's 23 mantissa bits, round half to even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal e4m3: multiples of 2**-9 (a * 512 < 8 is exact, so is everything after)
    n = a * 512.0
    whole = n.to(tl.int32)
    frac = n - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = (whole + up.to(tl.int32)).to(tl.float32) * 0.001953125
    r = tl.where(a >= 0.015625, normal, sub).to(tl.int32, bitcast=True)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # kept, -0.0 too (as torch's cast)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scales(amax):
    """(scale, 1 / scale) of a row of absolute maximum `amax`, both rounded divisions as
    torch divides (Triton's own `/` is approximate), so the reference gets the same bits."""
    amax = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(amax, 448.0), tl.math.div_rn(448.0, amax)


@triton.jit
def store_fp8(y, mask, q_ptr, inverse, SOFT_ROUND: tl.constexpr):
    """Stores `y * inverse` (fp32 `[BLOCK]`, clamped to +-448) as float8 at `q_ptr + lane`.
    SOFT_ROUND (the interpreter): rounded by `round_to_e4m3`; on a GPU the cast itself
    (cvt.rn.satfinite) rounds the same way."""
    q = tl.clamp(y * inverse, -448.0, 448.0)
    if SOFT_ROUND:
        q = round_to_e4m3(q)
    tl.store(q_ptr + tl.arange(0, y.shape[0]), q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_row(y, mask, q_ptr, scale_ptr, SOFT_ROUND: tl.constexpr):
    """Stores a whole row `y` (fp32 `[BLOCK]`, already rounded to the model dtype; lanes
    outside `mask` ignored) as float8 at `q_ptr + lane`, its scale at `scale_ptr`."""
    scale, inverse = fp8_scales(tl.max(tl.where(mask, tl.abs(y), 0.0), 0))
    store_fp8(y, mask, q_ptr, inverse, SOFT_ROUND)
    tl.store(scale_ptr, scale)


@triton.jit
def _row_chunk(x_ptr, cols, K, GATED: tl.constexpr):
    """Columns `cols` of a row at `x_ptr` as fp32 (masked past K); with GATED, of silu(gate)
    * up of `[gate | up]`, rounded where norm_rope.silu_mul rounds."""
    mask = cols < K
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        act = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
        x = (act * up).to(dtype).to(tl.float32)
    return x, mask


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, GATED: tl.constexpr, BLOCK: tl.constexpr,
    SOFT_ROUND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per row, in chunks of BLOCK columns: the absolute maximum over the row,
    # then the chunks again (from the cache) quantized. Holding a whole row of the MLP's
    # 9,728 columns in registers spilled them (32 us a launch at 64 rows on the H200).
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = 0.0
    for k0 in range(0, K, BLOCK):
        x, mask = _row_chunk(x_row, k0 + tl.arange(0, BLOCK), K, GATED)
        amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(x), 0.0), 0))
    scale, inverse = fp8_scales(amax)
    for k0 in range(0, K, BLOCK):
        x, mask = _row_chunk(x_row, k0 + tl.arange(0, BLOCK), K, GATED)
        store_fp8(x, mask, q_ptr + row * K + k0, inverse, SOFT_ROUND)
    tl.store(scale_ptr + row, scale)


def soft_round() -> bool:
    """Whether kernels round to e4m3 themselves: under the CPU interpreter (see
    `round_to_e4m3`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def quantize_rows(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (float8 e4m3 `[M, K]`, fp32 scales `[M, 1]`), `x ~ q * scale`. `gated`:
    x is `[M, 2K]` = [gate | up] and the quantized rows are silu(gate) * up."""
    m, width = x.shape
    k = width // 2 if gated else width
    if x.stride(1) != 1:
        raise ValueError(f"quantize_rows needs contiguous rows, got strides {x.stride()}")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        GATED=gated,
        BLOCK=min(1024, triton.next_power_of_2(k)),
        SOFT_ROUND=soft_round(),
        num_warps=4,
        **pdl_launch(),
    )
    return q, scale


def quantize_rows_reference(x: torch.Tensor, gated: bool = False):
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX)
    # Tensor by tensor: rounded divisions, as the kernels' div_rn. With a Python number on
    # either side torch divides by way of a reciprocal on CUDA (one ulp off, seen on an H100).
    top = torch.full_like(amax, FP8_MAX)
    q = (xf * (top / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / top
