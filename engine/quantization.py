"""FP8 weights (`EngineConfig.quantization="fp8"`, opt-in and lossy): the decoder's four
projections per layer (qkv, o, gate-up, down: 96% of the bytes a decode step reads) stored
as float8 e4m3 with one scale per output channel, their inputs quantized per token at run
time, the product through a row-wise scaled fp8 matmul (`torch._scaled_mm`) on CUDA.

Embeddings, the tied audio head, norms and the KV cache stay in the model dtype: the head
and embeddings share one table (quantizing it would also quantize every input row) and the
rest is too small to matter. Owns the quantization math (its torch version is the CPU path
and the reference of kernels/fp8_quant.py), the quantized linear and the ops wrapper that
routes the model's projections through it; knows nothing of scheduling or requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(FP8).max
MIN_AMAX = 1e-12  # an all-zero row (padding) quantizes to zeros, never NaN


class QuantizedRows(NamedTuple):
    """A projection's input already quantized: `data` float8 `[T, K]`, `scale` fp32 `[T, 1]`
    (x ~ data * scale)."""

    data: torch.Tensor
    scale: torch.Tensor


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (float8 `[N, K]`, fp32 scales `[1, N]`): each output channel's absolute
    maximum maps to 448."""
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # [N, 1]
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.t().contiguous()


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """Per-token dynamic scales: each row's absolute maximum maps to 448 (the torch version of
    kernels/fp8_quant.py's `quantize_rows`, which rounds the same way)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX)
    return QuantizedRows((xf * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8), amax / FP8_MAX)


class Fp8Linear(nn.Module):
    """A bias-free projection `y = x @ W^T` with W stored as float8 `weight [N, K]` times
    `weight_scale [1, N]`. Forward only through `Fp8Ops` (which quantizes its input)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(*quantize_weight(linear.weight.data))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W as the matmul sees it, `[N, K]` in `dtype` (the CPU path and tests)."""
        return (self.weight.float() * self.weight_scale.t()).to(dtype)


def scaled_mm_rows(num_rows: int) -> int:
    """The next power of two: the row count `torch._scaled_mm` is called with for `num_rows`
    rows where the plan's `fp8_pow2_rows` asks for it (off by default). On the H200 (torch
    2.11) the served fp8 engine died with an illegal instruction once its steps had other
    sizes (graph buckets of 272, 288... tokens) and survived with this padding; the call
    alone survives every size (benchmarks/scaled_mm_probe.py), and the fault was later
    traced to the codec's graphs sharing the backbone's cuBLAS workspace
    (benchmarks/workspace_race_probe.py, fixed in engine/cuda_graphs.py). Padding costs a
    prompt step's GEMMs up to twice their rows."""
    return 1 << max(0, num_rows - 1).bit_length()


def scaled_matmul(
    rows: QuantizedRows, layer: Fp8Linear, out_dtype: torch.dtype, pow2_rows: bool = False
) -> torch.Tensor:
    """`rows @ W^T` -> `[T, N]` in `out_dtype`: on CUDA one fp8 tensor-core matmul with both
    scales applied to its fp32 sums (`pow2_rows`: over `scaled_mm_rows(T)` rows, the extra
    ones zero); elsewhere the same sum over dequantized operands."""
    if rows.data.is_cuda:
        data, scale = rows
        t = data.shape[0]
        padded = scaled_mm_rows(t) if pow2_rows else t
        if padded != t:  # zero rows (scale 1): their outputs are dropped below
            data = torch.cat([data, data.new_zeros(padded - t, data.shape[1])])
            scale = torch.cat([scale, scale.new_ones(padded - t, 1)])
        # _scaled_mm: the second operand column-major (W^T of a row-major W), row-wise
        # scales [T, 1] and [1, N], bf16 out (the row-wise kernel's only output type)
        out = torch._scaled_mm(
            data, layer.weight.t(), scale, layer.weight_scale, out_dtype=out_dtype
        )
        return out[:t]
    x = rows.data.float() * rows.scale
    return F.linear(x, layer.dequantized(torch.float32)).to(out_dtype)


