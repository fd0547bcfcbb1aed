"""The codec's Snake activation, `x + sin(alpha * x)^2 / (alpha + 1e-9)` with one alpha per
channel, in one pass over `[B, C, T]`.

Unfused, torch runs it as five elementwise kernels (multiply, sin, square, reciprocal-multiply,
add), each reading and writing the whole activation; the decoder applies it 36 times per
window, on tensors of up to 32 x 960 samples per frame. One launch reads x once and writes the
result once; the arithmetic runs in fp32 whatever the storage dtype. Takes `[B, C, T]`
contiguous or `[B, C, 1, T]` channels-last (NHWC memory, channel fastest). Knows nothing of
codecs: tensors in, tensor out. The torch reference is `snake_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, out_ptr, n, C, T, BLOCK: tl.constexpr, NHWC: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    channel = offs % C if NHWC else (offs // T) % C
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    alpha = tl.load(alpha_ptr + channel, mask=ok, other=1.0).to(tl.float32)
    s = tl.sin(alpha * x)
    y = x + s * s / (alpha + 1e-9)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def snake(x: torch.Tensor, alpha: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x `[B, C, T]` (contiguous) or `[B, C, 1, T]` (channels-last), alpha `[1, C, 1]` or
    `[C]` -> a new tensor like x (same memory format)."""
    nhwc = x.dim() == 4 and x.shape[2] == 1 and x.is_contiguous(memory_format=torch.channels_last)
    if not nhwc and (x.dim() != 3 or not x.is_contiguous()):
        raise ValueError(
            "snake needs a contiguous [B, C, T] or a channels-last [B, C, 1, T] tensor, got "
            f"{tuple(x.shape)} with strides {x.stride()}"
        )
    c, t = x.shape[1], x.shape[-1]
    if alpha.numel() != c:
        raise ValueError(f"snake: {alpha.numel()} alphas for {c} channels")
    n = x.numel()
    if n >= 2**31:
        raise ValueError("snake: tensor too large for 32-bit offsets")
    out = torch.empty_like(x)  # preserves the memory format
    if n:
        grid = (triton.cdiv(n, block),)
        _snake_kernel[grid](x, alpha.reshape(c), out, n, c, t, BLOCK=block, NHWC=nhwc)
    return out


def snake_reference(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Plain torch, in x's dtype: the definition the kernel is tested against."""
    alpha = alpha.reshape(1, -1, *[1] * (x.dim() - 2))
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
