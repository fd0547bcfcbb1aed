"""Codec decode time on the GPU at the published codec size (random weights), eager and
replayed from a CUDA graph (as serving runs it): our decoder in fp32 with TF32 convolutions
(the default without codec graphs), with the fused Triton Snake, with cuDNN autotuning, and
in bf16 and fp16 (timed: the served default), for
the shapes streaming uses: (b, 8) first chunks and (b, 33) steady windows (25 new frames).

    python benchmarks/codec_throughput.py [--shapes 1x8,1x33,4x33,64x8,64x33] [--reference]
        [--variants bf16_snake_nhwc,bf16_snake_nhwc_tuned]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.checkpoint_writer import write_codec_dir
from engine.codec.config import STANDARD_CODEC_CONFIG
from engine.codec.loader import build_decoder, build_reference_model, load_codec_state


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn, codes):
    """fn(codes) captured in a CUDA graph (after warm-up on a side stream), as serving runs it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            fn(codes)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        fn(codes)
    return graph.replay


def _time_shape(fn, codes) -> tuple[float, float, float]:
    """(first call ms, eager ms, graph replay ms) of `fn(codes)`. The first call of a shape
    includes cuDNN's timing of its candidates where autotuned: what a server pays for it at
    start-up, per captured shape."""
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(codes)
        torch.cuda.synchronize()
        first = (time.perf_counter() - start) * 1e3
        eager = time_ms(lambda: fn(codes))
    return first, eager, time_ms(graphed(fn, codes))


def in_fresh_thread(fn):
    """`fn()` run in a new thread. cuDNN keeps the algorithm it picked for a convolution in a
    per-thread cache keyed by shape, dtype and layout but not by the benchmark flag: in one
    thread a tuned variant would reuse the heuristic's pick of the untuned variant before it
    (or the reverse), so each variant is timed in a thread of its own, from an empty cache."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def _time_shapes(fn, inputs: dict, shapes: list) -> list[tuple[float, float, float]]:
    """Every shape timed, after one call of a shape not timed (3 frames): the thread's
    library handles and the Triton kernels are made there, so each first-call figure is the
    shape's own cost (with autotuning, cuDNN's timing of it)."""
    with torch.inference_mode():
        fn(torch.zeros(1, 8, 3, dtype=torch.long, device=next(iter(inputs.values())).device))
    return [_time_shape(fn, inputs[s]) for s in shapes]


# name -> (dtype, Triton Snake, NHWC activations, TF32 convolutions, cuDNN autotuning: False,
# True, or how many of its leading candidates to time, biases folded into the Snake passes)
VARIANTS = {
    "fp32+tf32": ("float32", False, False, True, False, True),
    "fp32+tf32 snake": ("float32", True, False, True, False, True),
    "fp32+tf32 snake tuned": ("float32", True, False, True, True, True),
    "bf16 snake tuned": ("bfloat16", True, False, False, True, True),
    # activations in NHWC memory: no layout conversions around cuDNN's convolutions
    "fp32+tf32 snake nhwc": ("float32", True, True, True, False, True),
    "bf16 snake nhwc": ("bfloat16", True, True, False, False, True),
    # the plan's codec_autotune: cuDNN times its algorithms for each shape
    "fp32+tf32 snake nhwc tuned": ("float32", True, True, True, True, True),
    "bf16 snake nhwc tuned": ("bfloat16", True, True, False, True, True),
    # fp16: the tensor cores' rate with three more mantissa bits than bf16
    "fp16 snake nhwc": ("float16", True, True, False, False, True),
    "fp16 snake nhwc tuned": ("float16", True, True, False, True, True),
    # timing only cuDNN's 3 leading candidates (its default: 10): a third of the start-up,
    # if the fast algorithm is among them
    "fp16 snake nhwc tuned3": ("float16", True, True, False, 3, True),
    # as before the folding: cuDNN adds each bias, torch the residuals
    "fp32+tf32 snake nhwc unfolded": ("float32", True, True, True, False, False),
}


def _build(name: str, cfg, state, cuda) -> tuple:
    """(decoder, TF32 convolutions, cuDNN autotuning) of one of VARIANTS."""
    dtype, snake, nhwc, tf32, tuned, fold = VARIANTS[name]
    decoder = build_decoder(cfg, state, cuda, getattr(torch, dtype), snake, nhwc)
    decoder.acoustic_decoder.fold = fold
    return decoder, tf32, tuned


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x8,1x33,4x33,64x8,64x33")
    ap.add_argument("--reference", action="store_true", help="also time transformers' decode")
    ap.add_argument(
        "--variants", help="comma-separated names to run, '_' for a space (default: all)"
    )
    args = ap.parse_args()
    cuda = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, state = load_codec_state(write_codec_dir(Path(tmp), STANDARD_CODEC_CONFIG, 9))
    wanted = args.variants.replace("_", " ").split(",") if args.variants else list(VARIANTS)
    variants = {name: _build(name, cfg, state, cuda) for name in VARIANTS if name in wanted}
    if args.reference:
        ref = build_reference_model(cfg, state, cuda)
        variants["transformers fp32"] = (lambda c: ref.decode(c, return_dict=False), True, False)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    inputs = {(b, t): torch.randint(0, 1024, (b, 8, t), device=cuda) for b, t in shapes}
    timed = {}
    limit = torch.backends.cudnn.benchmark_limit
    for name, (fn, tf32, tuned) in variants.items():
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = bool(tuned)
        # a count (not a bool) limits the candidates cuDNN times
        torch.backends.cudnn.benchmark_limit = limit if isinstance(tuned, bool) else tuned
        timed[name] = in_fresh_thread(lambda fn=fn: _time_shapes(fn, inputs, shapes))
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.benchmark_limit = limit
    rows = []
    for i, (b, frames) in enumerate(shapes):
        keep = frames if frames <= 8 else frames - 8
        for name in variants:
            first, eager, graph = timed[name][i]
            rows.append((name, b, frames, first, eager, graph, b * keep * 0.04 / (graph / 1e3)))
    print(f"\ncodec decode, {torch.cuda.get_device_name()}, median of 20 (first: one call)")
    head = ("variant", "batch", "frames", "first ms", "eager ms", "graph ms", "audio-s/s")
    print("{:<28}{:>6}{:>7}{:>10}{:>10}{:>10}{:>11}".format(*head))
    for name, b, f, first, eager, graph, rate in rows:
        print(f"{name:<28}{b:>6}{f:>7}{first:>10.1f}{eager:>10.2f}{graph:>10.2f}{rate:>11.0f}")


if __name__ == "__main__":
    main()
