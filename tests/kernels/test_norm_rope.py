"""Fused add+RMSNorm, q/k-norm+RoPE and SiLU-mul against their torch references: small shapes
on the CPU (Triton interpreter), the Higgs shapes in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention import store_kv
from engine.model import RotaryEmbedding, TorchOps
from kernels.norm_rope import (
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope,
    qk_norm_rope_store,
    silu_mul,
    silu_mul_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _close(a, b, dtype):
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    # bf16: identical rounding points; allow one ulp where fp32 math differs in the last bit
    return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 100), (33, 256)])
def test_add_rms_norm(dtype, rows, hidden):
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    r = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    for residual in (None, r):
        out, total = add_rms_norm(x, residual, w, 1e-6)
        ref_out, ref_total = add_rms_norm_reference(x, residual, w, 1e-6)
        assert torch.equal(total, ref_total)
        assert _close(out, ref_out, dtype)


class _Attn:  # the attributes qk_norm_rope reads from the model's attention module
    def __init__(self, hq, hkv, d, dtype):
        from engine.model import RMSNorm

        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.q_size, self.kv_size = hq * d, hkv * d
        self.q_norm, self.k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        for norm in (self.q_norm, self.k_norm):
            norm.weight.data = (1 + 0.2 * torch.randn(d)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq, hkv, d, t",
    [(4, 2, 16, 5), (8, 2, 32, 3)] + ([(32, 8, 128, 9)] if DEVICE == "cuda" else []),
)
def test_qk_norm_rope(dtype, hq, hkv, d, t):
    attn = _Attn(hq, hkv, d, dtype)
    rope = RotaryEmbedding(d, 1e6, 4096).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    positions = torch.randint(0, 4096, (t,), device=DEVICE)
    q, k = qk_norm_rope(
        qkv, attn.q_norm.weight, attn.k_norm.weight, rope.cos, rope.sin, positions, hq, hkv, 1e-6
    )
    rq, rk = TorchOps.qk_norm_rope(attn, qkv, positions, rope)
    assert _close(q, rq, dtype) and _close(k, rk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq, hkv, d, t, blocks, page, padding",
    [(4, 2, 16, 5, 4, 4, 1), (8, 2, 32, 9, 6, 4, 0)]
    + ([(32, 8, 128, 77, 40, 16, 13)] if DEVICE == "cuda" else []),
)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_qk_norm_rope_store(dtype, hq, hkv, d, t, blocks, page, padding, layout):
    """The fused launch writes the cache exactly as q/k-norm+RoPE followed by the KV store,
    skips padding rows (slots in block 0) and returns the same q."""
    g = torch.Generator().manual_seed(t * 31 + d)
    attn = _Attn(hq, hkv, d, dtype)
    rope = RotaryEmbedding(d, 1e6, 4096).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    slots = torch.randperm((blocks - 1) * page, generator=g)[:t] + page
    slots[t - padding :] = torch.arange(padding) % page  # padding rows point into block 0
    slots = slots.to(DEVICE)
    cache = torch.randn(2, blocks, page, hkv, d, generator=g).to(DEVICE, dtype)
    args = (attn.q_norm.weight, attn.k_norm.weight, rope.cos, rope.sin, positions, hq, hkv, 1e-6)
    ref_q, ref_k = qk_norm_rope(qkv, *args)
    ref = cache.clone()
    store_kv(ref_k, qkv[:, (hq + hkv) * d :].view(t, hkv, d), ref, slots)
    ours = cache.clone()
    if layout == "hnd":  # the same values in head-major memory, seen in the usual shape
        ours = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    q = qk_norm_rope_store(qkv, *args, ours, slots)
    assert torch.equal(q, ref_q)
    assert torch.equal(ours[:, 1:], ref[:, 1:])
    assert torch.equal(ours[:, 0], cache[:, 0])  # padding rows wrote nothing
    assert not torch.equal(ours[:, 1:], cache[:, 1:])  # it really wrote


def test_qk_norm_rope_store_refuses_mismatched_slots_and_cache():
    attn = _Attn(4, 2, 16, torch.float32)
    rope = RotaryEmbedding(16, 1e6, 64).to(DEVICE)
    qkv = torch.randn(3, 8 * 16, device=DEVICE)
    args = (attn.q_norm.weight, attn.k_norm.weight, rope.cos, rope.sin)
    positions = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([4, 5, 6], device=DEVICE)
    with pytest.raises(ValueError, match="one cache slot per token"):
        qk_norm_rope_store(qkv, *args, positions, 4, 2, 1e-6, cache, slots[:2])
    with pytest.raises(ValueError, match="kv_cache must be"):
        qk_norm_rope_store(qkv, *args, positions, 4, 2, 1e-6, cache[..., :8], slots)
    assert not cache.any()  # nothing was written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 64), (6, 1500)])
def test_silu_mul(dtype, rows, inter):
    x = (3 * torch.randn(rows, 2 * inter, device=DEVICE)).to(dtype)
    assert _close(silu_mul(x), silu_mul_reference(x), dtype)
