"""What the engine reports about itself: `EngineStats` (a snapshot, `Engine.stats`), the
phases its host time per step is split into, the running totals behind them, and the
observations a histogram needs one by one (`Observations`: what each step launched, how long
each request queued, how long each codec batch took). No torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The parts of Engine.step(), in order: scheduling; preparing and launching the GPU step; reading
# back the codec's audio (waits for its events) and handing it to `emit`; waiting for the rows
# of the step on the GPU; turning those rows into events (and submitting codec windows).
STEP_PHASES = ("schedule", "launch", "audio", "gpu_wait", "rows")
_PHASE_INDEX = {name: i for i, name in enumerate(STEP_PHASES)}

# The families of captured graphs (engine/cuda_graphs.py, engine/codec/codec_graphs.py).
GRAPH_FAMILIES = ("backbone", "sampler", "codec")

# What a step launched: prompt positions only, one-token decodes only, both, or nothing (the
# step only read back what earlier steps launched: the last steps of a burst).
STEP_KINDS = ("prefill", "decode", "mixed", "readback")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_prefill_tokens_computed: int
    num_prefix_cached_tokens: int
    num_preemptions: int
    num_voice_encodes: int = 0
    num_voice_cache_hits: int = 0
    num_voice_cache_bytes: int = 0  # what the codec's voice cache holds (bounded)
    num_steps: int = 0
    num_rows_generated: int = 0
    step_seconds_total: float = 0.0  # host wall time inside step(), GPU waits included
    # step_seconds_total split by phase (STEP_PHASES): where the host's time in step() goes
    phase_seconds_total: tuple[float, ...] = (0.0,) * len(STEP_PHASES)


@dataclass
class StepCounters:
    """The engine's running totals (its own thread only)."""

    preemptions: int = 0
    rows: int = 0
    steps: int = 0
    seconds: float = 0.0
    phases: list[float] = field(default_factory=lambda: [0.0] * len(STEP_PHASES))

    def timing(self, phase: str | None = None) -> _Timing:
        """`with counters.timing("audio"):` adds the block's wall time to that phase; without
        a phase, to the total of step()."""
        return _Timing(self, -1 if phase is None else _PHASE_INDEX[phase])


class _Timing:
    __slots__ = ("counters", "index", "start")

    def __init__(self, counters: StepCounters, index: int):
        self.counters, self.index = counters, index

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.start
        if self.index < 0:
            self.counters.seconds += elapsed
        else:
            self.counters.phases[self.index] += elapsed


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step launched: its kind (STEP_KINDS), requests and token positions."""

    kind: str
    requests: int
    tokens: int


READBACK = StepShape("readback", 0, 0)


@dataclass
class Observations:
    """Observations since the engine last handed them over (`Engine.take_observations`):
    each step's wall time and shape, each newly scheduled request's wait in the queue (from
    its arrival in the engine), each codec batch's latency (submitted to read back) and its
    windows."""

    steps: list[tuple[float, StepShape]] = field(default_factory=list)
    queue_seconds: list[float] = field(default_factory=list)
    codec_batches: list[tuple[float, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.steps or self.queue_seconds or self.codec_batches)

    def extend(self, other: Observations) -> None:
        self.steps += other.steps
        self.queue_seconds += other.queue_seconds
        self.codec_batches += other.codec_batches
