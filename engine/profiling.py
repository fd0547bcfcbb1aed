"""Profiling a running engine from its step loop (the service's CLONECAST_PROFILE)."""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import threading
import time
from pathlib import Path

import torch

from engine.stats import EngineStats

log = logging.getLogger("clonecast.profiling")

MODES = ("torch", "python")


class StepProfiler:
    """An `on_step(seconds, stats)` hook: profiles `steps` steps of the thread that steps the
    engine, after `skip` steps that had requests running (at least `min_running` of them:
    a saturated window's steps only); writes its tables to `path` once, then calls only
    `then`.

    mode "torch": torch.profiler (operators by host time, kernels by device time).
    mode "python": cProfile of the stepping thread (functions by own and by cumulative time;
    a function's time includes waiting for the interpreter lock) and the CPU time of every
    thread of the process over the same steps, which says who holds the lock."""

    def __init__(
        self, skip: int, steps: int, path: str, then, mode: str = "torch", min_running: int = 1
    ):
        if mode not in MODES:
            raise ValueError(f"profile mode must be one of {MODES}, got {mode!r}")
        self.skip, self.steps, self.path, self.then = skip, steps, Path(path), then
        self.mode, self.min_running = mode, max(1, min_running)
        self.seen = 0
        self.profiler = None
        self.wall = 0.0
        self._cpu: dict[int, tuple[str, int, float]] = {}  # ident -> (name, clock id, start)

    def on_step(self, seconds: float, stats: EngineStats) -> None:  # the engine thread
        self.then(seconds, stats)
        if self.seen > self.skip + self.steps:
            return
        if stats.num_running < self.min_running and self.profiler is None:
            return  # not counted before the profile starts; every step counts once it runs
        if self.seen == self.skip:
            self._start()
        elif self.seen == self.skip + self.steps and self.profiler is not None:
            wall = time.perf_counter() - self.wall
            tables = self._stop(wall)
            summary = f"{self.steps} busy steps of the engine in {wall * 1e3:.1f} ms\n"
            try:
                self.path.write_text("\n".join(tables) + "\n" + summary)
                log.warning("step profile written to %s", self.path)
            except OSError:  # a diagnostic: never the engine thread's end
                log.exception("writing the step profile to %s failed", self.path)
            self.profiler = None
        self.seen += 1

    def _start(self) -> None:
        if self.mode == "python":
            self._cpu = _thread_clocks()
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        self.wall = time.perf_counter()

    def _stop(self, wall: float) -> list[str]:
        if self.mode == "python":
            self.profiler.disable()
            tables = []
            for key in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(self.profiler, stream=text).sort_stats(key).print_stats(40)
                tables.append(f"-- by {key} --\n{text.getvalue()}")
            tables.append(_thread_table(self._cpu, wall))
            return tables
        self.profiler.__exit__(None, None, None)
        averages = self.profiler.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if any(e.device_time_total for e in averages):
            tables.append(averages.table(sort_by="device_time_total", row_limit=30))
        return tables


def _thread_clocks() -> dict[int, tuple[str, int, float]]:
    """Every live thread's CPU clock and its reading now (Linux; others: empty)."""
    clocks = {}
    for thread in threading.enumerate():
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            clocks[thread.ident] = (thread.name, clock, time.clock_gettime(clock))
        except (AttributeError, OSError, TypeError):  # no such clock here, or thread gone
            continue
    return clocks


def _thread_table(start: dict[int, tuple[str, int, float]], wall: float) -> str:
    lines = [f"-- CPU time per thread over {wall * 1e3:.1f} ms --"]
    for name, clock, before in start.values():
        try:
            used = time.clock_gettime(clock) - before
        except OSError:  # the thread ended meanwhile
            continue
        lines.append(f"{name:<32} {used * 1e3:9.1f} ms  {100 * used / wall:5.1f}%")
    return "\n".join(lines) + "\n"
