"""KV-cache store per layer call at decode and prefill token counts: the torch reference
(`index_copy_`, V made contiguous first) against the fused Triton store, both replayed from CUDA
graphs of 36 calls (one step's layers). One table.

    python benchmarks/kv_store.py
"""

from __future__ import annotations

import torch
import triton.testing

from engine.attention import store_kv
from kernels.kv_store import store_kv_fused

LAYERS, HKV, D, BLOCK = 36, 8, 128, 16


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    return graph.replay


def main() -> None:
    cache = torch.zeros(2, 4096, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    print(f"\n{'tokens':>7}{'torch us':>10}{'fused us':>10}{'saved per step us':>19}")
    for t in (1, 64, 256, 512):
        qkv = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = qkv[:, 5120:].view(t, HKV, D)
        slots = torch.randperm(4095 * BLOCK, device="cuda")[:t] + BLOCK
        args = (k, v, cache, slots)
        ref = triton.testing.do_bench(graphed(lambda a=args: store_kv(*a))) / LAYERS
        ours = triton.testing.do_bench(graphed(lambda a=args: store_kv_fused(*a))) / LAYERS
        saved = (ref - ours) * LAYERS * 1e3
        print(f"{t:>7}{ref * 1e3:>10.2f}{ours * 1e3:>10.2f}{saved:>19.1f}")


if __name__ == "__main__":
    main()
