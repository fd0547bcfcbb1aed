"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it). Prints achieved weight bandwidth. One
call, one table. (A Triton tensor-core skinny GEMM with split-K and a Triton GEMV for 1-4
rows were measured against these in graphs and were not faster; see docs/PERFORMANCE.md.)

    python benchmarks/gemm_shapes.py [--batches 1,32,64,128]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,64,128")
    args = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            cublas = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
            gbytes = n * k * 2 / 1e9
            rows.append((name, m, eager, cublas, gbytes / eager, gbytes / cublas))
    head = ("gemm", "M", "eager us", "graph us", "eager TB/s", "graph TB/s")
    print("\n{:<11}{:>5}{:>10}{:>10}{:>12}{:>12}".format(*head))
    for name, m, eag, cub, bw1, bw2 in rows:
        print(f"{name:<11}{m:>5}{eag * 1e3:>10.1f}{cub * 1e3:>10.1f}{bw1:>12.2f}{bw2:>12.2f}")


if __name__ == "__main__":
    main()
