"""The stream-K few-row GEMM (kernels/stream_k_gemm.py) against `F.linear`: small shapes on the
CPU under the Triton interpreter (shares that cut tiles in two and three, whole tiles between,
empty tails), the Higgs projections on a GPU; partials added in share order (the same bits
launch after launch), counters left zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.stream_k_gemm import stream_k_gemm, stream_k_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOADS = {"pointer": {}, "tma": {"tma": True}}
HIGGS = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (8208, 2560)]


def _operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize(
    "m,n,k,block_n,block_k,programs",
    [
        (1, 48, 64, 16, 32, 4),  # 6 units over 4 programs: tiles cut between two shares
        (3, 40, 96, 16, 32, 2),  # N not a whole number of tiles
        (5, 64, 80, 32, 32, 5),  # K not a whole number of chunks
        (16, 32, 256, 16, 32, 7),  # 16 units over 7 programs: a tile over three shares
        (17, 96, 64, 16, 16, 5),  # rows padded to 32; whole tiles inside shares
        (2, 32, 64, 16, 32, 64),  # more programs than units: one unit each
        (40, 48, 64, 16, 32, 1),  # one program: every tile whole
    ],
)
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_matches_linear(m, n, k, block_n, block_k, programs, loads):
    x, w = _operands(m, n, k, torch.float32)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    knobs = dict(block_n=block_n, block_k=block_k, programs=programs, num_stages=2, **LOADS[loads])
    out = stream_k_gemm(x, w, counters, **knobs)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0  # left zero for the next launch
    assert torch.equal(stream_k_gemm(x, w, counters, **knobs), out)


@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_gated_and_strided_output(loads):
    from kernels.norm_rope import silu_mul

    x, w = _operands(4, 32, 64, torch.float32, seed=1)
    gate_up, _ = _operands(4, 1, 128, torch.float32, seed=2)
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    knobs = dict(block_n=16, block_k=32, programs=3, **LOADS[loads])
    big = torch.full((4, 48), 7.0, device=DEVICE)
    out = stream_k_gemm(x, w, counters, out=big[:, :32], **knobs)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(big[:, 32:], torch.full((4, 16), 7.0, device=DEVICE))
    folded = stream_k_gemm(gate_up, w, counters, gated=True, **knobs)
    torch.testing.assert_close(folded, F.linear(silu_mul(gate_up), w), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_do():
    x, w = _operands(4, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="at most 128 rows"):
        stream_k_gemm(torch.zeros(129, 64, device=DEVICE), w, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="counters"):
        stream_k_gemm(x, w, torch.zeros(1, dtype=torch.int32, device=DEVICE), block_n=16)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        stream_k_gemm(x[:, :32], w, torch.zeros(4, dtype=torch.int32, device=DEVICE))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 128])
@pytest.mark.parametrize("n,k", HIGGS)
def test_higgs_shapes_on_the_gpu(m, n, k):
    from kernels.launch import use_pdl

    x, w = _operands(m, n, k, torch.bfloat16, seed=m)
    counters = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
    tiles = dict(stream_k_tiles(m, n, k), tma=True)
    out = stream_k_gemm(x, w, counters, **tiles)
    ref = F.linear(x.float(), w.float())
    assert float((out.float() - ref).norm() / ref.norm()) < 4e-3  # bf16 output rounding
    for _ in range(3):  # the same bits whichever program finishes first
        assert torch.equal(stream_k_gemm(x, w, counters, **tiles), out)
    with use_pdl(True):  # launched as the engine launches it
        assert torch.equal(stream_k_gemm(x, w, counters, **tiles), out)
    pointer = stream_k_gemm(x, w, counters, **dict(tiles, tma=False))
    torch.testing.assert_close(pointer, out, rtol=1e-2, atol=1e-2)  # per-thread loads
    assert int(counters.abs().sum()) == 0
