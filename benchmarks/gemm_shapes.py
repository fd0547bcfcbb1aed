"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it), and in graphs two other ways of asking
for the same product: the weight stored transposed (`x @ W^T` as an NN GEMM, other kernels)
and cuBLASLt instead of cuBLAS (`torch.backends.cuda.preferred_blas_library`). Prints
achieved weight bandwidth. One call, one table. (A Triton tensor-core skinny GEMM with
split-K and a Triton GEMV for 1-4 rows were measured against these in graphs and were not
faster; see docs/PERFORMANCE.md.) `--gemv` instead times kernels/gemv.py (the few-row path,
each projection with the layer's norm or SiLU folded in, as the model calls it) per tile
setting, chained as in a step, with and without programmatic dependent launch, against cuBLAS.

    python benchmarks/gemm_shapes.py [--batches 1,32,64,128] [--gemv]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

SHAPES = {
    "qkv": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "audio_head": (8208, 2560),
}


def graphed(fn):
    """fn captured in a CUDA graph (after two warm-up calls); returns the replay."""
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


COPIES = 8  # weight copies cycled through per timed call: at least 168 MB, beyond the L2


def bench(fn) -> float:
    """Median milliseconds of one call (fn runs one call per weight copy: no L2 reuse)."""
    return triton.testing.do_bench(fn, return_mode="median") / COPIES


# (block_n, block_k, num_warps) tried per shape by --gemv
GEMV_TILES = [
    (4, 512, 2),
    (8, 512, 2),
    (8, 512, 4),
    (8, 256, 4),
    (16, 256, 4),
    (16, 512, 4),
    (4, 1024, 4),
    (2, 1024, 2),
    (32, 128, 4),
]
# how the few-row layer calls each projection (kernels/gemv.py modes)
GEMV_MODE = {"qkv": "norm", "o_proj": "residual", "gate_up": "norm+gated", "down": "residual"}


def _gemv_call(mode, m, n, k):
    """(input, keyword arguments) of one projection as the layer calls it."""
    from kernels.gemv import square_sums

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    kw = {}
    if "norm" in mode:
        kw = {
            "norm_weight": torch.ones(k, device="cuda", dtype=torch.bfloat16),
            "partials": square_sums(x),
            "gated": "gated" in mode,
        }
    elif mode == "residual":
        kw = {"residual": torch.randn(m, n, device="cuda", dtype=torch.bfloat16)}
    return x, kw


def gemv_table(batches: list[int]) -> None:
    """Per shape and row count: cuBLAS in a graph, our GEMV in the layer's mode plain (no
    folding) at the shape's tuned tile, then folded at the best tile with PDL on and the same
    tile with PDL off (chains of COPIES calls, one weight copy each)."""
    from kernels.gemv import TILES, gemv
    from kernels.launch import use_pdl

    head = ("gemm", "M", "cuBLAS", "TB/s", "plain", "best tile", "folded", "TB/s", "no-pdl")
    print("\n{:<9}{:>3}{:>8}{:>6}{:>8}  {:<15}{:>8}{:>6}{:>8}   (us)".format(*head))
    for name, mode in GEMV_MODE.items():
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        gb = n * k * 2 / 1e9
        for m in batches:
            x, kw = _gemv_call(mode, m, n // 2 if "gated" in mode else n, k)
            cublas = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))

            def chain(tile, pdl, kw, x=x, ws=ws):
                with use_pdl(pdl):
                    return bench(graphed(lambda: [gemv(x, w, tile=tile, **kw) for w in ws]))

            plain = chain(TILES[(n, k)], True, {})
            timed = sorted((chain(tile, True, kw), tile) for tile in GEMV_TILES)
            best_us, tile = timed[0]
            off = chain(tile, False, kw)
            print(
                f"{name:<9}{m:>3}{cublas * 1e3:>8.1f}{gb / cublas:>6.2f}{plain * 1e3:>8.1f}  "
                f"{str(tile):<15}{best_us * 1e3:>8.1f}{gb / best_us:>6.2f}{off * 1e3:>8.1f}"
            )
        del ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,64,128")
    ap.add_argument("--gemv", action="store_true", help="the few-row GEMV table instead")
    args = ap.parse_args()
    if args.gemv:
        gemv_table([int(b) for b in args.batches.split(",")])
        return
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        wts = [w.t().contiguous() for w in ws]  # [K, N]: the same product as an NN GEMM
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            cublas = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
            nn = bench(graphed(lambda x=x, wts=wts: [x @ wt for wt in wts]))
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append((name, m, n * k * 2 / 1e9, eager, cublas, nn, lt))
        del ws, wts
    head = ("gemm", "M", "eager us", "graph us", "TB/s", "NN us", "TB/s", "Lt us", "TB/s")
    print("\n{:<11}{:>5}{:>10}{:>10}{:>6}{:>8}{:>6}{:>8}{:>6}".format(*head))
    for name, m, gb, eag, cub, nn, lt in rows:
        print(
            f"{name:<11}{m:>5}{eag * 1e3:>10.1f}{cub * 1e3:>10.1f}{gb / cub:>6.2f}"
            f"{nn * 1e3:>8.1f}{gb / nn:>6.2f}{lt * 1e3:>8.1f}{gb / lt:>6.2f}"
        )


if __name__ == "__main__":
    main()
