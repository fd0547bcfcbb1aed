"""Profiling a running engine from its step loop (the service's CLONECAST_PROFILE)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.stats import EngineStats

log = logging.getLogger("clonecast.profiling")


class StepProfiler:
    """An `on_step(seconds, stats)` hook: torch.profiler over `steps` steps of the thread
    that steps the engine, after `skip` steps that had requests running; writes its tables
    (by host time, by device time) to `path` once, then calls only `then`."""

    def __init__(self, skip: int, steps: int, path: str, then):
        self.skip, self.steps, self.path, self.then = skip, steps, Path(path), then
        self.seen = 0
        self.profiler = None
        self.wall = 0.0

    def on_step(self, seconds: float, stats: EngineStats) -> None:  # the engine thread
        self.then(seconds, stats)
        if self.seen > self.skip + self.steps or not stats.num_running:
            return
        if self.seen == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.wall = time.perf_counter()
        elif self.seen == self.skip + self.steps and self.profiler is not None:
            wall = time.perf_counter() - self.wall
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
            if any(e.device_time_total for e in averages):
                tables.append(averages.table(sort_by="device_time_total", row_limit=30))
            summary = f"{self.steps} busy steps of the engine process in {wall * 1e3:.1f} ms\n"
            try:
                self.path.write_text("\n".join(tables) + "\n" + summary)
                log.warning("step profile written to %s", self.path)
            except OSError:  # a diagnostic: never the engine thread's end
                log.exception("writing the step profile to %s failed", self.path)
            self.profiler = None
        self.seen += 1
