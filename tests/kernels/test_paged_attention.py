"""The Triton paged-attention kernel against its plain torch reference: small shapes on the
CPU (Triton interpreter), the Higgs shape (GQA 32/8, head_dim 128, bf16) on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    DECODE_ROWS,
    PROMPT_ROWS,
    paged_attention,
    paged_attention_reference,
    query_block_size,
)

GPU = torch.cuda.is_available()


def make_batch(q_lens, ctx_lens, hq, hkv, d, page, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    max_pages = max(1, max(-(-s // page) for s in seq_lens))
    num_blocks = len(q_lens) * max_pages + 1
    k = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: len(q_lens) * max_pages] + 1).view(
        len(q_lens), max_pages
    )
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    meta = (
        qsl.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables.int().to(device),
    )
    return q, k, v, meta


def _head_major(cache):
    """The same values with head-major memory ([blocks, Hkv, page, D]) in the usual shape."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


CPU_CASES = [
    ([1, 1, 1], [5, 0, 17]),  # decode rows
    ([7, 1, 20, 0], [0, 9, 3, 0]),  # mixed, one padding sequence
    ([33], [10]),  # a prefill spanning several query blocks
    ([1] * 6, [40, 1, 2, 3, 4, 63]),
    ([4, 8, 9, 1, 16], [3, 0, 5, 30, 2]),  # query counts at and just past a small tile
]


@pytest.mark.parametrize("q_lens, ctx_lens", CPU_CASES)
@pytest.mark.parametrize("hq, hkv, d, page", [(4, 2, 16, 4), (8, 2, 32, 16)])
def test_kernel_matches_reference_small(q_lens, ctx_lens, hq, hkv, d, page):
    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch(q_lens, ctx_lens, hq, hkv, d, page, torch.float32, device)
    out = torch.full_like(q, float("nan"))  # poisoned: every valid row must be written
    paged_attention(q, k, v, *meta, d**-0.5, max(q_lens), out=out)
    ref = paged_attention_reference(q, k, v, *meta, d**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= (3e-3 if GPU else 1e-5)  # tf32 dots on a GPU


@pytest.mark.parametrize("q_lens, ctx_lens", CPU_CASES[1:3])
def test_kernel_reads_a_head_major_cache(q_lens, ctx_lens):
    """K/V in head-major memory ([blocks, Hkv, page, D] seen as [blocks, page, Hkv, D]): the
    kernel addresses pages through the strides and computes the same attention."""
    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, torch.float32, device)
    hk, hv = (_head_major(x) for x in (k, v))
    assert hk.stride(1) < hk.stride(2)  # the head-major order really is in memory
    ref = torch.full_like(q, float("nan"))
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 32**-0.5, max(q_lens), out=ref)
    paged_attention(q, hk, hv, *meta, 32**-0.5, max(q_lens), out=out)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("q_lens, ctx_lens", CPU_CASES[:3])
def test_kernels_read_a_float8_cache(q_lens, ctx_lens):
    """A float8 (e4m3) KV cache: both kernels widen what they read to fp16 and compute with q
    and the softmax weights in fp16, so their output is the reference's attention over the
    same (rounded) keys and values, within fp16's rounding of q and p (2**-11 a value)."""
    from kernels.paged_decode import paged_decode_attention

    device = "cuda" if GPU else "cpu"
    dtype = torch.bfloat16 if GPU else torch.float32
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, dtype, device)
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref = paged_attention_reference(q, k, v, *meta, 32**-0.5)
    tol = 5e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(paged_attention(q, k, v, *meta, 32**-0.5, max(q_lens)), ref) <= tol
    if max(q_lens) == 1:
        assert rel_err(paged_decode_attention(q, k, v, *meta, 32**-0.5, 4), ref) <= tol


def test_a_too_small_launch_bound_leaves_long_queries_uncomputed():
    """The capture-bound hazard in miniature: a launch sized for short queries skips the
    later query blocks of a long one."""
    device = "cuda" if GPU else "cpu"
    q_lens = [2 * query_block_size(1, 2) + 3, 1]
    q, k, v, meta = make_batch(q_lens, [4, 9], 4, 2, 16, 4, torch.float32, device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 0.25, max_query_len=1, out=out)
    assert torch.isnan(out[query_block_size(1, 2) : q_lens[0]]).all()
    paged_attention(q, k, v, *meta, 0.25, max_query_len=max(q_lens), out=out)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q_lens, ctx_lens", CPU_CASES + [([0, 1, 0, 0], [0, 3, 0, 0])])
@pytest.mark.parametrize("bound", ["max", "tokens"])
def test_the_flat_grid_computes_what_the_sequence_grid_does(q_lens, ctx_lens, bound):
    """The flat grid (one program per query block that can exist, each finding its sequence
    by binary search) writes the same rows, bit for bit, as one program per (sequence,
    query block), with the query bound of the batch or of a captured bucket (its token
    count); runs of padding sequences, first, inside and last, own a program each that
    returns at once."""
    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, torch.float32, device, seed=5)
    max_q = max(q_lens) if bound == "max" else q.shape[0]
    ref = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 32**-0.5, max(max_q, 1), out=ref)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 32**-0.5, max(max_q, 1), out=out, flat_grid=True)
    assert torch.equal(out, ref)


