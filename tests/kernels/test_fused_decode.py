"""The fused decode launch (q/k-norm + RoPE + K/V store + paged attention) against the two
launches it replaces: bit for bit, on the CPU (Triton interpreter) and on a GPU at the Higgs
shape."""

from __future__ import annotations

import pytest
import torch

from engine.model import RotaryEmbedding
from kernels.norm_rope import qk_norm_rope_store
from kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_decode_attention_fused,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode_batch(ctx, hq, hkv, d, page, dtype, padding_tokens, seed):
    """Sequences with one query token each (context `ctx[b]`; None: a padding sequence with
    none), then `padding_tokens` tokens of no sequence (slots in the reserved block 0)."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [0 if c is None else 1 for c in ctx]
    seq_lens = [0 if c is None else c + 1 for c in ctx]
    pages = max(1, max(-(-s // page) for s in seq_lens))
    blocks = len(ctx) * pages + 1
    tables = (torch.randperm(blocks - 1, generator=g)[: len(ctx) * pages] + 1).view(len(ctx), pages)
    positions, slots = [], []
    for b, c in enumerate(ctx):
        if c is not None:  # the new token sits at position c, in its table's page c // page
            positions.append(c)
            slots.append(int(tables[b, c // page]) * page + c % page)
    real = len(positions)
    positions += [0] * padding_tokens
    slots += [i % page for i in range(padding_tokens)]
    t = real + padding_tokens
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    cache = torch.randn(2, blocks, page, hkv, d, generator=g).to(DEVICE, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = (
        qsl.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        tables.int().to(DEVICE),
    )
    as_device = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    return qkv, cache, as_device(positions), as_device(slots), meta, real


def _weights(hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(d)
    qw = (1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    kw = (1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    rope = RotaryEmbedding(d, 1e6, 4096).to(DEVICE)
    return qw, kw, rope.cos, rope.sin


CASES = [
    ((8, 2, 32, 16), [5, 0, None, 17, 40], 2),  # a padding sequence and two padding tokens
    ((4, 2, 16, 4), [3, 1, 0, 9, 30, 2, 11], 0),  # contexts ending mid-page and at page ends
]
if DEVICE == "cuda":
    CASES.append(((32, 8, 128, 16), [399] * 60 + [None] * 4 + [1, 2000, 15, 16], 5))


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("shape, ctx, padding", CASES)
@pytest.mark.parametrize(
    "heads_first, layout, prefetch",
    [(False, "nhd", False), (True, "nhd", False), (False, "hnd", False), (False, "nhd", True)],
)
def test_fused_decode_equals_norm_rope_store_then_attention(
    dtype, shape, ctx, padding, heads_first, layout, prefetch
):
    hq, hkv, d, page = shape
    qkv, cache, positions, slots, meta, real = _decode_batch(
        ctx, hq, hkv, d, page, dtype, padding, 7
    )
    norm = (*_weights(hq, hkv, d, dtype), positions, hq, hkv, 1e-6)
    scale = d**-0.5
    expected_cache = cache.clone()
    q = qk_norm_rope_store(qkv, *norm, expected_cache, slots)
    expected = paged_attention(q, expected_cache[0], expected_cache[1], *meta, scale, 1)

    ours_cache = cache.clone()
    if layout == "hnd":  # the same values in head-major memory, seen in the usual shape
        ours_cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    out = torch.full((qkv.shape[0], hq, d), float("nan"), dtype=dtype, device=DEVICE)
    paged_decode_attention_fused(
        qkv, *norm, ours_cache[0], ours_cache[1], slots, *meta, scale, out=out,
        heads_first=heads_first, prefetch_pages=prefetch,
    )  # fmt: skip
    if DEVICE == "cpu":  # the interpreter reduces both kernels' RMSNorm sums alike
        assert torch.equal(ours_cache, expected_cache)  # K/V where the two launches write them
        assert torch.equal(out[:real], expected[:real])
    else:  # on a GPU the sum's order follows the tile shape: equal within rounding
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(ours_cache, expected_cache, **tol)
        torch.testing.assert_close(out[:real], expected[:real], **tol)
    assert not torch.equal(ours_cache[:, 1:], cache[:, 1:])
    assert torch.equal(ours_cache[:, 0], cache[:, 0])  # padding tokens store nothing
    assert out[real:].isnan().all()  # tokens of no sequence get no output row
    ref = paged_attention_reference(q, expected_cache[0], expected_cache[1], *meta, scale)
    err = float((out[:real].float() - ref[:real].float()).norm() / ref[:real].float().norm())
    # fp32 on a GPU: tl.dot multiplies in TF32 (10-bit mantissas; an H100 gave up to 1.0e-3)
    tol = {torch.bfloat16: 1e-2, torch.float32: 2e-3 if DEVICE == "cuda" else 1e-5}[dtype]
    assert err <= tol


@pytest.mark.cuda
def test_fused_decode_repeated_at_the_higgs_shape_against_the_reference():
    """Twenty launches on fresh caches at batch 64 (bf16): every output within rounding of the
    plain torch attention over the two-launch path's q and cache. A missing barrier between
    the prologue's stores and the attention's loads would show as stale rows here."""
    for seed in range(20):
        ctx = [
            int(c)
            for c in torch.randint(1, 900, (64,), generator=torch.Generator().manual_seed(seed))
        ]
        qkv, cache, positions, slots, meta, real = _decode_batch(
            ctx, 32, 8, 128, 16, torch.bfloat16, 0, seed
        )
        norm = (*_weights(32, 8, 128, torch.bfloat16), positions, 32, 8, 1e-6)
        two = cache.clone()
        q = qk_norm_rope_store(qkv, *norm, two, slots)
        ref = paged_attention_reference(q, two[0], two[1], *meta, 128**-0.5).float()
        ours = cache.clone()
        out = paged_decode_attention_fused(qkv, *norm, ours[0], ours[1], slots, *meta, 128**-0.5)
        torch.testing.assert_close(ours, two, rtol=2e-2, atol=2e-2)
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= 1e-2, (seed, err)


def test_fused_decode_refuses_mismatched_inputs():
    qkv, cache, positions, slots, meta, _ = _decode_batch([3, 4], 4, 2, 16, 4, torch.float32, 0, 1)
    norm = (*_weights(4, 2, 16, torch.float32), positions, 4, 2, 1e-6)
    with pytest.raises(ValueError, match="one slot and one position per token"):
        paged_decode_attention_fused(qkv, *norm, cache[0], cache[1], slots[:1], *meta, 0.25)
    with pytest.raises(ValueError, match="qkv must be"):
        paged_decode_attention_fused(qkv[:, :-16], *norm, cache[0], cache[1], slots, *meta, 0.25)
    with pytest.raises(ValueError, match="k_cache must be"):  # head_dim last, contiguous
        k_dim_major = cache[0].transpose(2, 3).contiguous().transpose(2, 3)
        paged_decode_attention_fused(qkv, *norm, k_dim_major, k_dim_major, slots, *meta, 0.25)
    with pytest.raises(ValueError, match="same strides"):  # V laid out unlike K
        v_head_major = cache[1].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        paged_decode_attention_fused(qkv, *norm, cache[0], v_head_major, slots, *meta, 0.25)


@pytest.mark.parametrize("shape, ctx, padding", CASES)
def test_fused_decode_with_a_float8_cache(shape, ctx, padding):
    """A float8 (e4m3) KV cache: the fused launch stores K/V rounded as the two launches do
    and reads them back widened; its output equals attention over its own cache, within the
    fp16 rounding of q and the softmax weights that a float8 cache's attention computes in."""
    hq, hkv, d, page = shape
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    qkv, cache, positions, slots, meta, real = _decode_batch(
        ctx, hq, hkv, d, page, dtype, padding, 3
    )
    cache = cache.to(torch.float8_e4m3fn)
    norm = (*_weights(hq, hkv, d, dtype), positions, hq, hkv, 1e-6)
    scale = d**-0.5
    expected_cache = cache.clone()
    q = qk_norm_rope_store(qkv, *norm, expected_cache, slots)
    expected = paged_attention(q, expected_cache[0], expected_cache[1], *meta, scale, 1)
    ours_cache = cache.clone()
    out = paged_decode_attention_fused(
        qkv, *norm, ours_cache[0], ours_cache[1], slots, *meta, scale
    )
    if DEVICE == "cpu":
        assert torch.equal(ours_cache.view(torch.uint8), expected_cache.view(torch.uint8))
        assert torch.equal(out[:real], expected[:real])
    else:  # RMSNorm sums in another order: at most one float8 step apart, rarely
        torch.testing.assert_close(ours_cache.float(), expected_cache.float(), rtol=0.13, atol=2e-3)
    ref = paged_attention_reference(q, ours_cache[0], ours_cache[1], *meta, scale)
    err = float((out[:real].float() - ref[:real].float()).norm() / ref[:real].float().norm())
    assert err <= (5e-4 if dtype == torch.float32 else 2e-2)
    assert not torch.equal(ours_cache[:, 1:].view(torch.uint8), cache[:, 1:].view(torch.uint8))
