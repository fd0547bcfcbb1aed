"""The fused Snake kernel against its torch reference: small shapes on the CPU (Triton
interpreter), the codec's shapes on a GPU in fp32, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch

from kernels.snake import snake, snake_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, c, t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, c, t, generator=g) * 3).to(DEVICE, dtype)
    alpha = (torch.rand(1, c, 1, generator=g) * 2 + 0.05).to(DEVICE, dtype)
    return x, alpha


@pytest.mark.parametrize("b, c, t", [(1, 1, 1), (2, 3, 5), (3, 4, 257), (1, 16, 1030)])
@pytest.mark.parametrize("block", [64, 1024])
def test_snake_matches_reference_fp32(b, c, t, block):
    x, alpha = _case(b, c, t, torch.float32, seed=b * 100 + t)
    out = snake(x, alpha, block=block)
    ref = snake_reference(x, alpha)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_snake_half_precision_computes_in_fp32_and_stores_its_dtype(dtype):
    """The codec in bf16 or fp16 (the plan's codec_dtype): fp32 arithmetic, one rounding
    at the store, so the result is the fp32 reference's rounded to the storage dtype."""
    x, alpha = _case(2, 3, 257, dtype, seed=5)
    out = snake(x, alpha, block=64)
    assert out.dtype == dtype
    expect = snake_reference(x.float(), alpha.float()).to(dtype)
    two_ulps = 2 * torch.finfo(dtype).eps  # a sine's last bit may round the other way
    torch.testing.assert_close(out.float(), expect.float(), rtol=two_ulps, atol=1e-3)


@pytest.mark.parametrize("b, c, t", [(1, 1, 1), (2, 3, 5), (3, 4, 257), (1, 1, 9), (2, 5, 1)])
def test_snake_channels_last_matches_reference(b, c, t):
    """[B, C, 1, T] in NHWC memory (the channel varies fastest): the result keeps the layout
    and equals the reference; a kernel indexing channels as in [B, C, T] fails here."""
    x, alpha = _case(b, c, t, torch.float32, seed=b * 7 + t)
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    out = snake(x4, alpha, block=64)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, snake_reference(x4, alpha), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.squeeze(2), snake_reference(x, alpha), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nhwc", [False, True], ids=["nct", "nhwc"])
@pytest.mark.parametrize("with_bias, with_res", [(1, 0), (0, 1), (1, 1)])
def test_snake_adds_bias_and_residual_first(nhwc, with_bias, with_res):
    """snake(x + bias + residual) in one pass, and with `return_sum` the sum itself: exactly
    torch's two adds in fp32, in both layouts."""
    x, alpha = _case(2, 5, 37, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(5, generator=g).to(DEVICE) if with_bias else None
    res = (torch.randn(2, 5, 37, generator=g) * 2).to(DEVICE) if with_res else None
    if nhwc:
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        if res is not None:
            res = res.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    total, out = snake(x, alpha, block=64, bias=bias, residual=res, return_sum=True)
    expect_sum = x + (bias.reshape(1, -1, *[1] * (x.dim() - 2)) if with_bias else 0)
    expect_sum = (res + expect_sum) if with_res else expect_sum
    assert torch.equal(total, expect_sum)
    assert total.stride() == out.stride() == x.stride()
    ref = snake_reference(x, alpha, bias, res)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, snake_reference(expect_sum, alpha), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snake(x, alpha, block=64, bias=bias, residual=res), out)


def test_snake_rejects_a_residual_of_another_layout_and_wrong_bias():
    x, alpha = _case(1, 4, 8, torch.float32)
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="residual"):
        snake(x4, alpha, residual=x.unsqueeze(2))  # same shape, NCHW memory
    with pytest.raises(ValueError, match="biases"):
        snake(x, alpha, bias=torch.zeros(3, device=DEVICE))


def test_snake_uses_each_channels_alpha():
    """Channels are told apart: swapping two alphas swaps exactly those channels' outputs."""
    x, alpha = _case(2, 3, 9, torch.float32)
    x[:, 1] = x[:, 0]
    swapped = alpha.clone()
    swapped[0, 0], swapped[0, 1] = alpha[0, 1], alpha[0, 0]
    a, b = snake(x, alpha, block=64), snake(x, swapped, block=64)
    torch.testing.assert_close(a[:, 0], b[:, 1])
    assert not torch.allclose(a[:, 0], a[:, 1])
    torch.testing.assert_close(a[:, 2], b[:, 2])


def test_snake_rejects_what_it_cannot_index():
    x, alpha = _case(1, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        snake(x.transpose(1, 2), alpha)
    with pytest.raises(ValueError, match="channels-last"):
        snake(x.unsqueeze(2), alpha)  # 4-D but not in NHWC memory
    with pytest.raises(ValueError, match="alphas"):
        snake(x, alpha[:, :3])


@pytest.mark.cuda
@pytest.mark.parametrize("c, t", [(1024, 33), (512, 264), (32, 31680)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nhwc", [False, True], ids=["nct", "nhwc"])
def test_snake_codec_shapes_gpu(c, t, dtype, nhwc):
    x, alpha = _case(4, c, t, dtype, seed=c)
    if nhwc:
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    out = snake(x, alpha).float()
    ref = snake_reference(x.float(), alpha.float())  # fp32 math, as the kernel does
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