def test_the_flat_grid_needs_no_query_bound():
    """Where the sequence grid sized for short queries leaves a long one's later blocks
    uncomputed (the capture-bound hazard above), the flat grid, sized from the rows of q,
    computes them all."""
    device = "cuda" if GPU else "cpu"
    q_lens = [2 * query_block_size(1, 2) + 3, 1, 0]
    q, k, v, meta = make_batch(q_lens, [4, 9, 0], 4, 2, 16, 4, torch.float32, device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 0.25, max_query_len=1, out=out, flat_grid=True)
    ref = paged_attention_reference(q, k, v, *meta, 0.25)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= (3e-3 if GPU else 1e-5)


def _split_launches(q, k, v, meta, scale, bound, flat):
    """A mixed step in two launches, as the engine's split_mixed_attention runs it: prompt
    rows in tall tiles, then decode rows in the decode launch's small ones."""
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, scale, bound, out=out, flat_grid=flat, rows=PROMPT_ROWS)
    paged_attention(q, k, v, *meta, scale, 1, out=out, rows=DECODE_ROWS)
    return out


def _rows_of(q_lens, decode: bool) -> torch.Tensor:
    """A mask over the token rows: those of sequences of one query token (or the others)."""
    return torch.tensor([(n == 1) == decode for n in q_lens for _ in range(n)])


# mixed steps; the last: a prompt chunk of one position with no context (a 1-token query
# that is not a decode: the decode launch takes it, with the same arithmetic)
MIXED_CASES = [
    CPU_CASES[1],
    CPU_CASES[4],
    ([1, 0, 3, 1, 1], [6, 0, 0, 2, 11]),
    ([1, 4], [0, 3]),
]


