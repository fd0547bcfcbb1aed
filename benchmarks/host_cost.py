"""Host work of one engine step, by part, on any machine (the embedded default model, or
`--model` such as the full-size checkpoint on a GPU): C clone requests decoding together
(closed loop, audio on), each part of `step()` timed with wrappers. On a GPU "wait for rows"
is the engine thread idle for the GPU: near zero means the step is host-bound. With
`--simulate MS` the GPU work is replaced by waits (benchmarks/sim_server.py), so any machine
times the host work alone; the engine emits finishes and audio only, as served.

    python benchmarks/host_cost.py --concurrency 256 [--gc-tuned] [--model DIR] [--simulate 0]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import TEXTS  # noqa: E402
from benchmarks.voice_pool import reference_wav  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.codec.chunk_decoder import PendingChunks  # noqa: E402
from engine.cuda_graphs import CapturedGraph, CapturedSampler  # noqa: E402
from engine.engine import default_device  # noqa: E402
from engine.runner import PendingStep  # noqa: E402

# (owner: attribute path from the engine, or a class; method; label; kind). Kinds: "host" is
# Python work of the engine thread, "launch" queues GPU work (host time, GPU runs later),
# "wait" is the engine thread waiting for the GPU, "inner" is part of another row.
PARTS = [
    ("scheduler", "schedule", "schedule", "host"),
    ("runner", "_prepare", "prepare inputs", "inner"),
    ("runner", "launch", "launch step (prep + queue)", "launch"),
    ("runner", "forward", "eager forward", "inner"),
    (CapturedGraph, "replay", "backbone graph launch", "inner"),
    (CapturedSampler, "replay", "sampler graph launch", "inner"),
    ("scheduler", "on_launched", "on_launched", "host"),
    (PendingStep, "result", "wait for rows", "wait"),
    ("", "_append_rows", "append rows", "host"),
    ("audio", "submit", "audio windows + codec launch", "host"),
    ("codec.chunks", "_launch_batch", "codec launch (compute on CPU)", "inner"),
    ("audio", "collect", "read codec audio", "host"),
    (PendingChunks, "result", "wait for codec", "inner"),
    ("", "_output", "events", "host"),
]


def _owner(engine, path):
    if isinstance(path, type):
        return path
    owner = engine
    for attr in filter(None, path.split(".")):
        owner = getattr(owner, attr)
    return owner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--gc-tuned", action="store_true", help="as the server: gc.freeze etc.")
    ap.add_argument("--model", help="checkpoint dir (default: the embedded default model)")
    ap.add_argument("--max-num-seqs", type=int, help="default: the concurrency")
    ap.add_argument("--cprofile", help="write cProfile's top functions of the timed steps here")
    ap.add_argument(
        "--simulate",
        metavar="STEP_MS",
        type=float,
        help="replace the GPU work by waits of STEP_MS a step and none for the codec "
        "(benchmarks/sim_server.py): the host work alone, on any machine",
    )
    args = ap.parse_args()
    c = args.concurrency
    engine = Engine.from_pretrained(
        args.model,
        EngineConfig(
            device=default_device(),
            max_num_seqs=args.max_num_seqs or c,
            max_num_batched_tokens=max(512, c),
            row_events=False,  # as the service configures its engine
        ),
    )
    if args.simulate is not None:
        from benchmarks.sim_server import simulate

        simulate(engine, args.simulate, 0.0, 0.0)
    reference = engine.encode_reference(reference_wav(4.0), "A reference sentence.")
    if args.gc_tuned:
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
    spent: collections.Counter = collections.Counter()
    for path, name, label, _ in PARTS:
        owner = _owner(engine, path)
        if owner is None:
            continue  # e.g. no codec
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
    rows, profiler = 0, None
    for step in range(20 + args.steps):
        if step == 20:
            spent.clear()
            if args.cprofile:
                profiler = cProfile.Profile()
                profiler.enable()
            rows, t0 = engine.stats.num_rows_generated, time.perf_counter()
            cpu0 = time.thread_time()
        for out in engine.step():
            if out.finished:
                add()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    cpu = (time.thread_time() - cpu0) / args.steps * 1e3
    rows = engine.stats.num_rows_generated - rows
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(150)
        Path(args.cprofile).write_text(text.getvalue())
    print(
        f"\nC = {c}, {engine.runner.device}, per step over {args.steps} steps "
        f"(gc tuned: {args.gc_tuned}): {wall:.3f} ms a step ({cpu:.3f} ms of the thread's "
        f"CPU), {rows / args.steps:.1f} rows"
    )
    outer = 0.0
    for _, _, label, kind in PARTS:
        ms = spent[label] / args.steps * 1e3
        outer += 0.0 if kind == "inner" else ms
        print(f"{label:<30}{ms:>9.3f} ms  {kind}")
    print(f"{'not in any row':<30}{wall - outer:>9.3f} ms")


if __name__ == "__main__":
    main()
