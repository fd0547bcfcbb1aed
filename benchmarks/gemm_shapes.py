"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) against our Triton skinny
GEMM in several tile configurations; prints achieved weight bandwidth. One call, one table.

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
CONFIGS = [
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (64, 256, 3, 4),
    (128, 128, 4, 8),
    (32, 256, 4, 4),
    (64, 64, 6, 4),
]


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
            cublas = bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            best = (float("inf"), "-")
            for cfg in CONFIGS:
                out = skinny_gemm(x, ws[0], *cfg).float()
                if float((out - ref).norm() / ref.norm()) > 1e-2:
                    continue  # a wrong result is never a candidate
                ms = bench(lambda x=x, ws=ws, cfg=cfg: [skinny_gemm(x, w, *cfg) for w in ws])
                best = min(best, (ms, str(cfg)))
            gbytes = n * k * 2 / 1e9
            rows.append((name, m, cublas, best[0], best[1], gbytes / cublas, gbytes / best[0]))
    head = (
        "gemm",
        "M",
        "cublas us",
        "triton us",
        "best (BN,BK,stg,wrp)",
        "cublas TB/s",
        "triton TB/s",
    )
    print("\n{:<11}{:>5}{:>11}{:>11}  {:<22}{:>12}{:>12}".format(*head))
    for name, m, cub, tri, cfg, bw1, bw2 in rows:
        line = (name, m, cub * 1e3, tri * 1e3, cfg, bw1, bw2)
        print("{:<11}{:>5}{:>11.1f}{:>11.1f}  {:<22}{:>12.2f}{:>12.2f}".format(*line))


if __name__ == "__main__":
    main()
