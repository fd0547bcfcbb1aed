"""Audio-row sampling (spec section 4) against `engine.sampler`."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import CODEBOOK_SIZE, NUM_CODEBOOKS, SamplingParams
from engine.sampler import Sampler, exponential_noise, filter_top_k_top_p, mix32

CPU = torch.device("cpu")
M32 = 0xFFFFFFFF
V = CODEBOOK_SIZE


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def make_sampler(params: list[tuple[SamplingParams, int]]) -> Sampler:
    """A sampler whose slot i has params[i] = (SamplingParams, seed)."""
    sampler = Sampler(len(params), CPU)
    for slot, (p, seed) in enumerate(params):
        sampler.set_params(slot, p, seed)
    return sampler


def gather_forbidden(forbidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return forbidden.gather(-1, codes[..., None])[..., 0]


# -- mix32 ---------------------------------------------------------------------------------


def py_mix32(x: int) -> int:
    """Plain-integer reference of the xorshift-multiply finaliser."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_mix32_matches_plain_integer_reference():
    gen = torch.Generator().manual_seed(0)
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32]
    values += torch.randint(0, 2**32, (200,), generator=gen).tolist()
    out = mix32(t(values)).tolist()
    assert out == [py_mix32(v) for v in values]


@pytest.mark.parametrize("start", [0, 2**31 - 2**15, 2**32 - 2**16])
def test_mix32_is_injective_on_consecutive_inputs_and_in_range(start):
    x = torch.arange(start, start + 2**16, dtype=torch.long)
    y = mix32(x)
    assert y.dtype == torch.long
    assert int(y.min()) >= 0 and int(y.max()) < 2**32
    assert torch.unique(y).numel() == 2**16
    # Not the identity (a finaliser scrambles): most outputs move.
    assert (y != x).float().mean() > 0.99


# -- exponential_noise ---------------------------------------------------------------------


def test_noise_shape_positive_finite_and_exp1_moments():
    rows = 98  # 98 * 8 * 1026 = 804,384 values
    seeds = torch.arange(rows, dtype=torch.long) * 7919 + 3
    row_index = torch.arange(rows, dtype=torch.long) * 3
    e = exponential_noise(seeds, row_index)
    assert e.shape == (rows, NUM_CODEBOOKS, CODEBOOK_SIZE)
    assert e.dtype == torch.float32
    assert torch.isfinite(e).all()
    assert (e > 0).all()
    e64 = e.double()
    assert 0.99 < e64.mean().item() < 1.01
    assert 0.97 < e64.var().item() < 1.03  # Var Exp(1) = 1
    # P(e > 1) = exp(-1) for Exp(1); a uniform or half-normal would miss this.
    assert abs((e64 > 1).double().mean().item() - math.exp(-1)) < 0.005
    # Max of 800k Exp(1) draws is around log(800k) ~ 13.6.
    assert 10 < e64.max().item() < 20


def test_noise_depends_on_seed_row_and_cell():
    base = exponential_noise(t([1234]), t([5]))
    assert torch.equal(base, exponential_noise(t([1234]), t([5])))  # deterministic
    other_seed = exponential_noise(t([1235]), t([5]))
    high_seed = exponential_noise(t([1234 + 2**32]), t([5]))  # differs in the high word
    other_row = exponential_noise(t([1234]), t([6]))
    for other in (other_seed, high_seed, other_row):
        assert (base != other).float().mean() > 0.99
    # Codebooks of one row do not share noise.
    assert (base[0, 0] != base[0, 1]).float().mean() > 0.99
    # Swapping seed and row index does not give the same stream.
    assert not torch.equal(exponential_noise(t([5]), t([1234])), base)


def test_noise_is_batch_independent():
    gen = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 2**62, (16,), generator=gen)
    seeds[3] = 0
    seeds[7] = 2**63 - 1
    row_index = torch.randint(0, 2048, (16,), generator=gen)
    batch = exponential_noise(seeds, row_index)
    for i in range(16):
        alone = exponential_noise(seeds[i : i + 1], row_index[i : i + 1])
        assert torch.equal(alone[0], batch[i]), i
    for trial in range(3):
        perm = torch.randperm(16, generator=gen)
        permuted = exponential_noise(seeds[perm], row_index[perm])
        assert torch.equal(permuted, batch[perm]), trial


# -- filter_top_k_top_p --------------------------------------------------------------------


