"""The few-row GEMV against F.linear: small shapes on the CPU (Triton interpreter), the Higgs
layer shapes in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import MAX_ROWS, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "n, k, block_n, block_k", [(1, 16, 8, 16), (37, 96, 8, 32), (64, 100, 16, 32)]
)
def test_gemv_matches_linear_fp32(m, n, k, block_n, block_k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    out = gemv(x, w, block_n=block_n, block_k=block_k)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_gemv_reads_rows_through_their_stride_and_writes_into_out():
    g = torch.Generator().manual_seed(7)
    big = torch.randn(2, 80, generator=g).to(DEVICE)
    x = big[:, :64]  # row stride 80
    w = torch.randn(24, 64, generator=g).to(DEVICE)
    out = torch.full((2, 24), float("nan"), device=DEVICE)
    assert gemv(x, w, out=out, block_n=8, block_k=32) is out
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_gemv_rejects_shapes_it_does_not_handle():
    w = torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.zeros(1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.zeros(32, 1, device=DEVICE).t(), w.t().contiguous().t())


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_higgs_shapes_bf16(n, k, m):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = F.linear(x.float(), w.float())
    err = float((gemv(x, w).float() - ref).norm() / ref.norm())
    assert err <= 5e-3  # one bf16 rounding of an fp32 sum
