"""The one-launch exponential noise against the sampler's torch definition: small batches on
the CPU (Triton interpreter), a full decode batch on a GPU; batch independence; the fused
sampler picks the same codes."""

from __future__ import annotations

import pytest
import torch

from engine.config import CODEBOOK_SIZE, NUM_CODEBOOKS, SamplingParams
from engine.sampler import Sampler, exponential_noise
from kernels.noise import exponential_noise_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CELLS = NUM_CODEBOOKS * CODEBOOK_SIZE


def _t(values):
    return torch.tensor(values, dtype=torch.long, device=DEVICE)


def _close_to_reference(seeds, rows):
    ref = exponential_noise(seeds, rows).view(len(seeds), CELLS)
    got = exponential_noise_fused(seeds, rows, CELLS)
    # The hash is integer arithmetic; only log's last bits may differ. A wrong hash bit would
    # move e by far more than this (u's lowest bit alone is 2**-24).
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)
    return got, ref


def test_matches_the_torch_definition():
    seeds = _t([0, 1234, 2**40 + 7, -5, 2**63 - 1])  # low word, high word, negative
    rows = _t([0, 5, 3, 100_000, 2**31 + 3])
    got, _ = _close_to_reference(seeds, rows)
    assert (got > 0).all() and torch.isfinite(got).all()


def test_batch_independent_and_empty():
    seeds, rows = _t([11, 22, 33]), _t([4, 0, 9])
    batch = exponential_noise_fused(seeds, rows, CELLS)
    for i in range(3):
        alone = exponential_noise_fused(seeds[i : i + 1], rows[i : i + 1], CELLS)
        assert torch.equal(alone[0], batch[i])
    assert exponential_noise_fused(_t([]), _t([]), CELLS).shape == (0, CELLS)


@pytest.mark.cuda
def test_full_decode_batch_gpu():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (128,), generator=g).to(DEVICE)
    rows = torch.randint(0, 4000, (128,), generator=g).to(DEVICE)
    got, ref = _close_to_reference(seeds, rows)
    print(f"noise: {int((got == ref).sum())} of {got.numel()} cells bit-identical to torch")


def test_fused_sampler_picks_the_same_codes():
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(seed=s, top_k=50, top_p=0.95) for s in (1, 2, 3, 4)]
    plain = Sampler(len(params), torch.device(DEVICE))
    fused = Sampler(len(params), torch.device(DEVICE), fused=True)
    for slot, p in enumerate(params):
        plain.set_params(slot, p, p.seed)
        fused.set_params(slot, p, p.seed)
    logits = (torch.randn(4, NUM_CODEBOOKS, CODEBOOK_SIZE, generator=g) * 3).to(DEVICE)
    forbidden = torch.zeros_like(logits, dtype=torch.bool)
    slots, row_index = _t([0, 1, 2, 3]), _t([0, 7, 3, 1])
    a = plain.sample(logits, forbidden, slots, row_index)
    b = fused.sample(logits, forbidden, slots, row_index)
    assert torch.equal(a, b)
