"""The engine alone under the served load, without the server: a closed loop of C voice-clone
requests (a finished one is replaced at once), output lengths from the served benchmark's
distribution. Prints, per C: audio-s/s, steps/s, mean step time, host time inside `step()`
rows per step and the engine thread's CPU time per step; with `--gil-load F`, a second
Python thread holds the interpreter a fraction F of the time in bursts (as the server's event
loop does beside the engine thread), to measure what sharing the GIL costs the step; with
`--profile`, torch.profiler tables of a 30-step steady-state window
and its wall time, to set kernel time against the host's share of the step.

    python benchmarks/engine_loop.py --model DIR [--concurrency 1,64] [--profile FILE]
        [--gil-load 0.3 --gil-burst-us 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.overrides import engine_config  # noqa: E402
from benchmarks.serve_bench import TEXTS, durations, write_full  # noqa: E402
from benchmarks.voice_pool import reference_wav  # noqa: E402


def run(engine, reference, concurrency: int, warmup_s: float, timed_s: float, profile):
    import torch

    from engine import SamplingParams

    lengths = iter(durations(100_000, seed=concurrency))
    counter = iter(range(10**9))

    def add() -> None:
        i = next(counter)
        rows = int(next(lengths) / 0.04) + 8
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=i, max_rows=rows)
        engine.add_request(f"r{i}", TEXTS[i % len(TEXTS)], reference=reference, params=params)

    for _ in range(concurrency):
        add()
    audio_s = 0.0
    steps = rows = 0
    inside = 0.0
    t_start = time.perf_counter()
    timing = False
    prof = None
    while True:
        now = time.perf_counter()
        if not timing and now - t_start >= warmup_s:
            timing, t0 = True, now
            steps = rows = 0
            audio_s = inside = 0.0
            cpu0 = time.thread_time()
            phases0 = engine.stats.phase_seconds_total
            if profile:
                prof = torch.profiler.profile(
                    activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        torch.profiler.ProfilerActivity.CUDA,
                    ]
                )
                prof.__enter__()
        if timing and (steps >= 30 if prof is not None else now - t0 >= timed_s):
            break
        s0 = time.perf_counter()
        outputs = engine.step()
        inside += time.perf_counter() - s0
        steps += 1
        for out in outputs:
            rows += len(out.new_rows)
            if out.audio is not None:
                audio_s += out.audio.duration_s
            if out.finished:
                add()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - cpu0
    phases1 = engine.stats.phase_seconds_total
    summary = None
    if prof is not None:
        prof.__exit__(None, None, None)
        summary = (
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n"
            + prof.key_averages().table(sort_by="device_time_total", row_limit=30)
            + f"\n{steps} steps in {wall * 1e3:.1f} ms of wall time\n"
        )
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        "C": concurrency,
        "audio_s_per_s": audio_s / wall,
        "steps_per_s": steps / wall,
        "step_ms": 1e3 * wall / max(1, steps),
        "inside_ms": 1e3 * inside / max(1, steps),
        "rows_per_step": rows / max(1, steps),
        "cpu_ms": 1e3 * cpu / max(1, steps),  # the engine thread's CPU time
        # ms per step in each part of step() (engine.STEP_PHASES)
        "phase_ms": [1e3 * (b - a) / max(1, steps) for a, b in zip(phases0, phases1, strict=True)],
    }, summary


def gil_load(fraction: float, burst_us: float, stop: threading.Event) -> None:
    """Holds the GIL (pure-Python work) `fraction` of the time in bursts of `burst_us`,
    sleeping in between (sleeping releases it): a stand-in for an event loop's callbacks."""
    burst = burst_us * 1e-6
    pause = burst * (1.0 - fraction) / fraction
    while not stop.is_set():
        end = time.perf_counter() + burst
        x = 0
        while time.perf_counter() < end:
            x += 1
        time.sleep(pause)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        required=True,
        help="checkpoint dir (written first if missing); 'default': embedded",
    )
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--timed-s", type=float, default=10.0)
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--profile", help="write profiler tables of a 30-step window here")
    ap.add_argument("--modes", default="async,sync", help="scheduling modes to run")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an EngineConfig or plan field for this run, e.g. noise_kernel=false (repeatable)",
    )
    ap.add_argument("--gil-load", type=float, default=0.0, help="second thread's GIL share")
    ap.add_argument("--gil-burst-us", type=float, default=300.0)
    args = ap.parse_args()
    if not 0.0 <= args.gil_load < 1.0:
        raise SystemExit("--gil-load is a fraction in [0, 1)")
    model = None if args.model == "default" else args.model
    if model is not None:
        write_full(Path(model))
    from engine import Engine, default_device

    cs = [int(c) for c in args.concurrency.split(",")]
    fields = dict(device=default_device(), max_num_seqs=max(cs), enforce_eager=args.eager)
    config = engine_config(fields, {}, args.set)  # --set wins
    t = time.perf_counter()
    engine = Engine.from_pretrained(model, config)
    print(f"engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    reference = engine.encode_reference(reference_wav(4.0), "A reference sentence.")
    gc.collect()  # as the server does once it is ready
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    stop = threading.Event()
    if args.gil_load > 0:
        threading.Thread(
            target=gil_load, args=(args.gil_load, args.gil_burst_us, stop), daemon=True
        ).start()
    results = []
    for mode in args.modes.split(","):
        engine.plan = dataclasses.replace(engine.plan, async_scheduling=mode == "async")
        for c in cs:
            res, _ = run(engine, reference, c, args.warmup_s, args.timed_s, False)
            results.append({"mode": mode, **res})
            print(results[-1], flush=True)
    stop.set()
    if args.profile:
        engine.plan = dataclasses.replace(engine.plan, async_scheduling=True)
        _, summary = run(engine, reference, max(cs), 3.0, 0.0, True)
        Path(args.profile).write_text(summary)
        print(summary.splitlines()[-1])
    from engine import STEP_PHASES

    head = ("mode", "C", "audio-s/s", "steps/s", "step ms", "in step", "cpu", "rows")
    print(f"\n(gil load {args.gil_load:g}, bursts of {args.gil_burst_us:g} us)")
    print("{:<6}{:>4}{:>11}{:>9}{:>9}{:>9}{:>7}{:>7}  ".format(*head) + " ".join(STEP_PHASES))
    for r in results:
        print(
            f"{r['mode']:<6}{r['C']:>4}{r['audio_s_per_s']:>11.1f}{r['steps_per_s']:>9.1f}"
            f"{r['step_ms']:>9.2f}{r['inside_ms']:>9.2f}{r['cpu_ms']:>7.2f}"
            f"{r['rows_per_step']:>7.1f}  " + " ".join(f"{ms:.2f}" for ms in r["phase_ms"])
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