@pytest.mark.parametrize("q_lens, ctx_lens", MIXED_CASES)
@pytest.mark.parametrize("flat", [False, True])
def test_decode_rows_apart_compute_what_their_own_launches_do(q_lens, ctx_lens, flat):
    """A launch of PROMPT_ROWS writes the rows of sequences of several query tokens and
    leaves the others alone, DECODE_ROWS the reverse; together they write every row, each
    bit for bit what a launch of every sequence writes with the same tile (the tall tile of
    the step's query bound for prompt rows, the decode launch's for decode rows)."""
    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, torch.float32, device, seed=3)
    scale, bound = 32**-0.5, max(q_lens)
    decode, prompt = _rows_of(q_lens, True).to(device), _rows_of(q_lens, False).to(device)
    assert decode.any() and prompt.any()
    tall, small = (torch.full_like(q, float("nan")) for _ in range(2))
    paged_attention(q, k, v, *meta, scale, bound, out=tall, flat_grid=flat)
    paged_attention(q, k, v, *meta, scale, 1, out=small)
    only = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, scale, bound, out=only, flat_grid=flat, rows=PROMPT_ROWS)
    assert torch.equal(only[prompt], tall[prompt]) and torch.isnan(only[decode]).all()
    only = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, scale, 1, out=only, rows=DECODE_ROWS)
    assert torch.equal(only[decode], small[decode]) and torch.isnan(only[prompt]).all()
    out = _split_launches(q, k, v, meta, scale, bound, flat)
    assert torch.equal(out[prompt], tall[prompt]) and torch.equal(out[decode], small[decode])
    ref = paged_attention_reference(q, k, v, *meta, scale)
    assert rel_err(out, ref) <= (3e-3 if GPU else 1e-5)
    with pytest.raises(ValueError, match="rows must be ALL_ROWS, DECODE_ROWS or PROMPT_ROWS"):
        paged_attention(q, k, v, *meta, scale, bound, rows=3)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "q_lens, ctx_lens",
    [
        ([1] * 64, [400] * 64),
        ([212] + [1] * 44, [0] + [300] * 44),
        ([1], [2000]),
        ([128, 64, 1], [0, 700, 5]),
    ],
)
@pytest.mark.parametrize("bound", [0, 256])  # 0: max(q_lens); 256: a captured bucket's bound
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("flat", [False, True])
def test_kernel_matches_reference_higgs_shape_bf16(q_lens, ctx_lens, bound, layout, flat):
    q, k, v, meta = make_batch(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    if layout == "hnd":
        k, v = (_head_major(x) for x in (k, v))
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, *meta, 128**-0.5, bound or max(q_lens), out=out, flat_grid=flat)
    ref = paged_attention_reference(q, k, v, *meta, 128**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize(
    "q_lens, ctx_lens",
    [([9] + [1] * 128, [300] + [400] * 128), ([25, 1, 140] + [1] * 253, [0, 5, 200] + [400] * 253)],
)
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_rows_apart_higgs_shape(q_lens, ctx_lens, cache):
    """The served mixed steps (decodes beside a clone prompt, in the bucket's graph bound and
    the flat grid) in two launches at the Higgs shape, over a bf16 and a float8 cache: every
    row written, the reference's attention within bf16 (fp16 operands for float8) rounding."""
    q, k, v, meta = make_batch(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    if cache == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    bound = 16 * -(-q.shape[0] // 16)  # the bucket's token count
    out = _split_launches(q, k, v, meta, 128**-0.5, bound, flat=True)
    ref = paged_attention_reference(q, k, v, *meta, 128**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("ctx_lens", [[5, 0, 17], [40, 1, 130, 0]])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_split_kv_decode_matches_reference(splits, ctx_lens, layout):
    from kernels.paged_decode import paged_decode_attention

    device = "cuda" if GPU else "cpu"
    q_lens = [1 if c or i % 2 == 0 else 0 for i, c in enumerate(ctx_lens)]
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, torch.float32, device, seed=splits)
    if layout == "hnd":
        k, v = (_head_major(x) for x in (k, v))
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, *meta, 32**-0.5, splits, out=out)
    ref = paged_attention_reference(q, k, v, *meta, 32**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= (3e-3 if GPU else 1e-5)


def test_decode_splits_fill_the_gpu_for_few_sequences():
    from kernels.paged_decode import decode_splits

    assert decode_splits(64, 8) == 1 and decode_splits(32, 8) == 1
    assert decode_splits(1, 8) == 32 and decode_splits(4, 8) == 8


@pytest.mark.cuda
@pytest.mark.parametrize(
    "q_lens_ctx", [([1], [2000]), ([1] * 4, [400, 3, 1000, 64]), ([1] * 16, [399] * 16)]
)
def test_split_kv_higgs_shape_bf16(q_lens_ctx):
    from kernels.paged_decode import decode_splits, paged_decode_attention

    q_lens, ctx = q_lens_ctx
    q, k, v, meta = make_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = paged_decode_attention(q, k, v, *meta, 128**-0.5, decode_splits(len(q_lens), 8))
    ref = paged_attention_reference(q, k, v, *meta, 128**-0.5)
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize(
    "block_n, k_rows, heads_first, prefetch",
    [
        (16, 0, 0, 0),
        (64, 0, 0, 0),
        (32, 1, 0, 0),
        (64, 1, 1, 0),
        (16, 0, 1, 0),
        (16, 1, 0, 1),
        (64, 1, 0, 1),
    ],
)
def test_tuning_knobs_change_speed_not_results(block_n, k_rows, heads_first, prefetch):
    """Tiles wider than a page (several pages per tile, partly masked at the end), K loaded
    row-major then transposed, the heads-first grid order and page ids read a tile ahead
    (one-pass kernel) give the reference result, on both kernels."""
    from kernels.paged_decode import paged_decode_attention

    device = "cuda" if GPU else "cpu"
    tol = 3e-3 if GPU else 1e-5
    q_lens, ctx_lens = [7, 1, 20, 0, 1], [0, 9, 70, 0, 130]
    q, k, v, meta = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, torch.float32, device, seed=3)
    ref = paged_attention_reference(q, k, v, *meta, 32**-0.5)
    out = torch.full_like(q, float("nan"))
    knobs = dict(block_n=block_n, k_rows=bool(k_rows), heads_first=bool(heads_first))
    paged_attention(
        q, k, v, *meta, 32**-0.5, max(q_lens), out=out, prefetch_pages=bool(prefetch), **knobs
    )
    assert torch.isfinite(out).all() and rel_err(out, ref) <= tol
    dq_lens, dctx = [1, 1, 0, 1], [40, 130, 0, 1]
    q, k, v, meta = make_batch(dq_lens, dctx, 8, 2, 32, 16, torch.float32, device, seed=4)
    ref = paged_attention_reference(q, k, v, *meta, 32**-0.5)
    out = torch.full_like(q, float("nan"))
    for splits in (2, 4):  # 4: not the KV head count, so the two grid axes cannot be confused
        out = torch.full_like(q, float("nan"))
        knobs["prefetch_pages"] = bool(prefetch)
        paged_decode_attention(q, k, v, *meta, 32**-0.5, splits, out=out, **knobs)
        assert torch.isfinite(out).all() and rel_err(out, ref) <= tol


def test_k_and_v_with_different_strides_are_refused():
    """Both kernels address V with K's offsets: a K/V pair from different layouts would read
    the wrong values, so the wrappers refuse it with a message."""
    from kernels.paged_decode import paged_decode_attention

    device = "cuda" if GPU else "cpu"
    q, k, v, meta = make_batch([1, 1], [5, 9], 4, 2, 16, 4, torch.float32, device)
    v_head_major = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match="same strides"):
        paged_attention(q, k, v_head_major, *meta, 0.25, 1)
    with pytest.raises(ValueError, match="same strides"):
        paged_decode_attention(q, k, v_head_major, *meta, 0.25, 2)
