"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it), against our Triton skinny GEMM
(`kernels/skinny_gemm.py`) in graphs over several tile / split-K settings. Prints achieved
weight bandwidth. One call, one table.

    python benchmarks/gemm_shapes.py [--batches 1,32,64,128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from kernels.skinny_gemm import skinny_gemm

SHAPES = {
    "qkv": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "audio_head": (8208, 2560),
}
# (block_n, block_k, split_k, num_stages, num_warps)
CONFIGS = [
    (64, 128, 1, 4, 4),
    (128, 128, 1, 4, 4),
    (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 4),
    (32, 128, 4, 4, 4),
    (64, 256, 2, 3, 4),
    (128, 64, 2, 5, 4),
    (64, 64, 4, 6, 4),
]


def graphed(fn):
    """fn captured in a CUDA graph (after two warm-up calls); returns the replay."""
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(fn) -> float:
    """Median milliseconds of one call (fn runs 4 calls over 4 weight copies: no L2 reuse)."""
    return triton.testing.do_bench(fn, return_mode="median") / 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,64,128")
    args = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            eager = bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            cublas = bench(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
            best = (float("inf"), "-")
            for cfg in CONFIGS:
                out = skinny_gemm(x, ws[0], *cfg).float()
                if float((out - ref).norm() / ref.norm()) > 1e-2:
                    print(f"{name} M={m} {cfg}: wrong result, skipped")
                    continue
                ms = bench(
                    graphed(lambda x=x, ws=ws, cfg=cfg: [skinny_gemm(x, w, *cfg) for w in ws])
                )
                best = min(best, (ms, str(cfg)))
            gbytes = n * k * 2 / 1e9
            rows.append(
                (name, m, eager, cublas, best[0], best[1], gbytes / cublas, gbytes / best[0])
            )
    head = (
        "gemm",
        "M",
        "eager us",
        "graph us",
        "triton us",
        "best (BN,BK,SK,stg,wrp)",
        "cublas TB/s",
        "triton TB/s",
    )
    print("\n{:<11}{:>5}{:>10}{:>10}{:>10}  {:<24}{:>12}{:>12}".format(*head))
    for name, m, eag, cub, tri, cfg, bw1, bw2 in rows:
        print(
            f"{name:<11}{m:>5}{eag * 1e3:>10.1f}{cub * 1e3:>10.1f}{tri * 1e3:>10.1f}  {cfg:<24}"
            f"{bw1:>12.2f}{bw2:>12.2f}"
        )


if __name__ == "__main__":
    main()
