"""The Higgs v3 projections with FP8 weights at decode batch sizes, in CUDA graphs: cuBLAS in
bf16 (what the engine runs without quantization), torch._scaled_mm with row-wise scales
(fast accumulation off and on), our few-row GEMM over float8 operands (kernels/skinny_gemm.py,
the engine's tiles with and without TMA, and the best of a small sweep; past 128 rows in
blocks of 128), and the per-row activation quantization launch alone. Achieved weight
bandwidth beside each.

    python benchmarks/fp8_gemm.py [--batches 1,16,32,64,80,96,128] [--sweep]
    python benchmarks/fp8_gemm.py --batches 144,256,272,320,400   # the mixed steps' rows
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemm_shapes import COPIES, SHAPES, bench, graphed  # noqa: E402
from engine.quantization import quantize_weight  # noqa: E402
from kernels.fp8_quant import quantize_rows  # noqa: E402
from kernels.skinny_gemm import MAX_ROWS, skinny_gemm, skinny_tiles  # noqa: E402

SWEEP = [  # (block_n, block_k, num_stages, num_warps, tma)
    (64, 256, 4, 4, True),
    (64, 512, 3, 4, True),
    (128, 256, 3, 8, True),
    (128, 128, 4, 4, True),
    (64, 256, 4, 4, False),
    (64, 512, 3, 4, False),
    (128, 256, 3, 8, False),
    # 32 weight rows a tile: twice the programs, for shapes whose 64-row grid leaves
    # multiprocessors idle (o and down: 40 tiles); below wgmma's 64-row tile, so Triton may
    # fall back to the older mma instruction: measured, not assumed
    (32, 256, 4, 4, True),
    (32, 512, 4, 4, True),
]


def _checked(out, ref, label):
    err = float((out.float() - ref).norm() / ref.norm())
    if err > 1e-2:
        raise AssertionError(f"{label}: rel err {err:.2e}")


def _skinny(x8, xs, ws8, counters, kw, ref, label) -> float:
    w8, wsc = ws8[0]
    out = skinny_gemm(
        x8, w8, counters, weight_scale=wsc, x_scale=xs, out_dtype=torch.bfloat16, **kw
    )
    _checked(out, ref, label)
    scales = dict(x_scale=xs, out_dtype=torch.bfloat16)
    return bench(
        graphed(
            lambda: [skinny_gemm(x8, w, counters, weight_scale=s, **scales, **kw) for w, s in ws8]
        )
    )


def _sweep(x8, xs, ws8, counters, ref, m, n, k) -> tuple[float, str]:
    best = (float("inf"), "")
    for bn, bk, stages, warps, tma in SWEEP:
        auto = skinny_tiles(m, n, k, element_size=1)["split"]
        for split in sorted({max(1, auto // 2), max(1, auto), 2 * max(1, auto)}):
            kw = dict(block_n=bn, block_k=bk, split=split, num_stages=stages, num_warps=warps)
            kw["tma"] = tma
            label = f"BN={bn} BK={bk} s={stages} w={warps} split={split}" + " tma" * tma
            try:
                best = min(best, (_skinny(x8, xs, ws8, counters, kw, ref, label), label))
            except Exception as err:  # a setting that does not fit (shared memory): skipped
                print(f"{label}: {type(err).__name__}: {str(err)[:100]}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,32,64,80,96,128")
    ap.add_argument("--sweep", action="store_true", help="also a small sweep of our tiles")
    args = ap.parse_args()
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    print(f"\nprojections in CUDA graphs, {torch.cuda.get_device_name()} (us; TB/s of weight)")
    head = ("gemm", "M", "bf16", "TB/s", "smm", "TB/s", "smm fast", "ours", "TB/s", "ours tma")
    print("{:<9}{:>5}{:>8}{:>6}{:>8}{:>6}{:>9}{:>8}{:>6}{:>9}{:>9}{:>8}  best".format(
        *head, "best", "quant"), flush=True)  # fmt: skip
    for name, (n, k) in SHAPES.items():
        if name == "audio_head":  # stays bf16
            continue
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        ws8 = [quantize_weight(w) for w in ws]
        for m in (int(b) for b in args.batches.split(",")):
            row = _row(x_of(m, k), ws, ws8, counters, args.sweep)
            bf16, smm, fast, ours, ours_tma, best, quant = row
            print(
                f"{name:<9}{m:>5}{bf16 * 1e3:>8.1f}{2 * n * k / bf16 / 1e9:>6.2f}"
                f"{smm * 1e3:>8.1f}{n * k / smm / 1e9:>6.2f}{fast * 1e3:>9.1f}{ours * 1e3:>8.1f}"
                f"{n * k / ours / 1e9:>6.2f}{ours_tma * 1e3:>9.1f}{best[0] * 1e3:>9.1f}"
                f"{quant * 1e3:>8.1f}  {best[1]}",
                flush=True,
            )
        del ws, ws8


def x_of(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16)


def _row(x, ws, ws8, counters, sweep: bool) -> tuple:
    """(bf16, _scaled_mm, _scaled_mm fast, ours, ours tma, (best, label), quantize) ms."""
    m, (n, k) = x.shape[0], ws[0].shape
    x8, xs = quantize_rows(x)
    ref = F.linear(x8.float() * xs, ws8[0][0].float() * ws8[0][1].t())
    bf16 = bench(graphed(lambda: [F.linear(x, w) for w in ws]))
    scaled = []
    for fast in (False, True):
        kw = dict(out_dtype=torch.bfloat16, use_fast_accum=fast)
        _checked(torch._scaled_mm(x8, ws8[0][0].t(), xs, ws8[0][1], **kw), ref, f"smm {fast}")
        scaled.append(
            bench(graphed(lambda kw=kw: [torch._scaled_mm(x8, w.t(), xs, s, **kw) for w, s in ws8]))
        )
    quant = bench(graphed(lambda: [quantize_rows(x) for _ in range(COPIES)]))
    ours, best = [float("nan")] * 2, (float("nan"), "")
    if m <= MAX_ROWS:
        for i, tma in enumerate((False, True)):
            kw = dict(skinny_tiles(m, n, k, tma, element_size=1), tma=tma)
            ours[i] = _skinny(x8, xs, ws8, counters, kw, ref, f"default tma={tma}")
        if sweep:
            best = _sweep(x8, xs, ws8, counters, ref, m, n, k)
    return (bf16, *scaled, *ours, best, quant)


if __name__ == "__main__":
    main()
