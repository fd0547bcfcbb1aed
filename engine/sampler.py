"""Audio-row sampling (spec section 4): masks -> temperature -> top-k -> top-p -> softmax ->
exponential race `argmax(p / e)`.

Owns the per-slot sampling parameters and the noise. The noise `e ~ Exp(1)` comes from a
counter-based hash of (request seed, row index, codebook, code), so it depends on nothing but
the request: the same seed gives the same codes alone or inside any batch, needs no
per-request generator objects, no host synchronisation. With `fused` the noise is one Triton
launch (kernels/noise.py, the same hash) instead of about fifty elementwise kernels over
`[R, 8 * 1026]` (the engine turns it on with the execution plan's `noise_kernel`).
Temperature 0 is greedy argmax of the masked logits.
"""

from __future__ import annotations

import torch

from engine.config import CODEBOOK_SIZE, NUM_CODEBOOKS, SamplingParams

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without overflowing int64."""
    lo = (x * (c & 0xFFFF)) & _MASK32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply); a bijection on [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise `[R, 8, 1026]` for rows `row_index [R]` of requests seeded `seeds [R]`."""
    device = seeds.device
    cell = torch.arange(NUM_CODEBOOKS * CODEBOOK_SIZE, device=device, dtype=torch.long)
    seed_lo = (seeds & _MASK32)[:, None]
    seed_hi = ((seeds >> 32) & _MASK32)[:, None]
    key = mix32(seed_lo ^ mix32(seed_hi ^ mix32(row_index[:, None] & _MASK32)))
    bits = mix32(key ^ mix32(cell[None, :] + 0x9E3779B9 & _MASK32))
    # 24 high bits -> u in (0, 1) exactly representable in fp32; e = -log(u) > 0.
    u = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return (-torch.log(u)).view(-1, NUM_CODEBOOKS, CODEBOOK_SIZE)


class Sampler:
    """Samples rows for the slots given; parameters live in slot-indexed tensors."""

    def __init__(self, max_slots: int, device: torch.device, fused: bool = False):
        self.fused = fused
        self.temperature = torch.ones(max_slots, device=device)
        self.top_k = torch.full((max_slots,), CODEBOOK_SIZE, dtype=torch.long, device=device)
        self.top_p = torch.ones(max_slots, device=device)
        self.seed = torch.zeros(max_slots, dtype=torch.long, device=device)

    def set_params(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.temperature[slot] = params.temperature
        self.top_k[slot] = self.top_k_of(params)
        self.top_p[slot] = params.top_p
        self.seed[slot] = seed

    def set_many(
        self,
        slots: torch.Tensor,  # [N] int64 on the device
        temperature: torch.Tensor,  # [N] float32
        top_k: torch.Tensor,  # [N] int64, already mapped as `set_params` maps it
        top_p: torch.Tensor,  # [N] float32
        seed: torch.Tensor,  # [N] int64
    ) -> None:
        """`set_params` for several slots from device tensors (four launches)."""
        self.temperature.index_copy_(0, slots, temperature)
        self.top_k.index_copy_(0, slots, top_k)
        self.top_p.index_copy_(0, slots, top_p)
        self.seed.index_copy_(0, slots, seed)

    @staticmethod
    def top_k_of(params: SamplingParams) -> int:
        return min(params.top_k, CODEBOOK_SIZE) if params.top_k > 0 else CODEBOOK_SIZE

    def sample(
        self,
        logits: torch.Tensor,  # [R, 8, 1026] fp32
        forbidden: torch.Tensor,  # [R, 8, 1026] bool
        slots: torch.Tensor,  # [R]
        row_index: torch.Tensor,  # [R] rows already sampled per request
    ) -> torch.Tensor:  # [R, 8] int64
        masked = logits.masked_fill(forbidden, float("-inf"))
        greedy = masked.argmax(-1)
        temperature = self.temperature[slots]
        scaled = masked / temperature.clamp(min=1e-5)[:, None, None]
        filtered = filter_top_k_top_p(scaled, self.top_k[slots], self.top_p[slots])
        probs = torch.softmax(filtered, dim=-1)
        if self.fused:
            from kernels.noise import exponential_noise_fused

            cells = NUM_CODEBOOKS * CODEBOOK_SIZE
            noise = exponential_noise_fused(self.seed[slots], row_index, cells).view_as(probs)
        else:
            noise = exponential_noise(self.seed[slots], row_index)
        raced = (probs / noise).argmax(-1)
        # A row left with nothing (NaN probabilities) falls back to argmax.
        valid = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
        raced = torch.where(valid, raced, greedy)
        return torch.where((temperature == 0)[:, None], greedy, raced)


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row top-k (k >= 1) then top-p over the last dim; removed entries become -inf.
    The most likely code is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # top_p == 1 disables the filter exactly (a cumsum may round past 1.0 in the tail).
    drop = (mass_before >= top_p[:, None, None]) & (rank > 0) & (top_p < 1.0)[:, None, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
