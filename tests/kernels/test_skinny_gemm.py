"""The few-row GEMM (kernels/skinny_gemm.py) against `F.linear`: small shapes on the CPU under
the Triton interpreter, the Higgs projections on a GPU; split-K partials added in a fixed
order (the same bits launch after launch), counters left zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.skinny_gemm import skinny_gemm, skinny_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOADS = {"pointer": {}, "tma": {"tma": True}}
HIGGS = [  # projection, N, K
    ("qkv", 6144, 2560),
    ("o_proj", 2560, 4096),
    ("gate_up", 19456, 2560),
    ("down", 2560, 9728),
]


def _operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize(
    "m,n,k,block_n,block_k,split",
    [
        (1, 48, 64, 16, 32, 1),
        (3, 40, 96, 16, 32, 2),  # N not a whole number of tiles
        (5, 64, 80, 32, 32, 3),  # K not a whole number of chunks, uneven splits
        (16, 32, 128, 16, 32, 8),  # more splits than some tiles have chunks: empty splits
        (17, 32, 64, 32, 16, 2),  # rows padded to 32
    ],
)
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_matches_linear(m, n, k, block_n, block_k, split, loads):
    """Per-thread loads and TMA tiles (rows and columns past the ends read as zeros)."""
    x, w = _operands(m, n, k, torch.float32)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    knobs = dict(block_n=block_n, block_k=block_k, split=split, num_stages=2, **LOADS[loads])
    out = skinny_gemm(x, w, counters, **knobs)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0  # left zero for the next launch
    again = skinny_gemm(x, w, counters, **knobs)
    assert torch.equal(out, again)


@pytest.mark.parametrize("loads", ["pointer", "tma"])
@pytest.mark.parametrize("split", [1, 3])
def test_rows_past_a_tile_go_in_blocks(loads, split):
    """More rows than the x tile holds: blocks of block_m rows, each its own programs over
    the same weight tiles (the last block partial). A block's rows get the very values a
    launch of those rows alone gives (nothing crosses between blocks), and the counters,
    one per weight tile and block, are left zero."""
    x, w = _operands(40, 48, 96, torch.float32, seed=5)
    counters = torch.zeros(9, dtype=torch.int32, device=DEVICE)  # 3 tiles x 3 blocks
    knobs = dict(block_m=16, block_n=16, block_k=32, split=split, num_stages=2, **LOADS[loads])
    out = skinny_gemm(x, w, counters, **knobs)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(out[16:32], skinny_gemm(x[16:32], w, counters, **knobs))
    assert torch.equal(out[32:], skinny_gemm(x[32:], w, counters, **knobs))
    with pytest.raises(ValueError, match="at least 9"):
        skinny_gemm(x, w, counters[:8], **dict(knobs, split=2))


def test_writes_into_a_given_output_with_a_row_stride():
    x, w = _operands(4, 32, 64, torch.float32, seed=1)
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    big = torch.full((4, 48), 7.0, device=DEVICE)
    out = skinny_gemm(x, w, counters, out=big[:, :32], block_n=16, block_k=32, split=2)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(big[:, 32:], torch.full((4, 16), 7.0, device=DEVICE))


# bf16 on a GPU only: the Triton CPU interpreter's bf16 products are wrong
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * (DEVICE == "cuda"))
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_gated_folds_silu_mul_into_the_loads(dtype, loads):
    """`gated=True`: x is [gate | up] and the product is silu_mul(x) @ W^T, the activation
    rounded as kernels/norm_rope.silu_mul rounds it (so in bf16 too the same bits as the two
    launches with our GEMM)."""
    from kernels.norm_rope import silu_mul

    gate_up, _ = _operands(5, 1, 2 * 96, dtype, seed=3)
    _, w = _operands(1, 48, 96, dtype, seed=4)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    knobs = dict(block_n=16, block_k=32, split=2, num_stages=2, **LOADS[loads])
    out = skinny_gemm(gate_up, w, counters, gated=True, **knobs)
    assert torch.equal(out, skinny_gemm(silu_mul(gate_up), w, counters, **knobs))
    ref = F.linear(F.silu(gate_up[:, :96].float()) * gate_up[:, 96:].float(), w.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="K contiguous"):
        skinny_gemm(gate_up[:, :96], w, counters, gated=True)  # no up half


def test_refuses_what_it_cannot_do():
    x, w = _operands(2, 32, 64, torch.float32)
    counters = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at least 2"):
        skinny_gemm(x, w, counters, block_n=16, split=2)
    with pytest.raises(ValueError, match="int32"):
        skinny_gemm(x, w, counters.long(), block_n=32, split=2)
    with pytest.raises(ValueError, match="at most 512 rows"):
        skinny_gemm(torch.zeros(513, 64, device=DEVICE), w, counters)
    with pytest.raises(ValueError, match="block_m is at most 128"):
        skinny_gemm(x, w, counters, block_m=256)
    with pytest.raises(ValueError, match="K contiguous"):
        skinny_gemm(x, w[:, :48], counters)
    odd = torch.zeros(2, 2 * 36, device=DEVICE)  # the up half at 144 bytes: aligned
    assert skinny_gemm(
        odd, torch.zeros(16, 36, device=DEVICE), counters, gated=True, tma=True
    ).shape
    with pytest.raises(ValueError, match="16-byte aligned"):  # rows of 33 fp32: 132 bytes
        skinny_gemm(
            torch.zeros(2, 33, device=DEVICE),
            torch.zeros(16, 33, device=DEVICE),
            counters,
            tma=True,
        )


def test_default_tiles_are_the_h200_sweeps_best():
    def knobs(n, k):
        t = skinny_tiles(1, n, k)
        return t["block_n"], t["block_k"], t["num_stages"], t["split"]

    assert knobs(6144, 2560) == (64, 256, 3, 1)  # qkv
    assert knobs(2560, 4096) == (64, 128, 4, 3)  # o_proj
    assert knobs(19456, 2560) == (64, 256, 3, 1)  # gate_up
    assert knobs(2560, 9728) == (128, 128, 4, 6)  # down
    assert knobs(8208, 2560) == (64, 256, 3, 1)  # audio head
    assert skinny_tiles(9, 64, 64)["block_m"] == 16 and skinny_tiles(9, 64, 64)["split"] == 1
    # 64 rows: down's four stages of [128 + 64, 128] tiles would need 240 KB of shared memory
    # on the H200 (227 KB there): three
    assert skinny_tiles(64, 2560, 9728)["num_stages"] == 3
    assert skinny_tiles(64, 6144, 2560)["num_stages"] == 3  # 208 KB: fits
    # 128 rows of two-byte operands: two stages of [64 + 128, 256] tiles and the [64, 128]
    # epilogue (224 KB) do not fit: the chunk of columns halves instead
    assert [skinny_tiles(128, 6144, 2560)[x] for x in ("num_stages", "block_k")] == [2, 128]

    # fp8 operands (one byte) in 64- and 128-row tiles: the fp8 sweep's winners on the H200
    # (docs/perf-log/2026-12-06-session-27.md), by projection and tile height
    def fp8(m, n, k, tma=True):
        t = skinny_tiles(m, n, k, tma, element_size=1)
        return t["block_n"], t["block_k"], t["num_stages"], t["num_warps"], t["split"]

    for m in (33, 64):
        assert fp8(m, 6144, 2560) == (64, 512, 3, 4, 1)  # qkv
        assert fp8(m, 2560, 4096) == fp8(m, 2560, 9728) == (64, 256, 4, 4, 3)  # o, down
        assert fp8(m, 19456, 2560) == (128, 128, 4, 4, 1)  # gate-up, TMA
    for m in (65, 80, 128):
        assert fp8(m, 6144, 2560) == (64, 256, 4, 4, 1)
        assert fp8(m, 2560, 4096) == fp8(m, 2560, 9728) == (64, 256, 4, 4, 3)
        # gate-up at 128 rows: the two-byte rule's tiles won; its [128, 128] fp32
        # accumulator takes eight warps
        assert fp8(m, 19456, 2560) == (128, 128, 3, 8, 1)
    # the two-byte rules where nothing was swept in fp8: gate-up without TMA, narrow K
    assert skinny_tiles(64, 19456, 2560, element_size=1) == skinny_tiles(64, 19456, 2560)
    assert skinny_tiles(64, 256, 1024, element_size=1) == skinny_tiles(64, 256, 1024)
    for m in range(1, 33):  # 16- and 32-row tiles: o and down take the H100 sweep's winners
        for name, n, k in HIGGS:  # (docs/perf-log/2026-12-07-session-31.md), as at 33-128 rows
            for tma in (False, True):
                if name in ("o_proj", "down"):
                    assert fp8(m, n, k, tma) == (64, 256, 4, 4, 3)
                else:  # qkv, gate-up: the element size changes nothing
                    assert skinny_tiles(m, n, k, tma, element_size=1) == skinny_tiles(m, n, k, tma)
    # more rows than a tile holds: 128-row tiles, as at 128 rows (blocks of them)
    for m in (129, 272, 512):
        for _, n, k in HIGGS:
            for tma in (False, True):
                tall = skinny_tiles(m, n, k, tma, element_size=1)
                assert tall == skinny_tiles(128, n, k, tma, element_size=1)
    # TMA tiles: the TMA sweep's best at one row for the wide outputs (the others as above)
    tma = {name: skinny_tiles(1, n, k, tma=True) for name, n, k in HIGGS}
    assert [tma["qkv"][x] for x in ("block_n", "block_k", "num_stages")] == [64, 256, 4]
    gate_up = [tma["gate_up"][x] for x in ("block_n", "block_k", "num_stages", "num_warps")]
    assert gate_up == [128, 128, 3, 8]
    assert tma["down"] == skinny_tiles(1, 2560, 9728)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "m, loads",
    [(m, "pointer") for m in (1, 2, 8, 33, 64)] + [(m, "tma") for m in (1, 2, 8, 16, 64)],
)
@pytest.mark.parametrize(
    "n,k",
    [(n, k) for _, n, k in HIGGS] + [(8208, 2560)],  # + the audio head
)
def test_higgs_shapes_on_the_gpu(m, loads, n, k):
    x, w = _operands(m, n, k, torch.bfloat16, seed=m)
    counters = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
    tiles = dict(skinny_tiles(m, n, k, loads == "tma"), **LOADS[loads])
    out = skinny_gemm(x, w, counters, **tiles)
    ref = F.linear(x.float(), w.float())
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 4e-3, err  # bf16 output rounding
    for _ in range(3):  # the same bits whichever program finishes last
        assert torch.equal(skinny_gemm(x, w, counters, **tiles), out)
    from kernels.launch import use_pdl

    with use_pdl(True):  # launched as the engine launches it
        assert torch.equal(skinny_gemm(x, w, counters, **tiles), out)
    assert int(counters.abs().sum()) == 0
    if n == 2560 and k == 9728:  # down: the MLP's activation folded in
        from kernels.norm_rope import silu_mul

        gate_up, _ = _operands(m, 1, 2 * k, torch.bfloat16, seed=m + 1)
        folded = skinny_gemm(gate_up, w, counters, gated=True, **tiles)
        assert torch.equal(folded, skinny_gemm(silu_mul(gate_up), w, counters, **tiles))
