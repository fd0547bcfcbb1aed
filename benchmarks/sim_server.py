"""The real server with the GPU work replaced by waits: a model of the host side of serving.

Everything on the host is real (the event loop, sessions, the WebSocket protocol, the worker,
the scheduler, step preparation, streaming windows, events), but a launched step's rows come
back `--step-ms A+B*rows` after the previous step finished (`A+B+M`: M more for a step that
computes a prompt, the mixed graph's premium over the decode graph's), with random codes and
no EOS (requests end at their length cap, as with random weights), and each codec batch takes
`--codec-ms` on its own simulated stream and returns silence of the right length. Waits
release the interpreter lock, as CUDA waits do. It shows, on a machine without a GPU, whether
the service keeps C streams running. Its codec costs time but never slows the backbone,
which the H200 is not like under load (there the codec shares the SMs: hiding its latency
gained nothing on the GPU, +22-30% here), so it cannot predict codec levers.

With `--engine-process` the engine runs in its own process, as the GPU server's does (the
service's default), instead of a thread of the server's: the engine then shares the
interpreter lock with its own threads only, not with the WebSocket loop.

    python benchmarks/sim_server.py --port 8790 --max-num-seqs 256 [--step-ms 3.7+0.029]
        [--engine-process]
    python benchmarks/serve_bench.py --sim "..." ...   (starts it for you)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, EngineConfig  # noqa: E402
from engine.config import NUM_CODEBOOKS  # noqa: E402
from engine.runner import SampledRows  # noqa: E402


class SimulatedStep:
    def __init__(self, requests, ready_at: float, rng: np.random.Generator):
        self.requests = requests
        self.ready_at = ready_at
        self.codes = rng.integers(0, 1024, (len(requests), NUM_CODEBOOKS), dtype=np.int64)

    def result(self) -> SampledRows:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return SampledRows(self.requests, self.codes, np.zeros(len(self.requests), bool))


def simulate(
    engine: Engine, step_a_ms: float, step_b_ms: float, codec_ms: float, mixed_ms: float = 0.0
) -> None:
    runner, rng = engine.runner, np.random.default_rng(0)
    gpu_free_at = [0.0]

    def launch(sched):
        runner._next_staging_buffer()
        runner._prepare(sched)  # the real host work of a step
        sampling = [c.request for c in sched.chunks if c.samples]
        ms = step_a_ms + step_b_ms * sched.num_tokens
        if sched.num_decodes < len(sched.chunks):  # a prompt: the mixed graph replays
            ms += mixed_ms
        gpu_free_at[0] = max(gpu_free_at[0], time.perf_counter()) + ms / 1e3
        return SimulatedStep(sampling, gpu_free_at[0], rng)

    codec_free_at = [0.0]
    # One silent buffer, sliced per batch: the GPU's batches land in a pinned buffer that
    # the host does not clear, so a fresh zeroed tensor would bill the host for a memset.
    silence = [torch.zeros(0, 0, dtype=torch.int16)]

    def launch_batch(batch):
        # the codec runs on its own stream: batches queue behind each other, the host goes on
        codec_free_at[0] = max(codec_free_at[0], time.perf_counter()) + codec_ms / 1e3
        samples = max(w.window_frames for w in batch) * engine.codec.chunks.hop
        if silence[0].shape[0] < len(batch) or silence[0].shape[1] < samples:
            rows = max(len(batch), silence[0].shape[0])
            silence[0] = torch.zeros(rows, max(samples, silence[0].shape[1]), dtype=torch.int16)
        pcm = silence[0][: len(batch), :samples]
        return pcm, torch.ones(len(batch), dtype=torch.bool), SimulatedEvent(codec_free_at[0])

    runner.launch = launch
    engine.codec.chunks._launch_batch = launch_batch


class SimulatedEvent:
    """A CUDA event stand-in that completes at a wall-clock time."""

    def __init__(self, ready_at: float):
        self.ready_at = ready_at

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def synchronize(self) -> None:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


# `--engine-process`: the service spawns its engine process, which imports this module as
# `__mp_main__` before it loads the engine; the simulation's parameters come through the
# environment, and the engine it loads is made a simulated one there.
SIM_ENV = "CLONECAST_SIM_ENGINE"  # sim_env()


def _simulate_loaded_engines(a: float, b: float, codec_ms: float, mixed_ms: float) -> None:
    import service.engine_host as host

    load = Engine.from_pretrained

    def load_simulated(*args, **kwargs):
        engine = load(*args, **kwargs)
        simulate(engine, a, b, codec_ms, mixed_ms)
        # said where the server's log shows it: a run whose engine process missed this
        # would time the real CPU forward, not the simulated step
        print("engine process: GPU work simulated", file=sys.stderr)
        return engine

    host.Engine = type("SimulatedEngine", (Engine,), {"from_pretrained": load_simulated})


def sim_env(a: float, b: float, codec_ms: float, mixed_ms: float) -> str:
    """The simulation's parameters as the engine process reads them (`read_sim_env`)."""
    return f"{a},{b},{codec_ms},{mixed_ms}"


def read_sim_env(text: str) -> tuple[float, float, float, float]:
    a, b, codec_ms, mixed_ms = (float(x) for x in text.split(","))
    return a, b, codec_ms, mixed_ms


def parse_step_ms(text: str) -> tuple[float, float, float]:
    """`--step-ms` "A+B" or "A+B+M" -> (A, B, M); M is 0 when left out."""
    parts = [float(x) for x in text.split("+")]
    if len(parts) not in (2, 3):
        raise ValueError(f"--step-ms {text!r}: A+B or A+B+M")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 0.0


if __name__ == "__mp_main__" and os.environ.get(SIM_ENV):
    _simulate_loaded_engines(*read_sim_env(os.environ[SIM_ENV]))


def main() -> None:
    import uvicorn

    from service.app import create_app, uvicorn_options
    from service.config import ServiceSettings

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--step-ms",
        default="3.7+0.029",
        help="A+B: A + B * tokens per step; A+B+M: M more for a step with a prompt",
    )
    ap.add_argument("--codec-ms", type=float, default=1.5, help="per codec batch")
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="the engine in its own process, as served on a GPU (default: a server thread)",
    )
    args = ap.parse_args()
    try:
        a, b, m = parse_step_ms(args.step_ms)
    except ValueError as exc:
        ap.error(str(exc))
    settings = ServiceSettings.from_env(port=args.port, max_num_seqs=args.max_num_seqs)
    engine = None  # --engine-process: the service loads it in its own process
    if args.engine_process:
        os.environ[SIM_ENV] = sim_env(a, b, args.codec_ms, m)  # read by the spawned engine process
        settings = dataclasses.replace(settings, engine_process=True)
    else:
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(512, args.max_num_seqs),
            row_events=False,  # as the service configures its engine
            enable_prefix_caching=settings.prefix_caching,  # CLONECAST_PREFIX_CACHING
            plan_overrides=settings.plan,  # CLONECAST_PLAN
        )
        engine = Engine.from_pretrained(None, config)
        simulate(engine, a, b, args.codec_ms, m)
    where = "its own process" if args.engine_process else "a server thread"
    print(
        f"simulated server on {args.port}: step {a}+{b}*tokens ms (+{m} with a prompt), "
        f"engine in {where}",
        file=sys.stderr,
    )
    uvicorn.run(create_app(settings, engine), log_level="warning", **uvicorn_options(settings))


if __name__ == "__main__":
    main()
