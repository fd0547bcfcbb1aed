"""Per-request exponential noise for the sampler's race `argmax(p / e)`, in one launch.

`e ~ Exp(1)` for every (row, codebook, code) cell comes from a counter-based hash of the
request's seed, the row's index and the cell: batch-independent by construction (a request's
noise does not depend on its neighbours), no generator state. The torch definition,
`engine.sampler.exponential_noise`, emulates 32-bit unsigned arithmetic in int64 and takes
about fifty elementwise launches over `[R, 8 * 1026]`; here each program hashes a block of
cells of one row in uint32 registers. The integer hash is bit for bit the same; on a GPU
`-log(u)` uses libdevice's logf, the function torch's CUDA log calls (Triton's CPU interpreter
has no libdevice: there it is `tl.log`). Knows nothing of requests: tensors in, tensor out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise_kernel(
    seed_ptr, row_ptr, out_ptr, CELLS: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    r = tl.program_id(0)
    cell = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + r)  # int64
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row = (tl.load(row_ptr + r) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(row)))
    bits = _mix32(key ^ _mix32(cell.to(tl.uint32) + 0x9E3779B9))
    # 24 high bits -> u in (0, 1), exact in fp32; e = -log(u) > 0
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    e = -libdevice.log(u) if LIBDEVICE else -tl.log(u)
    tl.store(out_ptr + r.to(tl.int64) * CELLS + cell, e, mask=cell < CELLS)


def exponential_noise_fused(
    seeds: torch.Tensor, row_index: torch.Tensor, cells: int
) -> torch.Tensor:
    """Exp(1) noise `[R, cells]` (fp32) for rows `row_index [R]` of requests seeded
    `seeds [R]` (int64); equals `engine.sampler.exponential_noise` reshaped."""
    r = seeds.shape[0]
    out = torch.empty(r, cells, dtype=torch.float32, device=seeds.device)
    if r:
        block = 1024
        grid = (r, triton.cdiv(cells, block))
        interpreted = isinstance(_noise_kernel, InterpretedFunction)  # as Triton decided
        _noise_kernel[grid](
            seeds, row_index, out, CELLS=cells, BLOCK=block, LIBDEVICE=not interpreted
        )
    return out
