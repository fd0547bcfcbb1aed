"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it), and for up to `kernels.gemv.MAX_ROWS`
rows our Triton GEMV, best of a sweep of tile settings, also from a graph. Prints achieved
weight bandwidth. One call, one table. (A Triton tensor-core skinny GEMM with split-K was
measured against cuBLAS at larger M and was not faster; see docs/PERFORMANCE.md.)

    python benchmarks/gemm_shapes.py [--batches 1,4,64,128]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton.testing

from kernels.gemv import MAX_ROWS, gemv

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


def bench(fn, rep: int = 100) -> float:
    """Median milliseconds of one call (fn runs one call per weight copy: no L2 reuse)."""
    return triton.testing.do_bench(fn, rep=rep, return_mode="median") / COPIES


GEMV_CONFIGS = list(itertools.product((4, 8, 16), (256, 512, 1024), (4,), (2, 4)))


def best_gemv(x, ws):
    """(ms, label) of the fastest GEMV setting, replayed from a graph, checked against cuBLAS."""
    ref = F.linear(x, ws[0]).float()
    best = (float("inf"), "-")
    for bn, bk, warps, stages in GEMV_CONFIGS:
        kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        out = gemv(x, ws[0], **kw).float()
        if float((out - ref).norm() / ref.norm()) > 1e-2:
            continue
        ms = bench(graphed(lambda x=x, ws=ws, kw=kw: [gemv(x, w, **kw) for w in ws]), rep=40)
        best = min(best, (ms, f"BN={bn} BK={bk} w={warps} s={stages}"))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,64,128")
    args = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            cublas = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
            gv, label = best_gemv(x, ws) if m <= MAX_ROWS else (float("nan"), "-")
            gbytes = n * k * 2 / 1e9
            rows.append((name, m, eager, cublas, gbytes / cublas, gv, gbytes / gv, label))
            print(rows[-1])
    head = ("gemm", "M", "eager us", "graph us", "TB/s", "gemv us", "TB/s", "gemv setting")
    print("\n{:<11}{:>4}{:>10}{:>10}{:>7}{:>9}{:>7}  {}".format(*head))
    for name, m, eag, cub, bw, gv, gbw, label in rows:
        print(
            f"{name:<11}{m:>4}{eag * 1e3:>10.1f}{cub * 1e3:>10.1f}{bw:>7.2f}"
            f"{gv * 1e3:>9.1f}{gbw:>7.2f}  {label}"
        )


if __name__ == "__main__":
    main()
