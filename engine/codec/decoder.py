"""The codec decoder: codes `[B, 8, T]` -> 24 kHz audio `[B, 1, T * 960]`.

Per codebook an embedding lookup and `project_out` (64 -> 1024), summed in fp32; `fc2`
(1024 -> 256); then a DAC decoder (Snake activations, ConvTranspose1d upsampling 8*5*4*2*3
with `output_padding = stride % 2`, no final tanh). Our own module, so the hot path fuses
Snake (kernels/snake.py, `use_fused_kernels`) and runs at static shapes; parameter names
match transformers' `HiggsAudioV2TokenizerModel` (`acoustic_decoder.*`) so its weights load
directly. It knows nothing of requests or streaming windows.

Channels-last (`use_channels_last`): cuDNN's tensor-core convolutions work on NHWC data, so
with `[B, C, T]` activations every convolution converts its input, weight and output between
layouts (on the H200 at 128 streams those conversions were about 1 ms of GPU time per
engine step). In channels-last mode the activations stay `[B, C, 1, T]` in NHWC memory and
every convolution runs as its 2-D twin on weights converted once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.codec.config import CodecConfig


class Snake1d(nn.Module):
    """`x + sin(alpha * x)^2 / (alpha + 1e-9)` per channel; one Triton pass when `fused`
    (CUDA), five torch kernels otherwise."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from kernels.snake import snake

            return snake(x if x.dim() == 4 else x.contiguous(), self.alpha)
        alpha = self.alpha if x.dim() == 3 else self.alpha[..., None]  # [B, C, 1, T] input
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _nhwc_copy(weight: torch.Tensor) -> torch.Tensor:
    """A convolution weight `[O, I, K]` as `[O, I, 1, K]` in channels-last memory: a copy,
    never an alias of the parameter."""
    return weight.detach().unsqueeze(2).clone(memory_format=torch.channels_last)


class Conv1d(nn.Conv1d):
    """nn.Conv1d (same parameters) that, once `channels_last` is set, takes `[B, C, 1, T]`
    NHWC activations and runs as conv2d on a channels-last copy of its weight."""

    def set_channels_last(self, on: bool) -> None:
        # a non-persistent buffer: moves with .to(), not in the state dict
        self.register_buffer("weight4", _nhwc_copy(self.weight) if on else None, persistent=False)

    def forward(self, x, bias: bool = True):
        """`bias=False` leaves the bias to the caller."""
        weight4 = self._buffers.get("weight4")
        if weight4 is None:
            return self._conv_forward(x, self.weight, self.bias if bias else None)
        return F.conv2d(
            x,
            weight4,
            self.bias if bias else None,
            (1, self.stride[0]),
            (0, self.padding[0]),
            (1, self.dilation[0]),
            self.groups,
        )


class ConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d with the same channels-last mode as `Conv1d`. (Running it as one
    GEMM + overlap-add instead was measured on the H200 and was slower at 64 windows; removed,
    docs/perf-log/.)"""

    def set_channels_last(self, on: bool) -> None:
        self.register_buffer("weight4", _nhwc_copy(self.weight) if on else None, persistent=False)

    def forward(self, x, bias: bool = True):
        """`bias=False` leaves the bias to the caller."""
        weight4 = self._buffers.get("weight4")
        if weight4 is None:
            if bias:
                return super().forward(x)
            return F.conv_transpose1d(
                x,
                self.weight,
                None,
                self.stride,
                self.padding,
                self.output_padding,
                self.groups,
                self.dilation,
            )
        return F.conv_transpose2d(
            x,
            weight4,
            self.bias if bias else None,
            (1, self.stride[0]),
            (0, self.padding[0]),
            (0, self.output_padding[0]),
            self.groups,
            (1, self.dilation[0]),
        )


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake1d(channels)
        self.conv1 = Conv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(channels)
        self.conv2 = Conv1d(channels, channels, 1)

    def forward(self, x):
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.snake1 = Snake1d(in_channels)
        self.conv_t1 = ConvTranspose1d(
            in_channels,
            out_channels,
            kernel_size=2 * stride,
            stride=stride,
            padding=math.ceil(stride / 2),
            output_padding=stride % 2,
        )
        self.res_unit1 = ResidualUnit(out_channels, 1)
        self.res_unit2 = ResidualUnit(out_channels, 3)
        self.res_unit3 = ResidualUnit(out_channels, 9)

    def forward(self, x):
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        channels = cfg.decoder_hidden_size
        self.conv1 = Conv1d(cfg.acoustic_hidden_size, channels, 7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(channels // 2**i, channels // 2 ** (i + 1), stride)
            for i, stride in enumerate(cfg.upsampling_ratios)
        )
        out = channels // 2 ** len(cfg.upsampling_ratios)
        self.snake1 = Snake1d(out)
        self.conv2 = Conv1d(out, 1, 7, padding=3)

    fold = True  # with fused Snake on channels-last activations: `_forward_folded`

    def forward(self, x):
        if self.fold and self.snake1.fused and self.conv1._buffers.get("weight4") is not None:
            return self._forward_folded(x)
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))

    def _forward_folded(self, x):
        """The same function with fused Snake kernels on channels-last activations: every
        convolution runs without its bias, and the Snake pass after it adds the bias and
        the residual (writing the sum where a later residual needs it). Per residual unit
        two passes over the activations instead of seven (cuDNN's separate bias adds, the
        residual add, two Snakes). A convolution's output `h` with its pending bias `b`
        and residual `res` stands for `res + (h + b)`."""
        from kernels.snake import snake

        h, b, res = self.conv1(x, bias=False), self.conv1.bias, None
        for block in self.block:
            y = snake(h, block.snake1.alpha, bias=b, residual=res)
            h, b, res = block.conv_t1(y, bias=False), block.conv_t1.bias, None
            for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
                x_in, y = snake(h, unit.snake1.alpha, bias=b, residual=res, return_sum=True)
                y = snake(unit.conv1(y, bias=False), unit.snake2.alpha, bias=unit.conv1.bias)
                h, b, res = unit.conv2(y, bias=False), unit.conv2.bias, x_in
        return self.conv2(snake(h, self.snake1.alpha, bias=b, residual=res))


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.config = cfg
        q, n, d, h = cfg.num_codebooks, cfg.codebook_size, cfg.codebook_dim, cfg.hidden_size
        self.codebooks = nn.Parameter(torch.zeros(q, n, d))  # [8, 1024, 64]
        self.project_out_weight = nn.Parameter(torch.zeros(q, h, d))  # [8, 1024, 64]
        self.project_out_bias = nn.Parameter(torch.zeros(q, h))
        self.fc2 = nn.Linear(h, cfg.acoustic_hidden_size)
        self.acoustic_decoder = AcousticDecoder(cfg)
        self.register_buffer("offsets", torch.arange(q) * n, persistent=False)
        self.channels_last = False

    def use_fused_kernels(self, on: bool) -> CodecDecoder:
        """Run every Snake activation as the fused Triton kernel (CUDA only) or in torch."""
        for module in self.modules():
            if isinstance(module, Snake1d):
                module.fused = on
        return self

    def use_channels_last(self, on: bool) -> CodecDecoder:
        """Keep activations in NHWC memory and run every convolution as its 2-D twin (see
        the module docstring). Call again after the weights change."""
        self.channels_last = on
        for module in self.modules():
            if isinstance(module, (Conv1d, ConvTranspose1d)):
                module.set_channels_last(on)
        return self

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[B, 8, T]` in 0..1023 -> waveform `[B, 1, T * hop]`."""
        b, q, t = codes.shape
        flat = self.codebooks.reshape(-1, self.codebooks.shape[-1])
        vectors = flat[(codes + self.offsets[:, None]).reshape(b, q * t)].view(b, q, t, -1)
        projected = torch.einsum("bqtd,qhd->bqth", vectors, self.project_out_weight)
        projected = projected + self.project_out_bias[None, :, None, :]
        summed = projected.float().sum(1).to(self.fc2.weight.dtype)  # [B, T, H]
        x = self.fc2(summed).transpose(1, 2)  # [B, 256, T]
        if not self.channels_last:
            return self.acoustic_decoder(x)
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)  # [B, 256, 1, T]
        return self.acoustic_decoder(x).squeeze(2)
