"""The Triton paged-attention kernel against its plain torch reference: small shapes on the
CPU (Triton interpreter), the Higgs shape (GQA 32/8, head_dim 128, bf16) on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_reference, query_block_size

GPU = torch.cuda.is_available()


def make_batch(q_lens, ctx_lens, hq, hkv, d, page, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    max_pages = max(1, max(-(-s // page) for s in seq_lens))
    num_blocks = len(q_lens) * max_pages + 1
    k = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: len(q_lens) * max_pages] + 1).view(
        len(q_lens), max_pages
    )
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    meta = (
        qsl.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables.int().to(device),
    )
    return q, k, v, meta


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


CPU_CASES = [
    ([1, 1, 1], [5, 0, 17]),  # decode rows
    ([7, 1, 20, 0], [0, 9, 3, 0]),  # mixed, one padding sequence
    ([33], [10]),  # a prefill spanning several query blocks
    ([1] * 6, [40, 1, 2, 3, 4, 63]),
]


@pytest.mark.parametrize("q_lens, ctx_lens", CPU_CASES)
@pytest.mark.parametrize("hq, hkv, d, page", [(4, 2, 16, 4), (8, 2, 32, 16)])
def test_kernel_matches_reference_small(q_lens, ctx_lens, hq, hkv, d, page):
    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch(q_lens, ctx_lens, hq, hkv, d, page, torch.float32, device)
    out = torch.full_like(q, float("nan"))  # poisoned: every valid row must be written
    paged_attention(q, k, v, *meta, d**-0.5, max(q_lens), out=out)
    ref = paged_attention_reference(q, k, v, *meta, d**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= (3e-3 if GPU else 1e-5)  # tf32 dots on a GPU


def test_a_too_small_launch_bound_leaves_long_queries_uncomputed():
    """The capture-bound hazard in miniature: a launch sized for short queries skips the
    later query blocks of a long one."""
    device = "cuda" if GPU else "cpu"
    q_lens = [2 * query_block_size(1, 2) + 3, 1]
    q, k, v, meta = make_batch(q_lens, [4, 9], 4, 2, 16, 4, torch.float32, device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 0.25, max_query_len=1, out=out)
    assert torch.isnan(out[query_block_size(1, 2) : q_lens[0]]).all()
    paged_attention(q, k, v, *meta, 0.25, max_query_len=max(q_lens), out=out)
    assert torch.isfinite(out).all()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "q_lens, ctx_lens",
    [
        ([1] * 64, [400] * 64),
        ([212] + [1] * 44, [0] + [300] * 44),
        ([1], [2000]),
        ([128, 64, 1], [0, 700, 5]),
    ],
)
def test_kernel_matches_reference_higgs_shape_bf16(q_lens, ctx_lens):
    q, k, v, meta = make_batch(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 128**-0.5, max(q_lens), out=out)
    ref = paged_attention_reference(q, k, v, *meta, 128**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2
