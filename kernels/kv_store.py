"""Writes a step's keys and values into the paged KV cache in one launch.

One program per token copies its K and V rows (`[Hkv, D]` each, read through their strides, so
V can stay a view into the fused QKV output) to cache slot `slot_mapping[t]` (block
`slot // page`, row `slot % page`). The cache is addressed through its strides: `[2, blocks,
page, Hkv, D]` as allocated, or a view of a head-major allocation (`[2, blocks, Hkv, page,
D]` permuted). Padding rows (slots inside the reserved block 0) are skipped: nothing reads
them, so writing them would only cost bandwidth. The torch reference is
`engine.attention.store_kv`, which writes every row including padding.

A float8 (e4m3) cache stores each value rounded to nearest and saturated at +-448 (`to_cache`,
also used by the other kernels that write the cache); the attention kernels widen it to fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_enter, pdl_launch


@triton.jit
def to_cache(x, cdtype: tl.constexpr):
    """`x` in the cache's dtype; float8 e4m3 saturates at +-448 instead of becoming NaN."""
    if cdtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(cdtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,  # cache strides: K/V plane, block, row in the block, head (D is contiguous)
    stride_cb,
    stride_cs,
    stride_ch,
    PAGE: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < PAGE:  # the reserved padding block
        return
    h = tl.arange(0, HKV)[:, None]
    d = tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    tl.store(dst, to_cache(k, cache_ptr.dtype.element_ty))
    tl.store(dst + stride_cp, to_cache(v, cache_ptr.dtype.element_ty))


def store_kv_fused(
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], D contiguous
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    t, hkv, d = k.shape
    block_size = kv_cache.shape[2]
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    assert hkv & (hkv - 1) == 0 and d & (d - 1) == 0, "head count and size: powers of two"
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        PAGE=block_size,
        HKV=hkv,
        D=d,
        **pdl_launch(),
    )