def distinct_logits(rows: int, cbs: int, gen: torch.Generator, scale: float = 3.0):
    """Logits with all-distinct values in each row (a random permutation of a grid)."""
    grid = torch.linspace(-scale, scale, V)
    return torch.stack(
        [
            torch.stack([grid[torch.randperm(V, generator=gen)] for _ in range(cbs)])
            for _ in range(rows)
        ]
    )


def test_top_k_keeps_exactly_k():
    gen = torch.Generator().manual_seed(2)
    ks = [1, 2, 7, 50, 1025, 1026]
    logits = distinct_logits(len(ks), 3, gen)
    out = filter_top_k_top_p(logits, t(ks), torch.ones(len(ks)))
    assert out.shape == logits.shape
    for r, k in enumerate(ks):
        for q in range(3):
            kept = torch.isfinite(out[r, q])
            assert int(kept.sum()) == k
            expected = set(logits[r, q].topk(k).indices.tolist())
            assert set(torch.nonzero(kept).flatten().tolist()) == expected
            assert torch.equal(out[r, q][kept], logits[r, q][kept])  # values untouched
            assert (out[r, q][~kept] == float("-inf")).all()


def reference_top_p_count(row: list[float], p: float) -> int:
    """Size of the smallest prefix of the sorted distribution whose mass reaches p."""
    m = max(row)
    weights = sorted((math.exp(x - m) for x in row), reverse=True)
    total = sum(weights)
    mass = 0.0
    for n, w in enumerate(weights, start=1):
        mass += w / total
        if mass >= p:
            return n
    return len(weights)


def test_top_p_keeps_smallest_prefix_reaching_p():
    """p is put midway between two cumulative masses so the answer is unambiguous."""
    gen = torch.Generator().manual_seed(3)
    rows = 12
    logits = distinct_logits(rows, 1, gen, scale=2.0)
    # Gaps between cumulative masses stay far above fp32 rounding of the cumsum.
    targets = [1, 2, 3, 5, 10, 40, 100, 300, 500, 700, 800, 900]
    top_p = []
    for r in range(rows):
        probs = torch.softmax(logits[r, 0].double(), -1).sort(descending=True).values
        cum = probs.cumsum(0)
        n = targets[r]
        top_p.append(float((cum[n - 2] + cum[n - 1]) / 2) if n > 1 else float(cum[0] / 2))
    top_p_t = torch.tensor(top_p, dtype=torch.float32)
    out = filter_top_k_top_p(logits, t([V] * rows), top_p_t)
    for r in range(rows):
        expected_n = reference_top_p_count(logits[r, 0].tolist(), float(top_p_t[r]))
        assert expected_n == targets[r]
        kept = torch.isfinite(out[r, 0])
        assert int(kept.sum()) == expected_n, r
        assert set(torch.nonzero(kept).flatten().tolist()) == set(
            logits[r, 0].topk(expected_n).indices.tolist()
        )


def test_top_p_exact_boundary_keeps_smallest_prefix():
    """Probabilities 1/2, 1/4, 1/8, 1/8 are exact in fp32: top_p 0.5 reached by the first
    entry alone, 0.75 by the first two (as transformers' and vLLM's top-p filters do)."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))[None, None, :].repeat(2, 1, 1)
    out = filter_top_k_top_p(logits, t([4, 4]), torch.tensor([0.5, 0.75]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, False, False]
    assert torch.isfinite(out[1, 0]).tolist() == [True, True, False, False]


def test_top_k_then_top_p_uses_renormalised_top_k_mass():
    """top-p runs on the distribution left by top-k (renormalised), as the spec orders them.
    probs [0.4, 0.3, 0.2, 0.1]: top_k 2 leaves [4/7, 3/7], so top_p 0.55 keeps one code
    (on the full mass it would keep two); top_k 3 leaves [4/9, 3/9, 2/9], so top_p 0.75
    keeps two (on the full mass, three)."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))[None, None, :]
    out = filter_top_k_top_p(logits, t([2]), torch.tensor([0.55]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, False, False]
    out = filter_top_k_top_p(logits, t([2]), torch.tensor([0.6]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]
    out = filter_top_k_top_p(logits, t([3]), torch.tensor([0.75]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]
    out = filter_top_k_top_p(logits, t([3]), torch.tensor([0.8]))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, True, False]


def test_filters_disabled_keep_everything():
    gen = torch.Generator().manual_seed(4)
    # A wide spread: most tail probabilities underflow, the cumsum reaches 1.0 early.
    logits = torch.randn(3, NUM_CODEBOOKS, V, generator=gen) * 40
    out = filter_top_k_top_p(logits, t([V] * 3), torch.ones(3))
    assert torch.equal(out, logits)


def test_most_likely_entry_always_kept():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, NUM_CODEBOOKS, V, generator=gen) * 5
    best = logits.argmax(-1)
    for top_k, top_p in [(1, 1.0), (V, 1e-6), (1, 1e-6), (50, 0.01)]:
        out = filter_top_k_top_p(logits, t([top_k] * 4), torch.full((4,), top_p))
        assert torch.isfinite(out.gather(-1, best[..., None])).all(), (top_k, top_p)
        if top_k == 1 or top_p == 1e-6:
            assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(4, NUM_CODEBOOKS).long())


