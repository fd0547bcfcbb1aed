"""The Higgs v3 layer GEMMs at decode batch sizes through cuBLAS (F.linear): achieved weight
bandwidth against the 4.13 TB/s copy ceiling. One call, one table.

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,64,128")
    args = ap.parse_args()
    print("\n{:<11}{:>5}{:>11}{:>8}".format("gemm", "M", "cublas us", "TB/s"))
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            # four weight copies per call: no L2 reuse between timed calls
            ms = (
                triton.testing.do_bench(
                    lambda x=x, ws=ws: [F.linear(x, w) for w in ws], return_mode="median"
                )
                / 4
            )
            print(f"{name:<11}{m:>5}{ms * 1e3:>11.1f}{n * k * 2 / 1e9 / ms:>8.2f}")


if __name__ == "__main__":
    main()
