"""Host work of one engine step, by part, on any machine (the embedded default model): C
clone requests decoding together, each part of `step()` timed with wrappers. What is not
compute here is the Python the engine thread spends per step, which a GPU step must hide.

    python benchmarks/host_cost.py --concurrency 256 [--gc-tuned]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import TEXTS, reference_wav  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402

PARTS = [  # (owner attribute path, method, label, is host work)
    ("scheduler", "schedule", "schedule", True),
    ("runner", "_prepare", "prepare inputs", True),
    ("scheduler", "on_chunk_done", "on_chunk_done", True),
    ("", "_append_rows", "append rows", True),
    ("", "_output", "events", True),
    ("runner", "forward", "forward (compute)", False),
    ("runner", "sample", "sampler (compute)", False),
    ("", "_decode_audio", "audio windows + codec", False),
    ("codec.chunks", "_decode_batch", "codec (compute)", False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--gc-tuned", action="store_true", help="as the server: gc.freeze etc.")
    args = ap.parse_args()
    c = args.concurrency
    engine = Engine.from_pretrained(
        None, EngineConfig(max_num_seqs=c, max_num_batched_tokens=max(512, c))
    )
    reference = engine.encode_reference(reference_wav(4.0), "A reference sentence.")
    if args.gc_tuned:
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
    spent: collections.Counter = collections.Counter()
    for path, name, label, _ in PARTS:
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr)
        original = getattr(owner, name)

        def timed(*a, _original=original, _label=label, **k):
            t = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t

        setattr(owner, name, timed)
    counter = iter(range(10**9))

    def add() -> None:
        i = next(counter)
        params = SamplingParams(seed=i, max_rows=150 + i % 50)  # staggered finishes
        engine.add_request(f"r{i}", TEXTS[i % len(TEXTS)], reference=reference, params=params)

    for _ in range(c):
        add()
    for step in range(20 + args.steps):
        if step == 20:
            spent.clear()
        for out in engine.step():
            if out.finished:
                add()
    print(f"\nC = {c}, per step over {args.steps} steps (gc tuned: {args.gc_tuned})")
    host = 0.0
    for _, _, label, is_host in PARTS:
        ms = spent[label] / args.steps * 1e3
        host += ms if is_host else 0.0
        print(f"{label:<24}{ms:>9.3f} ms{'' if is_host else '   (compute on this device)'}")
    print(f"{'host work (sum)':<24}{host:>9.3f} ms")


if __name__ == "__main__":
    main()