def test_filter_is_per_row():
    gen = torch.Generator().manual_seed(6)
    logits = distinct_logits(3, 2, gen)
    ks, ps = t([3, V, 20]), torch.tensor([1.0, 0.5, 0.9])
    batch = filter_top_k_top_p(logits, ks, ps)
    for r in range(3):
        alone = filter_top_k_top_p(logits[r : r + 1], ks[r : r + 1], ps[r : r + 1])
        assert torch.equal(alone[0], batch[r])
    assert int(torch.isfinite(batch[0, 0]).sum()) == 3


# -- Sampler.sample ------------------------------------------------------------------------


def test_set_params_maps_top_k_zero_to_disabled():
    sampler = make_sampler(
        [(SamplingParams(temperature=0.7, top_k=0, top_p=0.9), 42), (SamplingParams(top_k=17), 7)]
    )
    assert sampler.top_k.tolist() == [V, 17]
    assert sampler.temperature[0].item() == pytest.approx(0.7)
    assert sampler.top_p[0].item() == pytest.approx(0.9)
    assert sampler.seed.tolist() == [42, 7]


def test_temperature_zero_is_masked_argmax():
    gen = torch.Generator().manual_seed(7)
    rows = 16
    logits = torch.randn(rows, NUM_CODEBOOKS, V, generator=gen)
    forbidden = torch.rand(rows, NUM_CODEBOOKS, V, generator=gen) < 0.5
    forbidden[..., 0] = False
    logits = logits + forbidden * 100.0  # forbidden codes are the most likely ones
    sampler = make_sampler([(SamplingParams(temperature=0.0, top_k=50, top_p=0.95), 11)])
    codes = sampler.sample(logits, forbidden, t([0] * rows), torch.arange(rows))
    assert codes.shape == (rows, NUM_CODEBOOKS) and codes.dtype == torch.long
    expected = torch.empty(rows, NUM_CODEBOOKS, dtype=torch.long)
    for r in range(rows):
        for q in range(NUM_CODEBOOKS):
            values, banned = logits[r, q].tolist(), forbidden[r, q].tolist()
            expected[r, q] = max((v, c) for c, v in enumerate(values) if not banned[c])[1]
    assert torch.equal(codes, expected)
    assert not torch.equal(codes, logits.argmax(-1))


@pytest.mark.parametrize("trial", range(4))
def test_forbidden_codes_never_sampled(trial):
    gen = torch.Generator().manual_seed(100 + trial)
    rows = 24
    params = [
        (SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 1),
        (SamplingParams(temperature=2.0, top_k=0, top_p=1.0), 2),
        (SamplingParams(temperature=0.3, top_k=5, top_p=0.95), 3),
        (SamplingParams(temperature=1.0, top_k=50, top_p=0.5), 4),
        (SamplingParams(temperature=0.0), 5),
        (SamplingParams(temperature=1.5, top_k=1, top_p=1.0), 6),
    ]
    sampler = make_sampler(params)
    logits = torch.randn(rows, NUM_CODEBOOKS, V, generator=gen) * 3
    density = torch.tensor([0.0, 0.5, 0.99, 0.999])[
        torch.randint(0, 4, (rows, NUM_CODEBOOKS, 1), generator=gen)
    ]
    forbidden = torch.rand(rows, NUM_CODEBOOKS, V, generator=gen) < density
    keep = torch.randint(0, V, (rows, NUM_CODEBOOKS, 1), generator=gen)
    forbidden.scatter_(-1, keep, False)  # at least one allowed code per codebook
    logits = logits + forbidden * 20.0  # make forbidden codes attractive
    slots = torch.randint(0, len(params), (rows,), generator=gen)
    row_index = torch.randint(0, 2048, (rows,), generator=gen)
    codes = sampler.sample(logits, forbidden, slots, row_index)
    assert int(codes.min()) >= 0 and int(codes.max()) < V
    assert not gather_forbidden(forbidden, codes).any()


