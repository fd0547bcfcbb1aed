"""Decode-step time of the engine on the Higgs v3 4B shape, next to the weight+KV byte floor
of performance.md, for three paths in one run: the torch reference attention eagerly, the
Triton kernel eagerly, and the Triton kernel under FULL CUDA graphs.

    python benchmarks/eager_step.py --ckpt DIR [--batches 1,32,64] [--context 400]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine import Engine, EngineConfig, SamplingParams, VoiceReference

WEIGHT_BYTES = 7.31e9  # read by one audio decode step (performance.md)
KV_BYTES_PER_TOKEN = 147_456
BANDWIDTH = 4.13e12  # measured device-to-device copy on an H200 (performance.md)


def floor_ms(batch: int, context: int) -> float:
    return (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / BANDWIDTH * 1e3


def time_batch(engine: Engine, batch: int, context: int, steps: int) -> float:
    rng = random.Random(batch)
    frames = context - 40  # clone prompt: ~33 text positions + (frames + 7) placeholders
    codes = tuple(tuple(rng.randrange(1024) for _ in range(8)) for _ in range(frames))
    voice = VoiceReference(codes, "a reference transcript")
    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}",
            "Timing the decode step of the engine.",
            reference=voice,
            params=SamplingParams(seed=i, max_rows=steps + 20),
        )
    while (
        any(r.num_computed < len(r.prompt) for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for i in range(batch):
        engine.abort(f"b{batch}-{i}")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        num_kv_blocks=4096,
        enable_prefix_caching=False,
    )
    engine = Engine.from_pretrained(args.ckpt, cfg)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ms = time_batch(engine, b, args.context, args.steps)
        rows.append((b, ms, floor_ms(b, args.context)))
    print(f"\neager decode step, {torch.cuda.get_device_name()}, context ~{args.context}")
    print(f"{'batch':>6} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'audio-s/s':>10}")
    for b, ms, fl in rows:
        print(f"{b:>6} {ms:>9.2f} {fl:>9.2f} {ms / fl:>8.2f} {b / (ms / 1e3) / 25:>10.1f}")


if __name__ == "__main__":
    main()
