"""The few-row GEMV (plain, with add + RMSNorm folded in, with SiLU-mul folded in) against its
torch reference: small shapes on the CPU (Triton interpreter), the Higgs projections in bf16 on
a GPU, with and without programmatic dependent launch, eagerly and replayed from a graph."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import MAX_ROWS, gemv, gemv_reference
from kernels.launch import use_pdl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _inputs(m, k, n, silu=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if silu else k, generator=g).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, DTYPE)
    r = torch.randn(m, k, generator=g).to(DEVICE, DTYPE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, DTYPE)
    return x, w, r, nw


def _check(out, ref):
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < tol, f"relative error {err:.3e}"


# (M, K, N, BLOCK_N, BLOCK_K): K and N not multiples of the blocks included
SHAPES = [(1, 64, 48, 16, 32), (3, 100, 37, 8, 64), (MAX_ROWS, 96, 40, 16, 64)]


@pytest.mark.parametrize("m, k, n, bn, bk", SHAPES)
def test_plain(m, k, n, bn, bk):
    x, w, _, _ = _inputs(m, k, n)
    _check(gemv(x, w, block_n=bn, block_k=bk), gemv_reference(x, w))


@pytest.mark.parametrize("m, k, n, bn, bk", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_folded(m, k, n, bn, bk, with_residual):
    x, w, r, nw = _inputs(m, k, n, seed=1)
    residual = r if with_residual else None
    out, total = gemv(x, w, norm_weight=nw, residual=residual, eps=1e-6, block_n=bn, block_k=bk)
    ref, ref_total = gemv_reference(x, w, norm_weight=nw, residual=residual, eps=1e-6)
    assert torch.equal(total, ref_total)  # the next residual is exact
    assert (total is x) == (not with_residual)
    _check(out, ref)


@pytest.mark.parametrize("m, k, n, bn, bk", SHAPES)
def test_silu_folded(m, k, n, bn, bk):
    x, w, _, _ = _inputs(m, k, n, silu=True, seed=2)
    _check(gemv(x, w, silu=True, block_n=bn, block_k=bk), gemv_reference(x, w, silu=True))


def test_bad_arguments():
    x, w, r, nw = _inputs(2, 32, 16)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 32, dtype=DTYPE, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(x, w, silu=True)  # silu reads [M, 2K]
    with pytest.raises(ValueError, match="exclusive"):
        gemv(x, w, norm_weight=nw, silu=True)
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, residual=r)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_higgs_projections(m, pdl):
    """The four Higgs v3 projections (qkv, o, gate/up, down) as a decoder layer chains them,
    eagerly and from a CUDA graph, equal to the reference; with PDL the chain is the same."""
    hidden, q, kv, inter = 2560, 4096, 1024, 9728
    x, w_qkv, r, nw = _inputs(m, hidden, q + 2 * kv, seed=3)
    w_o = _inputs(m, q, hidden, seed=4)[1]
    w_gu = _inputs(m, hidden, 2 * inter, seed=5)[1]
    w_down = _inputs(m, inter, hidden, seed=6)[1]

    def layer():
        qkv, total = gemv(x, w_qkv, norm_weight=nw, residual=r)
        o = gemv(qkv[:, :q].contiguous(), w_o)
        gu, total2 = gemv(o, w_gu, norm_weight=nw, residual=total)
        return qkv, o, gu, gemv(gu, w_down, silu=True), total2

    qkv_ref, total_ref = gemv_reference(x, w_qkv, norm_weight=nw, residual=r)
    with use_pdl(pdl):
        eager = layer()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer()
    graph.replay()
    torch.cuda.synchronize()
    _check(eager[0], qkv_ref)
    ref_gu, ref_total2 = gemv_reference(eager[1], w_gu, norm_weight=nw, residual=total_ref)
    assert torch.equal(eager[4], ref_total2)  # residual sums exact through the chain
    for e, c in zip(eager, captured, strict=True):
        assert torch.equal(e, c)  # graph replay equals eager, bit for bit
    _check(eager[1], gemv_reference(eager[0][:, :q].contiguous(), w_o))
    _check(eager[2], ref_gu)
    _check(eager[3], gemv_reference(eager[2], w_down, silu=True))