def test_single_allowed_code_is_returned():
    gen = torch.Generator().manual_seed(8)
    params = [
        (SamplingParams(temperature=0.0), 1),
        (SamplingParams(temperature=0.5, top_k=1, top_p=1.0), 2),
        (SamplingParams(temperature=1.0, top_k=50, top_p=0.1), 3),
        (SamplingParams(temperature=2.0, top_k=0, top_p=1.0), 4),
    ]
    sampler = make_sampler(params)
    rows = 8
    logits = torch.randn(rows, NUM_CODEBOOKS, V, generator=gen)
    only = torch.randint(0, V, (rows, NUM_CODEBOOKS), generator=gen)
    logits.scatter_(-1, only[..., None], -50.0)  # the allowed code is the least likely one
    forbidden = torch.ones(rows, NUM_CODEBOOKS, V, dtype=torch.bool)
    forbidden.scatter_(-1, only[..., None], False)
    slots = torch.arange(rows) % len(params)
    codes = sampler.sample(logits, forbidden, slots, torch.arange(rows) * 13)
    assert torch.equal(codes, only)


def test_empty_row_falls_back_to_argmax_without_nan():
    sampler = make_sampler([(SamplingParams(temperature=1.0, top_k=50, top_p=0.95), 9)] * 2)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, NUM_CODEBOOKS, V, generator=gen)
    forbidden = torch.zeros(2, NUM_CODEBOOKS, V, dtype=torch.bool)
    logits[0, 3] = float("-inf")  # a codebook with all -inf logits
    forbidden[1, 0] = True  # a codebook whose mask leaves nothing
    forbidden[1, 5, :1000] = True  # a normal codebook beside them
    codes = sampler.sample(logits, forbidden, t([0, 1]), t([0, 0]))
    assert codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < V
    masked = logits.masked_fill(forbidden, float("-inf"))
    assert codes[0, 3] == masked[0, 3].argmax()
    assert codes[1, 0] == masked[1, 0].argmax()
    assert int(codes[1, 5]) >= 1000
    # The other codebooks of those rows sample normally (within top-k 50).
    top50 = logits.topk(50, dim=-1).indices
    for r, q in [(0, 0), (0, 7), (1, 1), (1, 7)]:
        assert int(codes[r, q]) in top50[r, q].tolist()


def test_per_slot_parameters_respected():
    gen = torch.Generator().manual_seed(10)
    # Two close favourites (codes 100, 200) then a broad tail with substantial mass.
    base = torch.randn(NUM_CODEBOOKS, V, generator=gen) * 0.1
    base[:, 100] = 3.0
    base[:, 200] = 2.9
    params = [
        (SamplingParams(temperature=0.0), 5),  # greedy
        (SamplingParams(temperature=1.0, top_k=2, top_p=1.0), 5),  # two favourites only
        (SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 5),  # everything
        (SamplingParams(temperature=1.0, top_k=1, top_p=1.0), 5),  # greedy via top-k
    ]
    sampler = make_sampler(params)
    n = 16
    slots = torch.tensor([1, 0, 3, 2] * n)  # batch order differs from slot order
    rows = slots.numel()
    logits = base.expand(rows, -1, -1).contiguous()
    forbidden = torch.zeros(rows, NUM_CODEBOOKS, V, dtype=torch.bool)
    row_index = torch.arange(rows)
    codes = sampler.sample(logits, forbidden, slots, row_index)
    by_slot = {s: codes[slots == s].flatten() for s in range(4)}
    assert (by_slot[0] == 100).all()
    assert (by_slot[3] == 100).all()
    two = by_slot[1]
    assert set(two.unique().tolist()) == {100, 200}
    wide = by_slot[2]
    assert ((wide != 100) & (wide != 200)).float().mean() > 0.5  # the tail holds ~96% of the mass


