"""Fused elementwise kernels of the decoder layer, each with its plain torch reference:
residual add + RMSNorm (optionally quantized to float8 for the projection it feeds),
per-head q/k RMSNorm + RoPE, and SiLU-gated multiply.

Rounding follows transformers' Qwen3 exactly (fp32 math, rounded to the model dtype at the
same points), so a fused step equals the unfused one up to the last-bit differences of fp32
transcendental functions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import quantize_row, soft_round
from kernels.kv_store import to_cache
from kernels.launch import pdl_enter, pdl_launch


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    scale_ptr,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    # QUANT: out_ptr is float8 and the normed row (rounded to x's dtype first, as the
    # unquantized output) is stored quantized, its scale at scale_ptr (kernels/fp8_quant.py)
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(dtype)
    if QUANT:
        quantize_row(y.to(tl.float32), mask, out_ptr + row * H, scale_ptr + row, SOFT_ROUND)
    else:
        tl.store(out_ptr + row * H + cols, y, mask=mask)


def _launch_add_rms_norm(x, residual, weight, eps, out, scale):
    total = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(x.shape[0],)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        total,
        scale if scale is not None else out,
        eps,
        H=x.shape[-1],
        BLOCK=triton.next_power_of_2(x.shape[-1]),
        HAS_RESIDUAL=residual is not None,
        QUANT=scale is not None,
        SOFT_ROUND=soft_round(),
        num_warps=8 if scale is not None else 4,  # the quantized row's temporaries: no spills
        **pdl_launch(),
    )
    return total


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); without a residual, (rms_norm(x), x)."""
    out = torch.empty_like(x)
    return out, _launch_add_rms_norm(x, residual, weight, eps, out, None)


