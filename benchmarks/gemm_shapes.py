"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it), and in graphs two other ways of asking
for the same product: the weight stored transposed (`x @ W^T` as an NN GEMM, other kernels)
and cuBLASLt instead of cuBLAS (`torch.backends.cuda.preferred_blas_library`). Prints
achieved weight bandwidth. One call, one table. (A Triton tensor-core skinny GEMM with
split-K and a Triton GEMV for 1-4 rows were measured against these in graphs and were not
faster; see docs/PERFORMANCE.md.)

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
    ap.add_argument(
        "--tunable",
        action="store_true",
        help="also PyTorch TunableOp",
    )
    args = ap.parse_args()
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
            tuned = _tuned(x, ws) if args.tunable else float("nan")
            rows.append((name, m, n * k * 2 / 1e9, eager, cublas, nn, lt, tuned))
        del ws, wts
    head = ("gemm", "M", "eager us", "graph us", "TB/s", "NN us", "TB/s", "Lt us", "TB/s")
    print(
        "\n{:<11}{:>5}{:>10}{:>10}{:>6}{:>8}{:>6}{:>8}{:>6}{:>10}{:>6}".format(
            *head, "tuned us", "TB/s"
        )
    )
    for name, m, gb, eag, cub, nn, lt, tu in rows:
        print(
            f"{name:<11}{m:>5}{eag * 1e3:>10.1f}{cub * 1e3:>10.1f}{gb / cub:>6.2f}"
            f"{nn * 1e3:>8.1f}{gb / nn:>6.2f}{lt * 1e3:>8.1f}{gb / lt:>6.2f}"
            f"{tu * 1e3:>10.1f}{gb / tu:>6.2f}"
        )


def _tuned(x, ws) -> float:
    """F.linear through PyTorch's TunableOp: every candidate GEMM implementation timed at
    this shape on the first call, the fastest kept; then graphed and timed as the others."""
    from torch.cuda import tunable

    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(200)
    try:
        F.linear(x, ws[0])  # tunes this shape (all copies share it)
        tunable.tuning_enable(False)
        return bench(graphed(lambda: [F.linear(x, w) for w in ws]))
    except RuntimeError as err:
        print(f"TunableOp failed at {tuple(x.shape)} x {tuple(ws[0].shape)}: {err}")
        return float("nan")
    finally:
        tunable.enable(False)


if __name__ == "__main__":
    main()
