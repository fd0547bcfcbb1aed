"""Decode-step time of the engine on the Higgs v3 4B shape, next to the weight+KV byte floor
of docs/PERFORMANCE.md, for three paths in one run: the torch reference attention eagerly, the
Triton kernel eagerly, and the Triton kernel under FULL CUDA graphs.

    python benchmarks/eager_step.py --ckpt DIR [--batches 1,32,64] [--context 400]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.floor import floor_ms  # noqa: E402
from benchmarks.overrides import engine_config  # noqa: E402
from engine import Engine, SamplingParams, VoiceReference  # noqa: E402


def _add_batch(engine: Engine, prefix: str, batch: int, context: int, max_rows: int, seed: int):
    """`batch` clone requests whose prompts are about `context` positions long (~33 text
    positions + frames + 7 placeholders), codes only: the backbone step alone (the codec has
    its own benchmark)."""
    rng = random.Random(seed)
    codes = tuple(tuple(rng.randrange(1024) for _ in range(8)) for _ in range(context - 40))
    voice = VoiceReference(codes, "a reference transcript")
    for i in range(batch):
        engine.add_request(
            f"{prefix}-{i}",
            "Timing the decode step of the engine.",
            reference=voice,
            params=SamplingParams(seed=i, max_rows=max_rows),
            audio=False,
        )


def row_cap(engine: Engine, batch: int, context: int, steps: int) -> int:
    """A row cap that outlasts the prefill of the whole batch plus `steps` timed steps: with a
    shorter cap the first requests finish before the last start decoding and the batch
    shrinks inside the timed window."""
    prefill_steps = -(-batch * (context + 10) // engine.config.max_num_batched_tokens)
    return prefill_steps + steps + 40


def fill_decoding(engine: Engine, prefix: str, batch: int, context: int, steps: int) -> None:
    """Adds `batch` requests and steps until every one of them is decoding."""
    _add_batch(engine, prefix, batch, context, row_cap(engine, batch, context, steps), seed=batch)
    while (
        any(r.num_computed < len(r.prompt) for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()


def time_batch(engine: Engine, batch: int, context: int, steps: int, sync=torch.cuda.synchronize):
    """(ms per step, rows per step) over `steps` decode steps of `batch` requests."""
    fill_decoding(engine, f"b{batch}", batch, context, steps)
    sync()
    rows = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        rows += sum(len(out.new_rows) for out in engine.step())
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, rows / steps


def time_and_replay(engine: Engine, batch: int, context: int, steps: int):
    ms, rows = time_batch(engine, batch, context, steps)
    gpu_ms, launch_us = replay_only(engine, batch, steps)
    for i in range(batch):
        engine.abort(f"b{batch}-{i}")
    return ms, rows, gpu_ms, launch_us


def replay_only(engine: Engine, batch: int, steps: int) -> tuple[float, float]:
    """With graphs: (GPU ms of the step's backbone + sampler graphs replayed back to back, no
    host work between them; host us to launch the backbone graph). The requests' KV slots are
    rewritten with what they already hold; they are aborted right after."""
    runner = engine.runner
    if runner.graphs is None or runner.sampler_graphs is None:
        return float("nan"), float("nan")
    graph = runner.graphs.lookup(batch, decode_only=True)
    sampler = runner.sampler_graphs.get(runner.sample_bucket(batch))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.graph.replay()
    launch_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.graph.replay()
        sampler.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, launch_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="torch-eager,triton-eager,triton-graphs")
    ap.add_argument("--profile", help="write a torch.profiler table of the graph path here")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an EngineConfig or plan field for every variant, e.g. pdl=false (repeatable)",
    )
    args = ap.parse_args()
    variants = {
        "torch-eager": (dict(enforce_eager=True), dict(attention_backend="torch")),
        "triton-eager": (dict(enforce_eager=True), dict(attention_backend="triton")),
        "triton-graphs": (dict(enforce_eager=False), dict(attention_backend="triton")),
    }
    rows = []
    for name, (extra, plan) in variants.items():
        if name not in args.variants.split(","):
            continue
        batches = [int(x) for x in args.batches.split(",")]
        fields = dict(
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max(64, *batches),
            max_num_batched_tokens=max(512, *batches),
            # every request of the largest batch holds its context plus its row cap
            num_kv_blocks=max(batches) * (args.context + 2 * max(batches) + args.steps + 80) // 16
            + 64,
            enable_prefix_caching=False,
        )
        plan = {**plan, "codec_graph_max_batch": 0}  # codes only: no codec graphs to capture
        cfg = engine_config({**fields, **extra}, plan, args.set)  # --set wins
        engine = Engine.from_pretrained(args.ckpt, cfg)
        for r in engine.capture_reports:
            print(
                f"{name}: {r.num_graphs} {r.family} graphs in {r.seconds:.1f} s, "
                f"+{r.allocated_bytes / 2**20:.0f} MiB allocated, "
                f"+{r.reserved_bytes / 2**20:.0f} MiB reserved"
            )
        for b in batches:
            ms, per_step, gpu_ms, launch_us = time_and_replay(engine, b, args.context, args.steps)
            rows.append((name, b, per_step, ms, floor_ms(b, args.context), gpu_ms, launch_us))
        if args.profile and not extra["enforce_eager"]:
            profile_step(engine, 64, args.context, args.profile)
        del engine
        torch.cuda.empty_cache()
    print(f"\ndecode step, {torch.cuda.get_device_name()}, context ~{args.context}")
    print("(step: engine.step() in a loop; graphs only: the same graphs replayed back to back)")
    header = ("variant", "batch", "rows", "step ms", "floor ms", "x floor", "audio-s/s")
    print("{:<14}{:>6}{:>7} {:>9} {:>9} {:>8} {:>10}  graphs ms  launch us".format(*header))
    for name, b, per_step, ms, fl, gpu, launch in rows:
        rate = per_step / (ms / 1e3) / 25
        print(
            f"{name:<14}{b:>6}{per_step:>7.1f} {ms:>9.2f} {fl:>9.2f} {ms / fl:>8.2f} {rate:>10.1f}"
            f"  {gpu:>9.2f}  {launch:.0f}"
        )
        if per_step < b:
            print(f"  (batch {b}: only {per_step:.1f} rows per timed step; the row is not valid)")


def profile_step(engine: Engine, batch: int, context: int, path: str) -> None:
    """Kernel and host time of 10 decode steps at `batch`, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    fill_decoding(engine, "p", batch, context, 10)  # decode steps only in the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    for i in range(batch):
        engine.abort(f"p-{i}")


if __name__ == "__main__":
    main()
