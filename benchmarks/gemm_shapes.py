"""The Higgs v3 layer GEMMs at decode batch sizes: cuBLAS (F.linear) called eagerly and
replayed from a CUDA graph (as the engine runs it), and in graphs two other ways of asking
for the same product: the weight stored transposed (`x @ W^T` as an NN GEMM, other kernels)
and cuBLASLt instead of cuBLAS (`torch.backends.cuda.preferred_blas_library`). Prints
achieved weight bandwidth. `--tunable` adds PyTorch's TunableOp, `--ours` our split-K GEMM
(kernels/skinny_gemm.py) at its default tiles and the best of a small sweep, in graphs.

    python benchmarks/gemm_shapes.py [--batches 1,32,64,128] [--ours] [--tunable]
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
    ap.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    ap.add_argument(
        "--ours", action="store_true", help="also our split-K GEMM (kernels/skinny_gemm.py)"
    )
    ap.add_argument(
        "--tunable",
        action="store_true",
        help="also PyTorch TunableOp",
    )
    args = ap.parse_args()
    rows, ours = [], []
    for name, (n, k) in SHAPES.items():
        if args.shapes and name not in args.shapes.split(","):
            continue
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
            if args.ours and m <= 64:
                ours.append((name, m, n * k * 2 / 1e9, cublas, *_ours(x, ws)))
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
    if ours:
        print("\nour split-K GEMM in graphs (default: the engine's TMA tiles; best of the sweep)")
        fmt = "{:<11}{:>5}{:>10}{:>12}{:>6}{:>9}{:>6}  {}"
        print(fmt.format("gemm", "M", "cuBLAS us", "default us", "TB/s", "best us", "TB/s", "best"))
        for name, m, gb, cub, default, best, label in ours:
            print(
                f"{name:<11}{m:>5}{cub * 1e3:>10.1f}{default * 1e3:>12.1f}{gb / default:>6.2f}"
                f"{best * 1e3:>9.1f}{gb / best:>6.2f}  {label}"
            )


SWEEP = [  # (block_n, block_k, num_stages, num_warps, tma)
    (64, 128, 4, 4, False),
    (64, 256, 3, 4, False),
    (128, 128, 4, 4, False),
    (128, 64, 6, 4, False),
    (32, 256, 4, 4, False),
    (64, 128, 6, 8, False),
    (64, 256, 4, 4, False),
    (64, 128, 4, 4, True),  # tiles fetched by the copy engine (TMA descriptors)
    (128, 128, 4, 4, True),
    (128, 64, 6, 4, True),
    (64, 64, 8, 4, True),
    (128, 128, 3, 8, True),
    (64, 256, 3, 4, True),  # the engine's per-thread tiles for wide outputs, through TMA
    (64, 256, 4, 4, True),
    (32, 256, 6, 4, True),
    (128, 256, 2, 8, True),
    (64, 128, 6, 4, True),
]


def _ours(x, ws) -> tuple[float, float, str]:
    """(default ms, best ms, best label) of kernels/skinny_gemm.py for this shape, checked
    against F.linear; the sweep: SWEEP x splits (the default's count, half, double)."""
    from kernels.skinny_gemm import skinny_gemm, skinny_tiles

    m, (n, k) = x.shape[0], ws[0].shape
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    ref = F.linear(x.float(), ws[0].float())

    def timed(kw) -> float:
        out = skinny_gemm(x, ws[0], counters, **kw)
        err = float((out.float() - ref).norm() / ref.norm())
        if err > 1e-2:
            raise AssertionError(f"skinny_gemm {kw}: rel err {err:.2e}")
        return bench(graphed(lambda: [skinny_gemm(x, w, counters, **kw) for w in ws]))

    default = dict(skinny_tiles(m, n, k, tma=True), tma=True)  # the engine's default on the H200
    results = []
    for bn, bk, stages, warps, tma in SWEEP:
        auto = skinny_tiles(m, n, k)["split"] * 64 // bn  # the same programs per SM
        for split in sorted({max(1, auto // 2), max(1, auto), 2 * max(1, auto)}):
            kw = dict(block_n=bn, block_k=bk, split=split, num_stages=stages, num_warps=warps)
            kw["tma"] = tma
            label = f"BN={bn} BK={bk} s={stages} w={warps} split={split}" + " tma" * tma
            try:
                results.append((timed(kw), label))
            except Exception as err:  # a setting that does not fit (shared memory): skipped
                print(f"{label}: {type(err).__name__}: {str(err)[:120]}")
    best = min(results)
    return timed(default), best[0], best[1]


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