def test_same_seed_same_rows_alone_and_in_batch():
    gen = torch.Generator().manual_seed(11)
    params = [
        (SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 1000 + 17 * i) for i in range(8)
    ]
    params[5] = (SamplingParams(temperature=0.8, top_k=40, top_p=0.9), 2**40 + 3)
    sampler = make_sampler(params)
    rows = 8
    logits = torch.randn(rows, NUM_CODEBOOKS, V, generator=gen)
    forbidden = torch.rand(rows, NUM_CODEBOOKS, V, generator=gen) < 0.3
    forbidden[..., 0] = False
    slots = torch.randperm(8, generator=gen)
    row_index = torch.randint(0, 2048, (rows,), generator=gen)
    batch = sampler.sample(logits, forbidden, slots, row_index)
    for i in range(rows):
        alone = sampler.sample(
            logits[i : i + 1], forbidden[i : i + 1], slots[i : i + 1], row_index[i : i + 1]
        )
        assert torch.equal(alone[0], batch[i]), i
    perm = torch.randperm(rows, generator=gen)
    again = sampler.sample(logits[perm], forbidden[perm], slots[perm], row_index[perm])
    assert torch.equal(again, batch[perm])

    # A different slot with the same seed and parameters gives the same codes...
    twin = make_sampler([(SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 1000)] * 3)
    a = twin.sample(logits[:1], forbidden[:1], t([0]), t([9]))
    b = twin.sample(
        logits[:1].repeat(3, 1, 1), forbidden[:1].repeat(3, 1, 1), t([2, 1, 0]), t([9, 9, 9])
    )
    assert all(torch.equal(a[0], b[i]) for i in range(3))
    # ...and another seed or row index (almost surely) different ones on flat logits.
    flat = torch.zeros(1, NUM_CODEBOOKS, V)
    none = torch.zeros(1, NUM_CODEBOOKS, V, dtype=torch.bool)
    base = twin.sample(flat, none, t([0]), t([9]))
    assert not torch.equal(base, twin.sample(flat, none, t([0]), t([10])))
    other = make_sampler([(SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 1001)])
    assert not torch.equal(base, other.sample(flat, none, t([0]), t([9])))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    support = [10, 200, 513, 1000]
    support_logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    rows = 512  # 4096 draws (8 codebooks per row use disjoint noise); the CPU noise is slow
    logits = torch.randn(NUM_CODEBOOKS, V, generator=torch.Generator().manual_seed(12)) + 5
    logits[:, support] = support_logits
    forbidden = torch.ones(NUM_CODEBOOKS, V, dtype=torch.bool)
    forbidden[:, support] = False
    sampler = make_sampler([(SamplingParams(temperature=temperature, top_k=0, top_p=1.0), 77)])
    codes = sampler.sample(
        logits.expand(rows, -1, -1),
        forbidden.expand(rows, -1, -1),
        t([0] * rows),
        torch.arange(rows),
    ).flatten()
    expected = torch.softmax(support_logits.double() / temperature, -1)
    counts = torch.stack([(codes == c).sum() for c in support]).double()
    n = codes.numel()
    assert int(counts.sum()) == n  # nothing outside the support
    assert bool((counts > 0).all()), f"an allowed code was never drawn: {counts.tolist()}"
    # Per code: within 4.5 binomial standard errors (at T = 0.5 the rarest code has p = 0.032:
    # 131 expected draws, one standard error 11); together: Pearson's chi-square with 3
    # degrees of freedom below 25.9, its 1 - 1e-5 quantile. The draws are seeded, so the
    # test is deterministic; a sampler that skips a code, or mistakes one temperature for
    # the other (at T = 1 the rarest code has p = 0.101), is far outside both bounds.
    sigma = (n * expected * (1 - expected)).sqrt()
    z = (counts - n * expected) / sigma
    assert bool((z.abs() < 4.5).all()), (counts.tolist(), (n * expected).tolist())
    chi_square = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi_square < 25.9, (chi_square, counts.tolist(), (n * expected).tolist())


def test_set_many_equals_set_params_per_slot():
    """The runner sets the sampling parameters of a step's admitted requests at once
    (`set_many`, device tensors; top_k mapped by `top_k_of`, floats as float32)."""
    params = [
        (SamplingParams(temperature=0.7, top_k=50, top_p=0.95), 11),
        (SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 2**62 + 5),
        (SamplingParams(temperature=0.0, top_k=5000, top_p=0.5), 3),
    ]
    one, many = Sampler(5, CPU), Sampler(5, CPU)
    slots = [3, 0, 4]
    for slot, (p, seed) in zip(slots, params, strict=True):
        one.set_params(slot, p, seed)
    many.set_many(
        t(slots),
        torch.tensor([p.temperature for p, _ in params], dtype=torch.float32),
        t([Sampler.top_k_of(p) for p, _ in params]),
        torch.tensor([p.top_p for p, _ in params], dtype=torch.float32),
        t([seed for _, seed in params]),
    )
    for name in ("temperature", "top_k", "top_p", "seed"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name
    assert many.top_k[0].item() == V and many.top_k[4].item() == V  # 0 and 5000: no limit