def add_rms_norm_fp8(x, residual, weight, eps):
    """(float8 rows `[T, H]`, fp32 scales `[T, 1]`, x + residual): `add_rms_norm`'s output
    quantized per row as `fp8_quant.quantize_rows` would, in the same launch."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    total = _launch_add_rms_norm(x, residual, weight, eps, out, scale)
    return out, scale, total


def add_rms_norm_reference(x, residual, weight, eps):
    total = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    xf = total.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), total


@triton.jit
def norm_rope_rows(
    row, is_q, ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos, eps, D: tl.constexpr, dtype: tl.constexpr
):
    """Rows `[HEADS, D]` of one token's fused qkv (at pointers `row`, masked by `ok`) as two
    halves: (o1, o2) q/k RMSNorm (q's weight where `is_q`, k's elsewhere) then RoPE at `pos`,
    in `dtype` with transformers' rounding; (x1, x2) the raw rows in fp32 (v passes as is)."""
    half = tl.arange(0, D // 2)
    x1 = tl.load(row + half[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + D // 2 + half[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
    w1 = tl.where(is_q[:, None], tl.load(qw_ptr + half)[None, :], tl.load(kw_ptr + half)[None, :])
    w2 = tl.where(
        is_q[:, None],
        tl.load(qw_ptr + D // 2 + half)[None, :],
        tl.load(kw_ptr + D // 2 + half)[None, :],
    )
    n1 = (
        (w1.to(tl.float32) * (x1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    )
    n2 = (
        (w2.to(tl.float32) * (x2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    )
    c = tl.load(cos_ptr + pos * (D // 2) + half)[None, :]
    s = tl.load(sin_ptr + pos * (D // 2) + half)[None, :]
    return (n1 * c - n2 * s).to(dtype), (n2 * c + n1 * s).to(dtype), x1, x2


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    slot_ptr,
    stride_cp,  # cache strides: K/V plane, block, row in the block, head (D is contiguous)
    stride_cb,
    stride_cs,
    stride_ch,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HEADS: tl.constexpr,
    STORE: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # One program per token: every q and k head (and with STORE the v heads) as the rows of
    # one [HEADS, D/2] tile pair. With STORE, k and v go straight into the KV cache at the
    # token's slot (padding slots skipped) and k is not written out.
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)
    half = tl.arange(0, D // 2)
    is_q = head < HQ
    is_k = (head >= HQ) & (head < HQ + HKV)
    is_v = (head >= HQ + HKV) & (head < HQ + 2 * HKV)
    ok = (is_q | is_k | is_v)[:, None] if STORE else (is_q | is_k)[:, None]
    row = qkv_ptr + token * (HQ + 2 * HKV) * D + head[:, None] * D
    pos = tl.load(pos_ptr + token)
    o1, o2, x1, x2 = norm_rope_rows(
        row, is_q, ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos, eps, D, q_ptr.dtype.element_ty
    )
    q_row = q_ptr + token * HQ * D + head[:, None] * D
    tl.store(q_row + half[None, :], o1, mask=is_q[:, None])
    tl.store(q_row + D // 2 + half[None, :], o2, mask=is_q[:, None])
    if STORE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        keep = slot >= PAGE  # slots in the reserved block 0 are padding rows
        cdtype = cache_ptr.dtype.element_ty
        at = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        k_row = at + (head[:, None] - HQ) * stride_ch
        tl.store(k_row + half[None, :], to_cache(o1, cdtype), mask=is_k[:, None] & keep)
        tl.store(k_row + D // 2 + half[None, :], to_cache(o2, cdtype), mask=is_k[:, None] & keep)
        v_row = at + stride_cp + (head[:, None] - HQ - HKV) * stride_ch
        tl.store(v_row + half[None, :], to_cache(x1, cdtype), mask=is_v[:, None] & keep)
        tl.store(v_row + D // 2 + half[None, :], to_cache(x2, cdtype), mask=is_v[:, None] & keep)
    else:
        k_row = k_ptr + token * HKV * D + (head[:, None] - HQ) * D
        tl.store(k_row + half[None, :], o1, mask=is_k[:, None])
        tl.store(k_row + D // 2 + half[None, :], o2, mask=is_k[:, None])


def _launch_qk_norm_rope(
    qkv, q_weight, k_weight, cos, sin, positions, hq, hkv, eps, k, cache, slots
):
    t = qkv.shape[0]
    d = q_weight.shape[0]
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    store = cache is not None
    if store:
        if cache.stride(4) != 1 or tuple(cache.shape[3:]) != (hkv, d):
            raise ValueError(f"kv_cache must be [2, blocks, page, {hkv}, {d}], D contiguous")
        if tuple(slots.shape) != (t,):
            raise ValueError(f"one cache slot per token: {t} tokens, slots {tuple(slots.shape)}")
        strides, page = cache.stride()[:4], cache.shape[2]
    else:
        strides, page = (0, 0, 0, 0), 1
    _qk_norm_rope_kernel[(t,)](
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        positions,
        q,
        q if k is None else k,
        cache if store else q,
        slots if store else positions,
        *strides,
        eps,
        HQ=hq,
        HKV=hkv,
        D=d,
        HEADS=triton.next_power_of_2(hq + (2 if store else 1) * hkv),
        STORE=store,
        PAGE=page,
        **pdl_launch(),
    )
    return q


def qk_norm_rope(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads, eps):
    """From fused qkv `[T, (Hq + 2 Hkv) * D]`: normalised, rotated q `[T, Hq, D]` and
    k `[T, Hkv, D]`. cos/sin `[P, D/2]` fp32 tables."""
    t, d = qkv.shape[0], q_weight.shape[0]
    k = torch.empty(t, num_kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    q = _launch_qk_norm_rope(
        qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads, eps, k, None, None
    )
    return q, k


def qk_norm_rope_store(
    qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads, eps, kv_cache, slots
):
    """`qk_norm_rope` that also writes k and v into `kv_cache` `[2, blocks, page, Hkv, D]` at
    `slots` `[T]` (rows whose slot lies in the reserved block 0 are padding: not written),
    in the same launch; returns q only. Equals `qk_norm_rope` followed by the KV store."""
    args = (qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads, eps)
    return _launch_qk_norm_rope(*args, None, kv_cache, slots)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * 2 * INTER + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (act * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up = [gate | up]` `[T, 2I]` -> `[T, I]`."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, INTER=inter, BLOCK=block, **pdl_launch()
    )
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
