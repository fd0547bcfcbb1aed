"""The skinny GEMM (plain and split-K) against `x @ W.T`: small shapes on the CPU (Triton
interpreter), the Higgs decode shapes in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.skinny_gemm import skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "m, n, k, cfg",
    [
        (1, 40, 70, (16, 32, 1, 2, 4)),
        (5, 64, 100, (32, 32, 3, 2, 4)),  # split-K with a ragged last split
        (17, 33, 64, (16, 16, 2, 2, 4)),
        (70, 48, 96, (16, 32, 4, 2, 4)),  # more splits than some programs have K steps
    ],
)
def test_small_shapes_match_the_reference(m, n, k, cfg):
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    y = skinny_gemm(x, w, *cfg)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
@pytest.mark.parametrize("m", [1, 64, 128])
@pytest.mark.parametrize("split_k", [1, 4])
def test_higgs_decode_shapes_bf16(m, n, k, split_k):
    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    y = skinny_gemm(x, w, 64, 128, split_k).float()
    ref = x.float() @ w.float().t()
    assert float((y - ref).norm() / ref.norm()) < 1e-2
