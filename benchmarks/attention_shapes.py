"""Our paged attention kernels at Higgs decode shapes (GQA 32/8, head_dim 128, bf16, pages of
16) over tile, pipeline, K-load and KV-split settings, next to the KV-traffic floor. The
top five settings per case, then one table. `--graphs` times each call replayed from a CUDA
graph (as the engine runs them) instead of launched from Python.

    python benchmarks/attention_shapes.py [--quick] [--prefetch] [--cases ...] [--graphs]
        [--kv-dtype fp8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.runtime.errors
import triton.testing

from benchmarks.gemm_shapes import graphed
from kernels.norm_rope import qk_norm_rope_store
from kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_decode_attention_fused,
)
from kernels.paged_decode import decode_splits, paged_decode_attention

GRAPHS = False  # --graphs: time graph replays
KV_DTYPE = torch.bfloat16  # --kv-dtype fp8: a float8 (e4m3) cache, as CLONECAST_KV_CACHE_DTYPE


def _bench(fn, **kw) -> float:
    """Median (or as `kw` says) milliseconds of fn, launched from Python or, with --graphs,
    replayed from a CUDA graph captured after two warm-up calls."""
    return triton.testing.do_bench(graphed(fn) if GRAPHS else fn, **kw)


CASES = {  # name: (query lengths, context lengths, launch bound; 0 = the longest query)
    "decode 64 x 400": ([1] * 64, [399] * 64, 0),
    "decode 32 x 400": ([1] * 32, [399] * 32, 0),
    "decode 1 x 2000": ([1], [1999], 0),
    "decode 1 x 400": ([1], [399], 0),  # one stream at a typical context (C = 1)
    "decode 256 x 400": ([1] * 256, [399] * 256, 0),
    "prefill 212 + 44": ([212] + [1] * 44, [0] + [300] * 44, 0),
    # a served mixed step: 64 decode rows and one new request's text, in the 128-token graph
    "mixed 64 + 50 @128": ([1] * 64 + [50], [399] * 64 + [150], 128),
}


def make(q_lens, ctx_lens):
    page, hkv, d = 16, 8, 128
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    pages = max(-(-s // page) for s in seq_lens)
    nblocks = len(q_lens) * pages + 1
    k = torch.randn(nblocks, page, hkv, d, device="cuda", dtype=torch.bfloat16).to(KV_DTYPE)
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16).to(KV_DTYPE)
    tables = (torch.randperm(nblocks - 1, device="cuda")[: len(q_lens) * pages] + 1).view(
        len(q_lens), pages
    )
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int64
    )
    q = torch.randn(sum(q_lens), 32, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int64)
    kv_bytes = sum(seq_lens) * hkv * d * 2 * k.element_size()
    # int64 index tensors, as the engine passes them (views of its staging buffer)
    return (q, k, v, qsl, lens, tables.long()), kv_bytes


def _configs(decode: bool, num_seqs: int, grid_order: bool, prefetch: bool = False):
    """(label, callable(args, max_q)) for every setting swept: the one-pass kernel always, the
    split-KV decode kernel for decode-only cases (more splits for fewer sequences); with
    `grid_order`, both grid orders (hf=1: heads first) on a narrower tile grid; with
    `prefetch`, only settings with page ids read a tile ahead: the one-pass kernel over
    tiles, warps and stages (stages only matter with it: tests/kernels/test_sm90_compile.py),
    and for decode cases the split-KV kernel at 2 to 8 splits (4 to 32 under 16 sequences)."""
    if prefetch:
        out = [
            (
                f"one+pf BN={bn} w={warps} s={stages}",
                lambda a, m, kw=dict(block_n=bn, num_warps=warps, num_stages=stages): (
                    paged_attention(*a, 128**-0.5, m, prefetch_pages=True, **kw)
                ),
            )
            for bn, warps, stages in itertools.product((16, 32, 64, 128), (4, 8), (2, 3, 4, 5))
        ]
        splits = (2, 4, 8) if num_seqs >= 16 else (4, 8, 16, 32)
        for sp, bn, stages in itertools.product(splits, (32, 64), (2, 3, 4)) if decode else ():
            kw = dict(block_n=bn, num_stages=stages, prefetch_pages=True)
            out.append(
                (
                    f"split{sp}+pf BN={bn} s={stages}",
                    lambda a, m, sp=sp, kw=kw: paged_decode_attention(*a, 128**-0.5, sp, **kw),
                )
            )
        return out
    out = []
    tiles = (32, 64) if grid_order else (32, 64, 128)
    orders = (0, 1) if grid_order else (0,)
    k_loads = (1,) if grid_order else (0, 1)
    for bn, warps, stages, k_rows, hf in itertools.product(tiles, (4, 8), (2, 3), k_loads, orders):
        kw = dict(block_n=bn, num_warps=warps, num_stages=stages, k_rows=bool(k_rows))
        kw["heads_first"] = bool(hf)
        out.append(
            (
                f"one BN={bn} w={warps} s={stages} kr={k_rows} hf={hf}",
                lambda a, m, kw=kw: paged_attention(*a, 128**-0.5, m, **kw),
            )
        )
    if decode:
        splits = ((2, 4) if grid_order else (2, 4, 8)) if num_seqs >= 16 else (4, 8, 16, 32)
        warp_counts = (4,) if grid_order else (4, 8)
        for sp, bn, warps, stages, k_rows, hf in itertools.product(
            splits, (32, 64), warp_counts, (2, 3), (0, 1), orders
        ):
            kw = dict(
                block_n=bn,
                num_warps=warps,
                num_stages=stages,
                k_rows=bool(k_rows),
                heads_first=bool(hf),
            )
            out.append(
                (
                    f"split{sp} BN={bn} w={warps} s={stages} kr={k_rows} hf={hf}",
                    lambda a, m, sp=sp, kw=kw: paged_decode_attention(*a, 128**-0.5, sp, **kw),
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="defaults only, no sweep")
    ap.add_argument(
        "--cases", default="", help="comma-separated case names, '_' for spaces (default: all)"
    )
    ap.add_argument(
        "--grid-order", action="store_true", help="sweep both grid orders on fewer tiles"
    )
    ap.add_argument(
        "--prefetch", action="store_true", help="sweep the one-pass kernel with page prefetch"
    )
    ap.add_argument("--graphs", action="store_true", help="time CUDA graph replays")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the cache's")
    args_ = ap.parse_args()
    global GRAPHS, KV_DTYPE
    GRAPHS = args_.graphs
    KV_DTYPE = torch.float8_e4m3fn if args_.kv_dtype == "fp8" else torch.bfloat16
    quick = args_.quick
    wanted = [c for c in args_.cases.split(",") if c]
    rows = []
    for name, (q_lens, ctx, bound) in CASES.items():
        if wanted and name.replace(" ", "_") not in wanted:
            continue
        args, kv_bytes = make(q_lens, ctx)
        max_q = bound or max(q_lens)
        ref = paged_attention_reference(*args, 128**-0.5).float()
        results = []
        sweep = _configs(max(q_lens) == 1, len(q_lens), args_.grid_order, args_.prefetch)
        for label, fn in [] if quick else sweep:
            try:
                out = fn(args, max_q)
            except triton.runtime.errors.OutOfResources as e:  # too many stages for the tile
                print(f"{name}: {label} does not fit ({e}); skipped")
                continue
            if float((out.float() - ref).norm() / ref.norm()) > 1e-2:
                print(f"{name}: {label} does not match the reference; skipped")
                continue
            ms = _bench(lambda fn=fn, a=args, m=max_q: fn(a, m), rep=40, return_mode="median")
            results.append((ms * 1e3, label))
        results.sort()
        out = paged_attention(*args, 128**-0.5, max_q)
        assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2, name
        default = _bench(
            lambda a=args, m=max_q: paged_attention(*a, 128**-0.5, m), return_mode="median"
        )
        heads_first = _bench(
            lambda a=args, m=max_q: paged_attention(*a, 128**-0.5, m, heads_first=True),
            return_mode="median",
        )
        # page ids read one tile ahead (the plan's page_prefetch)
        out = paged_attention(*args, 128**-0.5, max_q, prefetch_pages=True)
        assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2, name
        prefetch = _bench(
            lambda a=args, m=max_q: paged_attention(*a, 128**-0.5, m, prefetch_pages=True),
            return_mode="median",
        )
        # what the one-pass kernel launched before its knobs were passed through: one page
        # (16 keys) per tile, Triton's default 4 warps and 3 stages
        old = _bench(
            lambda a=args, m=max_q: paged_attention(
                *a, 128**-0.5, m, block_n=16, num_warps=4, num_stages=3
            ),
            return_mode="median",
        )
        floor_us = kv_bytes / 4.13e12 * 1e6
        best = results[0] if results else (float("nan"), "-")
        print(f"{name}: top 8 {results[:8]}")
        times = (old, default, heads_first, prefetch)
        rows.append((name, *(t * 1e3 for t in times), *best, floor_us))
    head = ("case", "BN=16 us", "default us", "hf us", "pf us", "best us")
    print(
        "\n{:<19}{:>9}{:>11}{:>7}{:>7}{:>9}  {:<39}{:>9}".format(*head, "best config", "floor us")
    )
    for name, o, d, hf, pf, b, cfg, fl in rows:
        print(f"{name:<19}{o:>9.1f}{d:>11.1f}{hf:>7.1f}{pf:>7.1f}{b:>9.1f}  {cfg:<39}{fl:>9.1f}")
    fused_table(wanted)


def fused_table(wanted):
    """Decode cases the one-pass kernel serves (no context split): q/k-norm + RoPE with the
    K/V store then attention, as two launches and as one (the plan's `fused_decode`)."""
    from engine.model import RotaryEmbedding

    print(
        "\ncase                two launches us  fused us  fused+pf us  (q/k-norm + RoPE + K/V "
        "store + attention; pf: page ids a tile ahead)"
    )
    rope = RotaryEmbedding(128, 1e6, 4096).to("cuda")
    for name, (q_lens, ctx, _) in CASES.items():
        decode = max(q_lens) == 1 and decode_splits(len(q_lens), 8) == 1
        if decode and (not wanted or name.replace(" ", "_") in wanted):
            two, one, one_pf = _fused_case(q_lens, ctx, rope)
            print(f"{name:<19}{two:>16.1f}{one:>10.1f}{one_pf:>13.1f}")


def _fused_case(q_lens, ctx, rope) -> tuple[float, float, float]:
    """(two launches us, fused us, fused with page prefetch us) for one decode case."""
    (_, k, v, qsl, lens, tables), _ = make(q_lens, ctx)
    page = k.shape[1]
    positions = torch.tensor(ctx, device="cuda")
    rows = torch.arange(len(ctx), device="cuda")
    slots = tables[rows, positions // page].long() * page + positions % page
    qkv = torch.randn(len(ctx), 48 * 128, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    norm = (weight, weight, rope.cos, rope.sin, positions, 32, 8, 1e-6)
    cache = torch.stack([k, v])
    index = (qsl, lens, tables)

    def two():
        q = qk_norm_rope_store(qkv, *norm, cache, slots)
        return paged_attention(q, cache[0], cache[1], *index, 128**-0.5, 1)

    def one(prefetch=False):
        return paged_decode_attention_fused(
            qkv, *norm, cache[0], cache[1], slots, *index, 128**-0.5, prefetch_pages=prefetch
        )

    for fn in (one, lambda: one(True)):
        err = float((fn().float() - two().float()).norm() / two().float().norm())
        assert err <= 1e-2, err
    t2 = _bench(two, return_mode="median") * 1e3
    t1 = _bench(one, return_mode="median") * 1e3
    return t2, t1, _bench(lambda: one(True), return_mode="median") * 1e3


if __name__ == "__main__":
    main()
