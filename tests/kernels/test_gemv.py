"""The few-row GEMV in each mode (plain, input normalised from partial sums, gated SiLU,
residual epilogue with partial sums) against its torch reference: small shapes on the CPU
(Triton interpreter), the Higgs projections chained as a layer in bf16 on a GPU, with and
without programmatic dependent launch, eagerly and replayed from a graph."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import MAX_ROWS, gemv, gemv_reference, square_sums
from kernels.launch import use_pdl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, DTYPE)


def _check(out, ref):
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < tol, f"relative error {err:.3e}"


# (M, K, N, tile): K and N not multiples of the tile included
SHAPES = [(1, 64, 48, (16, 32, 4)), (3, 100, 37, (8, 64, 4)), (MAX_ROWS, 96, 40, (16, 64, 2))]


@pytest.mark.parametrize("m, k, n, tile", SHAPES)
def test_plain(m, k, n, tile):
    x, w = _t(m, k, seed=0), _t(n, k, seed=1, scale=k**-0.5)
    _check(gemv(x, w, tile=tile), gemv_reference(x, w))


@pytest.mark.parametrize("m, k, n, tile", SHAPES)
@pytest.mark.parametrize("gated", [False, True])
def test_normalised_input(m, k, n, tile, gated):
    """The input's RMS from partial sums: one part per row, or the parts a residual epilogue
    writes (several programs)."""
    r, w = _t(m, k, seed=2), _t((2 if gated else 1) * n, k, seed=3, scale=k**-0.5)
    nw = 1 + 0.1 * _t(k, seed=4)
    ref = gemv_reference(r, w, norm_weight=nw, gated=gated)
    parts = square_sums(r)
    _check(gemv(r, w, norm_weight=nw, partials=parts, gated=gated, tile=tile), ref)
    # the same stream written by a residual epilogue (x @ I.T + 0 = x), its parts per program
    eye = torch.eye(k, device=DEVICE, dtype=DTYPE)
    again, parts = gemv(r, eye, residual=torch.zeros_like(r), tile=(16, 32, 4))
    assert torch.equal(again, r) and parts.shape == (m, -(-k // 16))
    torch.testing.assert_close(parts.sum(1, keepdim=True), square_sums(r), rtol=1e-4, atol=1e-4)
    _check(gemv(r, w, norm_weight=nw, partials=parts, gated=gated, tile=tile), ref)


@pytest.mark.parametrize("m, k, n, tile", SHAPES)
def test_residual_epilogue(m, k, n, tile):
    x, w, r = _t(m, k, seed=5), _t(n, k, seed=6, scale=k**-0.5), _t(m, n, seed=7)
    out, parts = gemv(x, w, residual=r, tile=tile)
    _check(out, gemv_reference(x, w, residual=r))
    assert parts.shape == (m, -(-n // tile[0])) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(1, keepdim=True), square_sums(out), rtol=1e-4, atol=1e-3)


def test_bad_arguments():
    x, w, r = _t(2, 32, seed=0), _t(16, 32, seed=1), _t(2, 16, seed=2)
    with pytest.raises(ValueError, match="rows"):
        gemv(_t(MAX_ROWS + 1, 32, seed=0), w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(_t(2, 31, seed=0), w)
    with pytest.raises(ValueError, match="together"):
        gemv(x, w, norm_weight=_t(32, seed=3))
    with pytest.raises(ValueError, match="excludes gated"):
        gemv(x, w, residual=r, gated=True)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_higgs_layer_chain(m, pdl):
    """The Higgs v3 projections chained as the few-row layer runs them (qkv from the
    normalised stream, o with the residual, gated gate/up, down with the residual), eagerly
    and from a CUDA graph, against the reference chain; replay equals eager bit for bit."""
    hidden, q, kv, inter = 2560, 4096, 1024, 9728
    r0 = _t(m, hidden, seed=10)
    w_qkv = _t(q + 2 * kv, hidden, seed=11, scale=hidden**-0.5)
    w_o = _t(hidden, q, seed=12, scale=q**-0.5)
    w_gu = _t(2 * inter, hidden, seed=13, scale=hidden**-0.5)
    w_down = _t(hidden, inter, seed=14, scale=inter**-0.5)
    nw1, nw2 = 1 + 0.1 * _t(hidden, seed=15), 1 + 0.1 * _t(hidden, seed=16)

    def layer():
        qkv = gemv(r0, w_qkv, norm_weight=nw1, partials=square_sums(r0))
        r1, p1 = gemv(qkv[:, :q].contiguous(), w_o, residual=r0)
        act = gemv(r1, w_gu, norm_weight=nw2, partials=p1, gated=True)
        r2, p2 = gemv(act, w_down, residual=r1)
        return qkv, r1, act, r2, p2

    with use_pdl(pdl):
        eager = layer()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured, strict=True):
        assert torch.equal(e, c)
    qkv, r1, act, r2, p2 = eager
    _check(qkv, gemv_reference(r0, w_qkv, norm_weight=nw1))
    _check(r1, gemv_reference(qkv[:, :q], w_o, residual=r0))
    _check(act, gemv_reference(r1, w_gu, norm_weight=nw2, gated=True))
    _check(r2, gemv_reference(act, w_down, residual=r1))
    torch.testing.assert_close(p2.sum(1, keepdim=True), square_sums(r2), rtol=1e-3, atol=1e-2)
