"""Whether CUDA graphs replaying at once on two streams corrupt or stall each other through a
shared cuBLAS workspace: a step's projections at 512 rows (fp8 or bf16) on the engine's
stream beside the codec's 8 x 33 graph on the codec's, captured on one stream (`shared`) or
two (`separate`, as the engine now does; engine/cuda_graphs.py: capture_graph). Counts
outputs that differ from solo replays, and stalls (then prints what it has and exits).
`solo` replays the backbone alone, so a count there is the GEMMs' own run-to-run variation
(not a race), the floor the other modes are read against.

    python benchmarks/workspace_race_probe.py [--iters 200] [--modes solo,separate,shared]
        [--codec fp16]

The codec is the served one by default (fp16, cuDNN's algorithms timed at capture);
`--codec fp32` is the untimed fp32 codec these races were first found with.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint_writer import write_codec_dir  # noqa: E402
from engine.codec.codec_graphs import CodecGraphs, batch_ladder  # noqa: E402
from engine.codec.config import STANDARD_CODEC_CONFIG  # noqa: E402
from engine.codec.loader import build_decoder, load_codec_state  # noqa: E402
from engine.cuda_graphs import capture_graph  # noqa: E402
from engine.quantization import Fp8Linear, quantize_rows, quantize_weight, scaled_matmul  # noqa: E402

# the Higgs v3 decoder layer's projections (out, in) and a full step's token count
SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]
ROWS = 512


def backbone_fn(dtype: str, device):
    """A step's projections, one after another, as one callable (its static output: the
    last projection's `[ROWS, N]`, which depends on every earlier one)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    weights = [
        torch.randn(n, k, generator=gen).mul(0.02).to(device, torch.bfloat16) for n, k in SHAPES
    ]
    x = torch.randn(ROWS, SHAPES[0][1], generator=gen).to(device, torch.bfloat16)
    if dtype == "fp8":
        layers = [Fp8Linear(*quantize_weight(w)) for w in weights]

        def run():
            h = x
            for layer, (_, k) in zip(layers, SHAPES, strict=True):
                h = scaled_matmul(quantize_rows(_fit(h, k)), layer, torch.bfloat16)
            return h

    else:

        def run():
            h = x
            for w, (_, k) in zip(weights, SHAPES, strict=True):
                h = F.linear(_fit(h, k), w)
            return h

    return run


def _fit(h: torch.Tensor, k: int) -> torch.Tensor:
    """`h` cut or tiled to `k` columns (the next projection's input width)."""
    if h.shape[1] >= k:
        return h[:, :k].contiguous()
    return h.repeat(1, -(-k // h.shape[1]))[:, :k].contiguous()


def build(mode: str, backbone: str, device, codec: str = "fp16"):
    """(backbone graph, its output, codec graphs, codec codes, codec stream). `codec`: fp16
    with timed algorithms (as served by default) or fp32 untimed."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, state = load_codec_state(write_codec_dir(Path(tmp), STANDARD_CODEC_CONFIG, 9))
    timed = codec == "fp16"
    dtype = torch.float16 if timed else torch.float32
    decoder = build_decoder(cfg, state, device, dtype, True, True)
    codec_stream = torch.cuda.Stream(device)
    graphs = CodecGraphs(decoder, max_batch=8, ladder=batch_ladder(8) if timed else None)
    with torch.inference_mode():
        graphs.capture(autotune=timed, stream=codec_stream if mode == "separate" else None)
        graph, out = capture_graph(backbone_fn(backbone, device))
    codes = torch.randint(0, 1024, (8, 8, 33), device=device)
    return graph, out, graphs, codes, codec_stream


def race(
    graph, out, codec, codes, codec_stream, iters: int, stall_s: float, with_codec: bool = True
) -> dict:
    """Replays both concurrently `iters` times against their solo references (the backbone
    alone where not `with_codec`). `backbone_diff`: the largest absolute difference seen;
    `first_diff`: the backbone's first replay against its second (on the H100, session 20,
    bf16 replays differed from the first by up to 36 on outputs of at most ~13, every one)."""
    main = torch.cuda.current_stream()
    with torch.inference_mode():
        torch.cuda.synchronize()  # the codes are written; nothing else runs
        graph.replay()
        first = out.clone()
        graph.replay()  # the reference is the second replay: the first may differ (bf16)
        ref_backbone = out.clone()
        torch.cuda.synchronize()  # each reference alone on the GPU
        with torch.cuda.stream(codec_stream):
            ref_codec = codec.run(codes).clone()
        torch.cuda.synchronize()
        result = {"iters": 0, "backbone_bad": 0, "codec_bad": 0, "backbone_diff": 0.0}
        result |= {"max_ms": 0.0, "stalled": False}
        result["first_diff"] = (first.float() - ref_backbone.float()).abs().max().item()
        for _ in range(iters):
            start = time.perf_counter()
            codec_stream.wait_stream(main)
            graph.replay()  # the engine's stream
            with torch.cuda.stream(codec_stream):
                audio = codec.run(codes) if with_codec else ref_codec
            done = torch.cuda.Event()
            done.record(codec_stream)
            main.wait_event(done)
            finished = torch.cuda.Event()
            finished.record(main)
            while not finished.query():
                if time.perf_counter() - start > stall_s:
                    result["stalled"] = True
                    return result
                time.sleep(0.0005)
            result["max_ms"] = max(result["max_ms"], (time.perf_counter() - start) * 1e3)
            result["iters"] += 1
            result["backbone_bad"] += int(not torch.equal(out, ref_backbone))
            diff = (out.float() - ref_backbone.float()).abs().max().item()
            result["backbone_diff"] = max(result["backbone_diff"], diff)
            result["codec_bad"] += int(not torch.equal(audio, ref_codec))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    # separate first: a stall in `shared` ends the probe, and the comparison needs both
    ap.add_argument("--modes", default="solo,separate,shared")
    ap.add_argument("--backbone", default="fp8,bf16")
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--codec", choices=("fp16", "fp32"), default="fp16")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for mode in args.modes.split(","):  # every backbone's `separate` before any `shared`
        for backbone in args.backbone.split(","):
            graphs = build("separate" if mode == "solo" else mode, backbone, device, args.codec)
            r = race(*graphs, args.iters, args.stall_s, with_codec=mode != "solo")
            rows.append((backbone, mode, r))
            print(f"{backbone} {mode}: {r}", flush=True)
            if r["stalled"]:
                break
        if rows and rows[-1][2]["stalled"]:
            break
    name = torch.cuda.get_device_name()
    print(f"\nconcurrent graph replays, {name}, {ROWS} rows, {args.codec} codec 8x33")
    head = ("backbone", "capture", "iters", "backbone bad", "max diff", "1st diff", "codec bad")
    print("{:<9}{:<10}{:>6}{:>14}{:>10}{:>10}{:>11}   max ms  stalled".format(*head))
    for backbone, mode, r in rows:
        print(
            f"{backbone:<9}{mode:<10}{r['iters']:>6}{r['backbone_bad']:>14}"
            f"{r['backbone_diff']:>10.2e}{r['first_diff']:>10.2e}{r['codec_bad']:>11}"
            f"{r['max_ms']:>9.2f}  {'STALL' if r['stalled'] else 'no'}"
        )
    sys.stdout.flush()
    os._exit(0)  # a stalled GPU would keep the interpreter from exiting


if __name__ == "__main__":
    main()
