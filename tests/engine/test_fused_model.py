"""The decoder stack with the fused Triton ops (q/k-norm+RoPE writing K/V into the cache,
add+RMSNorm, SiLU-mul) against the plain torch ops, on the CPU under the Triton interpreter:
a mixed batch (a prefill over two blocks, a short prefill, padding rows pointing into the
reserved block 0) then a decode step, torch and Triton attention backends, and the decode
step as one fused launch (the plan's `fused_decode`), and the projections through the few-row
GEMM (`few_row_gemm_rows`). On a GPU the same paths are covered by the CUDA parity and graph
tests."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, attention_context, make_backend
from engine.config import ModelConfig
from engine.model import HiggsModel
from engine.plan import ExecutionPlan

CFG = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=256,
)
PAGE, BLOCKS = 4, 8


def _run(
    fused: bool,
    backend: str,
    fuse_decode: bool = False,
    kv_dtype=None,
    skinny_rows: int = 0,
    skinny_loads: dict | None = None,
    prefetch: bool = False,
    flat: bool = False,
):
    torch.manual_seed(0)
    plan = ExecutionPlan(
        attention_backend=backend,
        fused_ops=fused,
        fused_decode=fuse_decode,
        page_prefetch=prefetch,  # the one-pass kernel reads page ids a tile ahead
        flat_attention_grid=flat,  # the mixed step's launch: one program per query block
        few_row_gemm_rows=skinny_rows,
        few_row_gemm_tma=(skinny_loads or {}).get("tma", False),
    )
    attention = make_backend(plan)
    if fuse_decode:  # one launch for decode steps, even for these few sequences (no split)
        attention.split_target = 1
    model = HiggsModel(CFG, attention, plan)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    caches = [torch.zeros(2, BLOCKS, PAGE, 2, 16, dtype=kv_dtype) for _ in range(CFG.num_layers)]
    # sequence 0: 5 prefill tokens (blocks 1, 2); sequence 1: 2 tokens (block 3); two padding
    # rows with slots in block 0
    meta = AttentionMetadata(
        num_tokens=9,
        num_seqs=3,
        query_start_loc=torch.tensor([0, 5, 7, 7], dtype=torch.int32),
        seq_lens=torch.tensor([5, 2, 0], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0], [0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6, 7, 8, 12, 13, 0, 1]),
        max_query_len=5,
        max_seq_len=5,
    )
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 0, 0])
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    with attention_context(meta), torch.no_grad():
        hidden = model(x, positions, caches)
    # then a decode step: one token for each of the two sequences (slots 9 and 14), a padding
    # sequence and a padding token
    decode = AttentionMetadata(
        num_tokens=3,
        num_seqs=3,
        query_start_loc=torch.tensor([0, 1, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3, 0], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0], [0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([9, 14, 2]),
        max_query_len=1,
        max_seq_len=6,
    )
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with attention_context(decode), torch.no_grad():
        step = model(x, torch.tensor([5, 2, 0]), caches)
    return torch.cat([hidden[:7], step[:2]]), caches


# Rows of no sequence (padding) get no attention output (left uninitialised, as on the GPU)
# and may overflow downstream under the interpreter; they are never read.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "backend, fuse_decode, prefetch, flat",
    [
        ("torch", False, False, False),
        ("triton", False, False, False),
        ("triton", True, False, False),
        ("triton", True, True, False),
        ("triton", True, True, True),
    ],
)
def test_fused_ops_equal_torch_ops(backend, fuse_decode, prefetch, flat, monkeypatch):
    from engine.attention import TritonAttention

    ref_hidden, ref_caches = _run(False, "torch")
    calls = []
    original = TritonAttention.decode_fused
    monkeypatch.setattr(
        TritonAttention, "decode_fused", lambda self, *a: calls.append(1) or original(self, *a)
    )
    if flat:  # the tiny steps are below the size the engine takes the flat grid from
        monkeypatch.setattr("engine.attention.FLAT_GRID_MIN_TOKENS", 1)
    hidden, caches = _run(True, backend, fuse_decode, prefetch=prefetch, flat=flat)
    assert len(calls) == (CFG.num_layers if fuse_decode else 0)  # the decode step, every layer
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache[:, 1:], ref[:, 1:], rtol=1e-5, atol=1e-5)
        assert not cache[:, 0].any()  # the fused store skipped the padding rows
        assert cache[:, 1:].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # padding rows
@pytest.mark.parametrize(
    "skinny_rows, launches, loads",
    [
        (64, 2 * 4 * 2, {}),
        (3, 2 * 4, {}),
        (64, 2 * 4 * 2, {"tma": True}),
    ],
)
def test_skinny_gemm_projections_equal_torch_ops(skinny_rows, launches, loads, monkeypatch):
    """`few_row_gemm_rows`: the four projections of each layer through kernels/skinny_gemm.py
    (the down projection with the MLP's activation folded in) for steps of up to that many
    tokens (here the 9-token prefill and the 3-token decode step, or only the decode step),
    the same hidden states and caches as the torch ops."""
    import kernels.skinny_gemm

    ref_hidden, ref_caches = _run(False, "torch")
    calls = []
    original = kernels.skinny_gemm.skinny_gemm
    monkeypatch.setattr(
        kernels.skinny_gemm, "skinny_gemm", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    hidden, caches = _run(True, "triton", skinny_rows=skinny_rows, skinny_loads=loads)
    assert len(calls) == launches  # 2 layers x 4 projections per step taken
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache[:, 1:], ref[:, 1:], rtol=1e-5, atol=1e-5)


def test_skinny_gemm_needs_the_fused_ops():
    plan = ExecutionPlan(few_row_gemm_rows=8)  # without fused ops
    with pytest.raises(ValueError, match="fused"):
        HiggsModel(CFG, make_backend(plan), plan)


def test_a_float8_cache_is_lossy_but_close():
    """`kv_cache_dtype="fp8"` through the torch reference backend (the Triton kernels' float8
    path runs on the GPU: the CPU interpreter rounds some float8 conversions wrongly): the
    cache holds float8 values and the hidden states stay within a few percent of an exact
    cache's."""
    ref_hidden, _ = _run(False, "torch")
    hidden, caches = _run(False, "torch", kv_dtype=torch.float8_e4m3fn)
    assert all(c.dtype == torch.float8_e4m3fn for c in caches)
    assert caches[0][:, 1:].float().abs().sum() > 0
    err = float((hidden - ref_hidden).norm() / ref_hidden.norm())
    assert 0 < err < 5e-2, err
