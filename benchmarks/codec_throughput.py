"""Codec decode time on the GPU at the published codec size (random weights): our decoder in
fp32 (with and without TF32 convolutions) and bf16, next to transformers' decode, for the
shapes streaming uses: (b, 8) first chunks and (b, 33) steady windows.

    python benchmarks/codec_throughput.py [--batches 1,32,64]
"""

from __future__ import annotations

import argparse
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,64")
    args = ap.parse_args()
    cuda = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, state = load_codec_state(write_codec_dir(Path(tmp), STANDARD_CODEC_CONFIG, 9))
    ref = build_reference_model(cfg, state, cuda)
    variants = {
        "ours fp32": (build_decoder(cfg, state, cuda, torch.float32), False),
        "ours fp32+tf32": (build_decoder(cfg, state, cuda, torch.float32), True),
        "ours bf16": (build_decoder(cfg, state, cuda, torch.bfloat16), False),
        "transformers fp32": (lambda c: ref.decode(c, return_dict=False), False),
    }
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for frames, keep in ((8, 8), (33, 25)):
            codes = torch.randint(0, 1024, (b, 8, frames), device=cuda)
            for name, (fn, tf32) in variants.items():
                torch.backends.cudnn.allow_tf32 = tf32
                with torch.inference_mode():
                    ms = time_ms(lambda fn=fn, codes=codes: fn(codes))
                rows.append((name, b, frames, ms, b * keep * 0.04 / (ms / 1e3)))
    torch.backends.cudnn.allow_tf32 = True
    print(f"\ncodec decode, {torch.cuda.get_device_name()}, median of 20")
    print(f"{'variant':<20}{'batch':>6}{'frames':>7}{'ms':>9}{'audio-s/s':>11}")
    for name, b, f, ms, rate in rows:
        print(f"{name:<20}{b:>6}{f:>7}{ms:>9.2f}{rate:>11.0f}")


if __name__ == "__main__":
    main()
