"""The FlashAttention backends (PyTorch's varlen kernel; the flash-attn package) against the
torch reference backend, on mixed batches (prefills with and without cached context, decode
rows) at the Higgs attention shape (GQA 32/8, head_dim 128, bf16, pages of 16): the real
kernels on an NVIDIA GPU (flash-attn where installed); on the CPU the backends' gather and
packing with a plain packed-attention stand-in for the kernel."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.attention import AttentionMetadata, FlashAttnAttention, TorchAttention, VarlenAttention
from engine.config import ConfigError

CASES = [([5, 1, 1, 12], [0, 30, 7, 20]), ([1] * 8, [40, 3, 99, 16, 1, 0, 64, 5])]


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
    """What varlen_attn computes, in fp32 one sequence at a time (causal, queries at the end
    of their sequence): the stand-in for the kernel on the CPU."""
    assert window_size == (-1, 0)
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].float()
        kb = k[cu_k[b] : cu_k[b + 1]].float().repeat_interleave(group, 1)
        vb = v[cu_k[b] : cu_k[b + 1]].float().repeat_interleave(group, 1)
        n, m = kb.shape[0], qb.shape[0]
        assert m <= max_q and n <= max_k
        scores = torch.einsum("thd,nhd->htn", qb, kb) * scale
        allowed = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vb).to(
            q.dtype
        )
    return out


def _flash_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal):
    """flash_attn_varlen_func's contract (causal aligned to the end of each sequence)."""
    assert causal
    return _packed_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, scale=softmax_scale, window_size=(-1, 0)
    )


@pytest.mark.cuda
@pytest.mark.parametrize("q_lens, ctx_lens", CASES)
def test_varlen_backend_matches_the_reference(q_lens, ctx_lens):
    _compare(q_lens, ctx_lens, torch.device("cuda"), VarlenAttention())


@pytest.mark.cuda
@pytest.mark.parametrize("q_lens, ctx_lens", CASES)
def test_flash_attn_backend_matches_the_reference(q_lens, ctx_lens):
    pytest.importorskip("flash_attn", reason="the optional flash-attn package is not installed")
    _compare(q_lens, ctx_lens, torch.device("cuda"), FlashAttnAttention())


@pytest.mark.parametrize("q_lens, ctx_lens", CASES)
def test_varlen_backend_packs_every_context_in_place_cpu(q_lens, ctx_lens, monkeypatch):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _packed_attention)
    _compare(q_lens, ctx_lens, torch.device("cpu"), VarlenAttention())


@pytest.mark.parametrize("q_lens, ctx_lens", CASES)
def test_flash_attn_backend_passes_the_packed_context_cpu(q_lens, ctx_lens, monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _flash_stand_in
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    _compare(q_lens, ctx_lens, torch.device("cpu"), FlashAttnAttention())


def test_flash_attn_backend_without_the_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        FlashAttnAttention()


def _compare(q_lens, ctx_lens, device, backend):
    g = torch.Generator().manual_seed(len(q_lens))
    hq, hkv, d, bs = 32, 8, 128, 16
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = len(q_lens) * max_blocks + 1
    tables = (torch.randperm(num_blocks - 1, generator=g)[: len(q_lens) * max_blocks] + 1).view(
        len(q_lens), max_blocks
    )
    slots = []
    for b, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for p in range(c, c + q):
            slots.append(int(tables[b, p // bs]) * bs + p % bs)
    t = sum(q_lens)
    cuda = device
    meta = AttentionMetadata(
        num_tokens=t,
        num_seqs=len(q_lens),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], device=cuda
        ).int(),
        seq_lens=torch.tensor(seq_lens, device=cuda).int(),
        block_tables=tables.int().to(cuda),
        slot_mapping=torch.tensor(slots, device=cuda),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(cuda, torch.bfloat16)
    q, k, v = (torch.randn(t, h, d, generator=g).to(cuda, torch.bfloat16) for h in (hq, hkv, hkv))
    ref = TorchAttention().forward(q, k, v, cache.clone(), meta, d**-0.5).float()
    out = backend.forward(q, k, v, cache.clone(), meta, d**-0.5).float()
    assert out.shape == ref.shape
    assert float((out - ref).norm() / ref.norm()) <= 2e-2
