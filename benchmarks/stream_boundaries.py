"""How much streamed audio differs from decoding the whole utterance at once, around each
chunk boundary and away from them (spec section 6: 8 frames of left context, no holdback).

    python benchmarks/stream_boundaries.py [--codec DIR] [--audio WAV] [--frames 200]

Without --codec, the tiny random codec is written to a temp dir, its decoder weights redrawn
at std 0.6/sqrt(fan_in) as in tests/engine/test_streaming.py (--hf-init keeps transformers'
init, whose audio hardly depends on the codes). Codes are random unless --audio is encoded.
Differences are relative to the RMS of the whole decode; "near" is +-960 samples of a boundary.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from engine.checkpoint_writer import write_codec_dir
from engine.codec.audio_io import AudioLimits
from engine.codec.codec import Codec
from engine.codec.config import TINY_CODEC_CONFIG
from engine.config import EOC, StreamConfig
from engine.prompt import delay_rows
from engine.streaming import AudioStream

HOP = 960


def tiny_codec_dir(directory: Path, hf_init: bool) -> Path:
    return write_codec_dir(
        directory, TINY_CODEC_CONFIG, seed=1, decoder_std=None if hf_init else 0.6
    )


def stats(diff: torch.Tensor) -> tuple[float, float]:
    if diff.numel() == 0:
        return float("nan"), float("nan")
    return diff.abs().max().item(), diff.pow(2).mean().sqrt().item()


def streamed_and_whole(codec: Codec, frames: list, cfg: StreamConfig):
    """(windows, streamed float audio, whole-utterance audio), both [frames * 960] on the CPU.
    The utterance ends with EOC at row len(frames), fed row by row as the engine does."""
    rows = delay_rows([*frames, (EOC, *frames[-1][1:])])
    stream = AudioStream("bench", cfg)
    last = len(rows) - 1
    windows = [w for i in range(len(rows)) if (w := stream.next_window(rows[: i + 1], i == last))]
    parts = []
    for w in windows:
        if w.num_frames:
            audio = codec.decode(torch.from_numpy(w.codes[None]))[0].cpu()
            parts.append(audio[w.context * HOP : (w.context + w.num_frames) * HOP])
    whole = codec.decode(torch.tensor(frames).T[None])[0].cpu()
    return windows, torch.cat(parts), whole


def report(windows, streamed: torch.Tensor, whole: torch.Tensor) -> None:
    n = len(whole) // HOP
    rms = whole.pow(2).mean().sqrt().item()
    diff = (streamed - whole) / rms
    boundaries = [w.end for w in windows[:-1] if 0 < w.end < n]
    near = torch.zeros(n * HOP, dtype=torch.bool)
    for b in boundaries:
        near[max(0, (b - 1) * HOP) : (b + 1) * HOP] = True
    per_frame = diff.abs().view(n, HOP).max(1).values
    print(f"{n} frames, {len(windows)} chunks, signal rms {rms:.4g}; |diff| / rms")
    print("max by frame offset from a boundary (over all boundaries):")
    for k in range(-12, 4):
        vals = [per_frame[b + k].item() for b in boundaries if 0 <= b + k < n]
        print(f"  {k:+3d}: {max(vals):.2e}" if vals else f"  {k:+3d}: -")

    print(f"\n{'boundary':>8} {'near max':>10} {'near rms':>10} {'away max':>10} {'away rms':>10}")
    starts = [w.start for w in windows if w.num_frames]
    for b in boundaries:
        body = torch.zeros_like(near)
        body[max(s for s in starts if s < b) * HOP : b * HOP] = True  # the chunk ending at b
        nm, nr = stats(diff[max(0, (b - 1) * HOP) : (b + 1) * HOP])
        am, ar = stats(diff[body & ~near])
        print(f"{b:>8} {nm:>10.2e} {nr:>10.2e} {am:>10.2e} {ar:>10.2e}")
    (nm, nr), (am, ar) = stats(diff[near]), stats(diff[~near])
    print(f"{'all':>8} {nm:>10.2e} {nr:>10.2e} {am:>10.2e} {ar:>10.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", type=Path, help="tokenizer dir or v3 checkpoint (default: tiny)")
    ap.add_argument("--hf-init", action="store_true", help="tiny codec: keep transformers' init")
    ap.add_argument("--audio", type=Path, help="encode this file for the codes (needs encoder)")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=8)
    ap.add_argument("--holdback", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.codec or tiny_codec_dir(Path(tmp) / "codec", args.hf_init)
        codec = Codec.load(path, torch.device(args.device), 1 << 26)
    if args.audio:
        frames = list(codec.encode_file(args.audio.read_bytes(), AudioLimits())[0])
    else:
        rng = random.Random(args.seed)
        frames = [tuple(rng.randrange(1024) for _ in range(8)) for _ in range(args.frames)]
    cfg = StreamConfig(left_context_frames=args.context, holdback_frames=args.holdback)
    print(f"codec {path}")
    report(*streamed_and_whole(codec, frames, cfg))


if __name__ == "__main__":
    main()
