"""Float8 quantization kernels against their torch references, byte for byte: per-row
quantization (plain and SiLU-gated), the quantizing add + RMSNorm, and the few-row GEMM over
a float8 weight. Small shapes on the CPU (Triton interpreter), the Higgs shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quantization import quantize_rows as engine_quantize_rows
from engine.quantization import quantize_weight
from kernels.fp8_quant import FP8_MAX, quantize_rows, quantize_rows_reference
from kernels.norm_rope import add_rms_norm, add_rms_norm_fp8
from kernels.skinny_gemm import skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SHAPES = [(1, 64), (7, 100), (2, 2500)] + ([(64, 2560), (5, 9728)] if DEVICE == "cuda" else [])


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float8_e4m3fn and torch.equal(
        a.view(torch.uint8), b.view(torch.uint8)
    )


def _quantized_alike(q, scale, ref_q, ref_scale, exact: bool) -> None:
    """The same bytes and scales; where `exact` is False (fp32 values the kernel computes
    itself, SiLU or RMSNorm, in another order than torch or the unfused kernel on a GPU: an
    H100 gave scales one ulp apart) scales within two ulps and values within a float8 step."""
    if exact:
        assert _same_fp8(q, ref_q) and torch.equal(scale, ref_scale)
        return
    assert q.dtype == ref_q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale, ref_scale, rtol=2.5e-7, atol=0)
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0.0625, atol=2.0**-9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", SHAPES)
@pytest.mark.parametrize("gated", [False, True])
def test_quantize_rows_matches_the_reference_bytes(dtype, rows, k, gated):
    x = (3 * torch.randn(rows, 2 * k if gated else k)).to(DEVICE, dtype)
    x[0, 0] = 0.0  # and a few values on the e4m3 subnormal range
    q, scale = quantize_rows(x, gated)
    ref_q, ref_scale = quantize_rows_reference(x, gated)
    assert scale.shape == (rows, 1)
    own_fp32 = gated and dtype == torch.float32 and DEVICE == "cuda"  # the kernel's own SiLU
    _quantized_alike(q, scale, ref_q, ref_scale, exact=not own_fp32)
    assert q.float().abs().amax(-1).eq(FP8_MAX).all()  # each row's maximum maps to 448


def test_rounding_at_the_edges_of_each_binade_and_an_all_zero_row():
    """Values that round up into the next power of two (124.3 -> 128: the interpreter's own
    fp8 cast gets these wrong), ties to even, subnormals, and a zero row (padding): zeros."""
    edge = [448.0, 124.3, 124.0, 127.999, 0.0156, 0.0029296875, 0.0048828125, -0.0048828125]
    edge += [1e-6, 3.625, -3.375, 0.0]
    x = torch.zeros(2, 16, device=DEVICE)
    x[0, : len(edge)] = torch.tensor(edge)
    q, scale = quantize_rows(x)
    ref_q, ref_scale = quantize_rows_reference(x)
    assert _same_fp8(q, ref_q) and torch.equal(scale, ref_scale)
    assert q.float()[0, 1] == 128.0 and q.float()[0, 9] == 3.5 and q.float()[0, 10] == -3.5
    assert torch.equal(q.float()[1], torch.zeros(16, device=DEVICE))
    assert torch.isfinite(scale).all()


def test_the_engine_cpu_path_quantizes_as_the_kernel_reference():
    x = 2 * torch.randn(9, 96)
    rows = engine_quantize_rows(x)
    ref_q, ref_scale = quantize_rows_reference(x)
    assert _same_fp8(rows.data, ref_q) and torch.equal(rows.scale, ref_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, hidden", [(1, 64), (7, 100), (33, 256)] + [(64, 2560)] * (DEVICE == "cuda")
)
def test_add_rms_norm_fp8_quantizes_the_norms_output(dtype, rows, hidden):
    """One launch gives what the unquantized norm kernel then quantize_rows give: the same
    residual sum, the same bytes and scales."""
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    r = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    for residual in (None, r):
        q, scale, total = add_rms_norm_fp8(x, residual, w, 1e-6)
        normed, ref_total = add_rms_norm(x, residual, w, 1e-6)
        ref_q, ref_scale = quantize_rows_reference(normed)
        assert torch.equal(total, ref_total)
        exact = dtype == torch.bfloat16 or DEVICE == "cpu"  # fp32 norms: ulps apart on a GPU
        _quantized_alike(q, scale, ref_q, ref_scale, exact)


def _fp8_weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_weight((0.05 * torch.randn(n, k, generator=g)).to(DEVICE))


@pytest.mark.parametrize("loads", [{}, {"tma": True}])
@pytest.mark.parametrize(
    "m, n, k, split",
    [(1, 48, 64, 1), (5, 64, 80, 3), (16, 32, 128, 2), (80, 32, 64, 2), (128, 16, 96, 1)]
    + [(200, 32, 64, 2)],  # two blocks of 128 rows
)
def test_skinny_gemm_over_float8_operands(loads, m, n, k, split):
    """Float8 weight and rows widened in the GEMM and both scales applied to the sums:
    F.linear over the dequantized operands (fp32 out here; bf16 on a GPU below)."""
    w8, w_scale = _fp8_weight(n, k, seed=m)
    x8, x_scale = quantize_rows(torch.randn(m, k, device=DEVICE))
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    knobs = dict(block_n=16, block_k=32, split=split, num_stages=2, **loads)  # block_m: 16-128
    scales = dict(weight_scale=w_scale, x_scale=x_scale, out_dtype=torch.float32)
    out = skinny_gemm(x8, w8, counters, **scales, **knobs)
    ref = F.linear(x8.float() * x_scale, w8.float() * w_scale.t())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="float8 operands"):
        skinny_gemm(x8, w8, counters, weight_scale=w_scale, **knobs)
    with pytest.raises(ValueError, match="float8 operands"):
        skinny_gemm(x8.float(), w8, counters, **scales, **knobs)


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="the interpreter's fp32 products; on a GPU: test_skinny_fp8_higgs_shapes_in_bf16",
)
@pytest.mark.parametrize("m, n, k", [(40, 128, 2560), (100, 64, 4096)])
def test_skinny_gemm_with_the_swept_fp8_tiles(m, n, k):
    """The engine's tiles for float8 operands at 33-128 rows (256-column chunks in four
    stages, K split in three) at the Higgs widths: the same sums as the dequantized product.
    An fp32 output asks for fp32 products (the interpreter's exact arithmetic), whose fp32
    tiles in four stages overflow a GPU's shared memory (344,064 bytes asked for on an H100,
    2026-12-07): on a GPU the engine's fp8 products at these tiles are checked by
    test_skinny_fp8_higgs_shapes_in_bf16."""
    from kernels.skinny_gemm import skinny_tiles

    tiles = skinny_tiles(m, n, k, element_size=1)
    assert (tiles["block_k"], tiles["num_stages"], tiles["split"]) == (256, 4, 3)
    w8, w_scale = _fp8_weight(n, k, seed=m)
    x8, x_scale = quantize_rows(torch.randn(m, k, device=DEVICE))
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    scales = dict(weight_scale=w_scale, x_scale=x_scale, out_dtype=torch.float32)
    out = skinny_gemm(x8, w8, counters, **scales, **tiles)
    ref = F.linear(x8.float() * x_scale, w8.float() * w_scale.t())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert int(counters.abs().sum()) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 16, 64, 80, 128, 144, 272, 512])  # 144 up: blocks of 128
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
@pytest.mark.parametrize("tma", [False, True])
def test_skinny_fp8_higgs_shapes_in_bf16(m, n, k, tma):
    from kernels.skinny_gemm import skinny_tiles

    w8, w_scale = _fp8_weight(n, k, seed=1)
    x8, x_scale = quantize_rows(torch.randn(m, k, device="cuda").bfloat16())
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    scales = dict(weight_scale=w_scale, x_scale=x_scale, out_dtype=torch.bfloat16)
    tiles = skinny_tiles(m, n, k, tma, element_size=1)  # as engine/quantization.py asks
    out = skinny_gemm(x8, w8, counters, tma=tma, **scales, **tiles)
    ref = F.linear(x8.float() * x_scale, w8.float() * w_scale.t())
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == torch.bfloat16 and err < 1e-2, err  # bf16 output rounding only


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("pow2_rows", [False, True])
@pytest.mark.parametrize("m", [1, 17, 64, 272, 512])
@pytest.mark.parametrize("n, k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
def test_scaled_mm_rowwise_matches_the_dequantized_product(m, n, k, pow2_rows):
    """The CUDA path of engine/quantization.py's scaled_matmul (torch._scaled_mm, row-wise
    scales, bf16 out), called over the rows as they are or padded to a power of two, against
    its CPU path's math: the same fp8 operands, dequantized, in fp32. Their only difference
    is the output's bf16 rounding and the order of the sums."""
    from engine.quantization import Fp8Linear, QuantizedRows, scaled_matmul

    layer = Fp8Linear(*_fp8_weight(n, k, seed=2))
    rows = QuantizedRows(*quantize_rows((2 * torch.randn(m, k, device="cuda")).bfloat16()))
    out = scaled_matmul(rows, layer, torch.bfloat16, pow2_rows)
    ref = F.linear(rows.data.float() * rows.scale, layer.dequantized(torch.float32))
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n) and err < 1e-2, err
