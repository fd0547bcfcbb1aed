"""The decoder stack with the fused Triton ops (q/k-norm+RoPE writing K/V into the cache,
add+RMSNorm, SiLU-mul) against the plain torch ops, on the CPU under the Triton interpreter:
a mixed batch (a prefill over two blocks, a short prefill, padding rows pointing into the
reserved block 0), torch and Triton attention backends. On a GPU the same path is covered by
the CUDA parity and graph tests."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, attention_context, make_backend
from engine.config import ModelConfig
from engine.model import HiggsModel

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


def _run(fused: bool, backend: str, layout: str = "nhd"):
    torch.manual_seed(0)
    model = HiggsModel(CFG, make_backend(backend), fused)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    caches = [torch.zeros(2, BLOCKS, PAGE, 2, 16) for _ in range(CFG.num_layers)]
    if layout == "hnd":  # head-major memory, the usual shape
        caches = [torch.zeros(2, BLOCKS, 2, PAGE, 16).permute(0, 1, 3, 2, 4) for _ in caches]
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
    return hidden[:7], caches


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_ops_equal_torch_ops(backend, layout):
    ref_hidden, ref_caches = _run(False, "torch")
    hidden, caches = _run(True, backend, layout)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    for cache, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache[:, 1:], ref[:, 1:], rtol=1e-5, atol=1e-5)
        assert not cache[:, 0].any()  # the fused store skipped the padding rows
        assert cache[:, 1:].abs().sum() > 0
