"""Which row counts torch's row-wise scaled fp8 matmul survives on this GPU: `torch._scaled_mm`
over the Higgs projection shapes (float8 rows and weights, fp32 row-wise scales, bf16 out)
for every M from --lo to --hi, eagerly or (--graph) captured and replayed in a CUDA graph,
synchronising after each and printing each shape before it runs, so a fault that kills the
process names the first M it happened at. The engine pads to `engine.quantization
.scaled_mm_rows`; this measures the unpadded call.

    python benchmarks/scaled_mm_probe.py [--graph] [--lo 65] [--hi 1024] [--step 1]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


def _scaled_mm(x, w_t, x_scale, w_scale):
    return torch._scaled_mm(x, w_t, x_scale, w_scale, out_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", action="store_true", help="capture and replay each call")
    ap.add_argument("--lo", type=int, default=65)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--step", type=int, default=1)
    args = ap.parse_args()
    fp8 = torch.float8_e4m3fn
    weights = {
        name: (
            (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(fp8),
            torch.rand(1, n, device="cuda"),
        )
        for name, (n, k) in SHAPES.items()
    }
    stream = torch.cuda.Stream()
    for m in range(args.lo, args.hi + 1, args.step):
        for name, (w, w_scale) in weights.items():
            k = w.shape[1]
            x = (torch.randn(m, k, device="cuda") * 100).clamp(-448, 448).to(fp8)
            x_scale = torch.rand(m, 1, device="cuda")
            print(f"{'graph' if args.graph else 'eager'} M={m} {name}", flush=True)

            operands = (x, w.t(), x_scale, w_scale)
            if args.graph:
                with torch.cuda.stream(stream):
                    _scaled_mm(*operands)  # warm-up outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        _scaled_mm(*operands)
                    graph.replay()
            else:
                _scaled_mm(*operands)
            torch.cuda.synchronize()
    print(
        f"{'graph' if args.graph else 'eager'}: every M in [{args.lo}, {args.hi}] ran", flush=True
    )


if __name__ == "__main__":
    main()
