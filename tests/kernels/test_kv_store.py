"""The fused KV-cache store against the torch reference (`engine.attention.store_kv`): small
shapes on the CPU (Triton interpreter), the Higgs shape in bf16 on a GPU. V is read as a view
into a fused QKV tensor, as the model passes it; padding rows (reserved block 0) are skipped."""

from __future__ import annotations

import pytest
import torch

from engine.attention import store_kv
from kernels.kv_store import store_kv_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, hkv, d, num_blocks, block_size, dtype, seed, padding):
    g = torch.Generator().manual_seed(seed)
    q_width = 4 * hkv * d
    qkv = torch.randn(t, q_width + 2 * hkv * d, generator=g).to(DEVICE, dtype)
    k = torch.randn(t, hkv, d, generator=g).to(DEVICE, dtype)  # as q/k-norm+RoPE returns it
    v = qkv[:, q_width + hkv * d :].view(t, hkv, d)  # a strided view, like the model's
    slots = torch.randperm((num_blocks - 1) * block_size, generator=g)[:t] + block_size
    slots[t - padding :] = torch.arange(padding) % block_size  # padding rows: block 0
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    return k, v, cache, slots.to(DEVICE)


def _head_major(cache):
    """The same values in head-major memory ([2, blocks, Hkv, page, D] permuted back)."""
    return cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


@pytest.mark.parametrize(
    "t, hkv, d, blocks, bs, padding",
    [(1, 2, 16, 4, 4, 0), (7, 2, 16, 6, 4, 2), (33, 4, 32, 20, 8, 5), (5, 8, 128, 4, 16, 1)],
)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_matches_the_reference_and_skips_padding(t, hkv, d, blocks, bs, padding, layout):
    k, v, cache, slots = _case(t, hkv, d, blocks, bs, torch.float32, t * 7 + d, padding)
    ours = cache.clone() if layout == "nhd" else _head_major(cache)
    ref = cache.clone()
    store_kv_fused(k, v, ours, slots)
    store_kv(k, v, ref, slots)
    torch.testing.assert_close(ours[:, 1:], ref[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(ours[:, 0], cache[:, 0], rtol=0, atol=0)  # block 0 untouched
    assert not torch.equal(ours[:, 1:], cache[:, 1:])  # it really wrote


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_higgs_shape_bf16(layout):
    k, v, cache, slots = _case(512, 8, 128, 600, 16, torch.bfloat16, 3, 40)
    ours = cache.clone() if layout == "nhd" else _head_major(cache)
    ref = cache.clone()
    store_kv_fused(k, v, ours, slots)
    store_kv(k, v, ref, slots)
    assert torch.equal(ours[:, 1:], ref[:, 1:]) and torch.equal(ours[:, 0], cache[:, 0])


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_a_float8_cache_gets_the_references_bytes_and_saturates(layout):
    """Into a float8 (e4m3) cache: the same bytes as the torch reference (which also writes
    padding rows), values beyond +-448 saturate (torch's own cast would give NaN), padding
    rows untouched."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    k, v, cache, slots = _case(9, 2, 16, 6, 4, dtype, 11, 2)
    # values float8 holds exactly (Triton's CPU interpreter rounds some others wrongly: 7.9
    # -> 4, 127 -> 64; the GPU's conversion rounds to nearest even), a few beyond its range
    k = (k * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(dtype)
    v = v.to(torch.float8_e4m3fn).to(dtype)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 449.0, 5e4])
    cache = cache.to(torch.float8_e4m3fn)
    ours = cache.clone() if layout == "nhd" else _head_major(cache)
    ref = cache.clone()
    store_kv_fused(k, v, ours, slots)
    store_kv(k, v, ref, slots)
    assert torch.equal(ours[:, 1:].view(torch.uint8), ref[:, 1:].view(torch.uint8))
    stored = ours[:, 1:].float()
    assert torch.isfinite(stored).all() and stored.abs().max() == 448
    assert torch.equal(ours[:, 0].view(torch.uint8), cache[:, 0].view(torch.uint8))
