"""The decode step's biggest kernels, each launched once inside a profiler range, for Nsight
Compute (hardware counters: DRAM throughput, occupancy, warp stall reasons): the fused
one-pass decode attention at 64 x 400 (the engine's batch-64 launch), the same kernel
without its prologue and with its page ids read a tile ahead, and cuBLAS for the four layer
GEMMs at 1 and 64 rows. Warm-up runs outside the range, so only the listed launches are
profiled.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/ncu_targets.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.attention_shapes import make
from engine.model import RotaryEmbedding
from kernels.paged_attention import paged_attention, paged_decode_attention_fused

GEMMS = {
    "qkv": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=399)
    ap.add_argument("--gemm-rows", default="1,64")
    args = ap.parse_args()
    (q, k, v, qsl, lens, tables), _ = make([1] * args.batch, [args.context] * args.batch)
    page = k.shape[1]
    ctx = [args.context] * args.batch
    positions = torch.tensor(ctx, device="cuda")
    rows = torch.arange(args.batch, device="cuda")
    slots = tables[rows, positions // page].long() * page + positions % page
    qkv = torch.randn(args.batch, 48 * 128, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    rope = RotaryEmbedding(128, 1e6, 4096).to("cuda")
    norm = (weight, weight, rope.cos, rope.sin, positions, 32, 8, 1e-6)
    index = (qsl, lens, tables)
    launches = [
        (
            "fused decode",
            lambda: paged_decode_attention_fused(qkv, *norm, k, v, slots, *index, 128**-0.5),
        ),
        ("attention only", lambda: paged_attention(q, k, v, *index, 128**-0.5, 1)),
        (
            "fused decode, page ids a tile ahead",
            lambda: paged_decode_attention_fused(
                qkv, *norm, k, v, slots, *index, 128**-0.5, prefetch_pages=True
            ),
        ),
    ]
    for name, (n, kk) in GEMMS.items():
        w = torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (int(r) for r in args.gemm_rows.split(",")):
            x = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
            launches.append((f"{name} M={m}", lambda x=x, w=w: F.linear(x, w)))
    for _, fn in launches:  # compile and warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in launches:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(name for name, _ in launches))


if __name__ == "__main__":
    main()
