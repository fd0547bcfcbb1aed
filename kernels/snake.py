"""The codec's Snake activation, `x + sin(alpha * x)^2 / (alpha + 1e-9)` with one alpha per
channel, in one pass over `[B, C, T]`.

Unfused, torch runs it as five elementwise kernels (multiply, sin, square, reciprocal-multiply,
add), each reading and writing the whole activation; the decoder applies it 36 times per
window, on tensors of up to 32 x 960 samples per frame. One launch reads x once and writes the
result once; the arithmetic runs in fp32 whatever the storage dtype. Takes `[B, C, T]`
contiguous or `[B, C, 1, T]` channels-last (NHWC memory, channel fastest).

Optionally the same pass first adds what the convolution before it left out: a per-channel
`bias` and a `residual` tensor (in that order, as torch would add them), and also writes that
sum (`return_sum`, the residual stream the next block adds to). On the H200 the convolutions'
own bias adds ran as separate broadcasting kernels, one per convolution. Knows nothing of
codecs: tensors in, tensors out. The torch reference is `snake_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _snake_kernel(
    x_ptr,
    alpha_ptr,
    out_ptr,
    bias_ptr,
    res_ptr,
    sum_ptr,
    n,
    C,
    T,
    BLOCK: tl.constexpr,
    NHWC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    WRITE_SUM: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    channel = offs % C if NHWC else (offs // T) % C
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + channel, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        # the residual first, as torch's `residual + (conv + bias)`; the same sum either way
        x = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32) + x
    if WRITE_SUM:
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=ok)
        x = x.to(tl.float32)  # the activation sees the stored (rounded) sum, as in torch
    alpha = tl.load(alpha_ptr + channel, mask=ok, other=1.0).to(tl.float32)
    s = tl.sin(alpha * x)
    y = x + s * s / (alpha + 1e-9)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _is_nhwc(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.shape[2] == 1 and x.is_contiguous(memory_format=torch.channels_last)


def snake(
    x: torch.Tensor,
    alpha: torch.Tensor,
    block: int = 1024,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    return_sum: bool = False,
):
    """x `[B, C, T]` (contiguous) or `[B, C, 1, T]` (channels-last), alpha `[1, C, 1]` or
    `[C]` -> a new tensor like x (same memory format): snake(x + bias + residual), bias `[C]`
    per channel, residual shaped and laid out like x. With `return_sum`: (the sum, its
    snake)."""
    nhwc = _is_nhwc(x)
    if not nhwc and (x.dim() != 3 or not x.is_contiguous()):
        raise ValueError(
            "snake needs a contiguous [B, C, T] or a channels-last [B, C, 1, T] tensor, got "
            f"{tuple(x.shape)} with strides {x.stride()}"
        )
    c, t = x.shape[1], x.shape[-1]
    if alpha.numel() != c:
        raise ValueError(f"snake: {alpha.numel()} alphas for {c} channels")
    if bias is not None and bias.numel() != c:
        raise ValueError(f"snake: {bias.numel()} biases for {c} channels")
    if residual is not None and (residual.shape != x.shape or residual.stride() != x.stride()):
        raise ValueError(
            f"snake: the residual {tuple(residual.shape)} {residual.stride()} must have x's "
            f"shape and memory layout {tuple(x.shape)} {x.stride()}"
        )
    n = x.numel()
    if n >= 2**31:
        raise ValueError("snake: tensor too large for 32-bit offsets")
    out = torch.empty_like(x)  # preserves the memory format
    total = torch.empty_like(x) if return_sum else out
    if n:
        grid = (triton.cdiv(n, block),)
        _snake_kernel[grid](
            x,
            alpha.reshape(c),
            out,
            bias.reshape(c) if bias is not None else x,
            residual if residual is not None else x,
            total,
            n,
            c,
            t,
            BLOCK=block,
            NHWC=nhwc,
            HAS_BIAS=bias is not None,
            HAS_RES=residual is not None,
            WRITE_SUM=return_sum,
        )
    return (total, out) if return_sum else out


def snake_reference(
    x: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, in x's dtype: the definition the kernel is tested against."""
    shape = (1, -1, *[1] * (x.dim() - 2))
    if bias is not None:
        x = x + bias.reshape(shape)
    if residual is not None:
        x = residual + x
    alpha = alpha.reshape(shape)
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