class Fp8Ops:
    """The model's ops (`base`: TorchOps, TritonOps or SkinnyGemmOps) with every projection in
    fp8. Each projection's input is quantized where it is made (with fused ops: in the add +
    RMSNorm kernel, or one SiLU-mul + quantize launch, else one quantize launch), then steps
    of up to `max_rows` tokens multiply in our few-row GEMM (kernels/skinny_gemm.py, `tma`:
    its tiles through the copy engine) and larger ones through the scaled fp8 matmul (over a
    power-of-two row count where `pow2_rows`): the same arithmetic either way. Everything
    else is the base's."""

    def __init__(
        self, base, fused: bool, dtype: torch.dtype, device, max_rows=0, tma=False, pow2_rows=False
    ):
        self.base = base
        self.pow2_rows = pow2_rows
        self.fused = fused  # Triton quantization kernels (CUDA with the fused ops)
        self.dtype = dtype  # of activations and every projection's output
        self.max_rows, self.tma = max_rows, tma
        self.counters = None  # the few-row GEMM's int32 zeros (each launch leaves them 0)
        if max_rows:
            self.counters = torch.zeros(4096, dtype=torch.int32, device=device)

    def __getattr__(self, name):  # qk_norm_rope, add_rms_norm, ...: the base's own
        if name == "base":  # not yet set (copying): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def _quantize(self, x: torch.Tensor, gated: bool = False) -> QuantizedRows:
        if self.fused:
            from kernels.fp8_quant import quantize_rows as quantize_kernel

            return QuantizedRows(*quantize_kernel(x, gated))
        return quantize_rows(self.base.silu_mul(x) if gated else x)

    def _matmul(self, rows: QuantizedRows, layer: Fp8Linear) -> torch.Tensor:
        if rows.data.shape[0] > self.max_rows:
            return scaled_matmul(rows, layer, self.dtype, self.pow2_rows)
        from kernels.skinny_gemm import skinny_gemm, skinny_tiles

        tiles = skinny_tiles(rows.data.shape[0], *layer.weight.shape, self.tma, element_size=1)
        scales = dict(weight_scale=layer.weight_scale, x_scale=rows.scale, out_dtype=self.dtype)
        return skinny_gemm(rows.data, layer.weight, self.counters, tma=self.tma, **scales, **tiles)

    def projection_norm(self, x, residual, weight, eps):
        """add + RMSNorm of a projection's input, quantized by the norm kernel itself."""
        if not self.fused:
            return self.base.add_rms_norm(x, residual, weight, eps)
        from kernels.norm_rope import add_rms_norm_fp8

        data, scale, total = add_rms_norm_fp8(x, residual, weight, eps)
        return QuantizedRows(data, scale), total

    def linear(self, layer: Fp8Linear, x) -> torch.Tensor:
        return self._matmul(x if isinstance(x, QuantizedRows) else self._quantize(x), layer)

    def gated_linear(self, layer: Fp8Linear, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's down projection of silu(gate) * up: SiLU and quantization in one kernel."""
        return self._matmul(self._quantize(gate_up, gated=True), layer)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _quantize_projections(layer: nn.Module, device: torch.device) -> None:
    """One decoder layer's projections replaced by `Fp8Linear`s; nothing of the bf16 ones
    is kept (a function of its own so that no local outlives it)."""
    for path in PROJECTIONS:
        owner_name, name = path.split(".")
        owner = getattr(layer, owner_name)
        linear = getattr(owner, name)
        if device.type == "cuda" and any(d % 16 for d in linear.weight.shape):
            raise ConfigError(
                f"quantization='fp8' needs projection sizes divisible by 16; {path} is "
                f"{tuple(linear.weight.shape)}: use quantization='none' for this model"
            )
        setattr(owner, name, Fp8Linear.from_linear(linear))


def return_cached_memory(device: torch.device) -> None:
    """The freed bf16 weights' memory back to the device, so that sizing the KV cache from
    the device's free memory (engine/runner.py: auto_num_kv_blocks) counts it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def quantize_model(model: nn.Module, plan) -> None:
    """Replaces every decoder layer's projections with `Fp8Linear`s and the model's ops with
    `Fp8Ops` (`plan`: its few-row GEMM and row padding settings), in place, after the
    checkpoint is loaded. CUDA needs bf16 activations and dimensions that are multiples of
    16 (the fp8 matmul's requirements)."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ConfigError(f"quantization='fp8' on CUDA needs dtype bfloat16, got {dtype}")
    for layer in model.layers:
        _quantize_projections(layer, device)
    return_cached_memory(device)
    fused = device.type == "cuda" and model.fused_ops
    rows, tma = plan.few_row_fp8_rows, plan.few_row_gemm_tma
    pow2 = plan.fp8_pow2_rows
    model.ops = Fp8Ops(model.ops, fused, dtype, device, max_rows=rows, tma=tma, pow2_rows=pow2)
