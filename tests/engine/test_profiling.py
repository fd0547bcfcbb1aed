"""StepProfiler (the service's CLONECAST_PROFILE): counts only steps with requests running,
profiles the STEPS after SKIP of them, writes its tables once, and always passes the step on."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from engine import EngineStats, StepProfiler

BUSY = EngineStats(1, 0, 10, 10, 0, 0, 0)
IDLE = dataclasses.replace(BUSY, num_running=0)


def test_the_profiler_covers_busy_steps_after_the_skip_and_writes_once(tmp_path):
    out = tmp_path / "p.txt"
    passed = []
    profiler = StepProfiler(2, 3, str(out), then=lambda s, st: passed.append(st))
    for stats in (BUSY, IDLE, BUSY, IDLE):  # two busy steps skipped, idle ones not counted
        profiler.on_step(0.01, stats)
    assert profiler.profiler is None and not out.exists()
    profiler.on_step(0.01, BUSY)  # the third busy step starts the profiler
    assert profiler.profiler is not None
    for _ in range(3):
        torch.ones(64, 64) @ torch.ones(64, 64)  # work inside the profiled span
        profiler.on_step(0.01, BUSY)
    text = out.read_text()
    assert "Self CPU" in text and "aten::mm" in text and "3 busy steps" in text
    out.unlink()
    for _ in range(5):
        profiler.on_step(0.01, BUSY)
    assert not out.exists()  # once only
    assert len(passed) == 13  # every step reached `then`


def test_an_unwritable_profile_file_does_not_stop_the_engine(tmp_path):
    profiler = StepProfiler(0, 1, str(tmp_path / "no" / "such" / "dir.txt"), then=lambda *a: None)
    for _ in range(3):
        profiler.on_step(0.01, BUSY)  # logs the failure, raises nothing
    assert profiler.profiler is None


def test_the_python_mode_tables_functions_and_every_threads_cpu_time(tmp_path):
    """mode "python": cProfile of the stepping thread and each thread's CPU time over the
    profiled steps (a second thread that burns CPU shows up by name with its share)."""
    out = tmp_path / "p.txt"
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(range(1000))

    burner = threading.Thread(target=burn, name="burner-thread", daemon=True)
    burner.start()
    try:
        profiler = StepProfiler(0, 3, str(out), then=lambda s, st: None, mode="python")
        for _ in range(4):
            _spin_seconds(0.05)  # the stepping thread's own work
            profiler.on_step(0.05, BUSY)
    finally:
        stop.set()
        burner.join()
    text = out.read_text()
    assert "-- by tottime --" in text and "_spin_seconds" in text
    table = text.split("-- CPU time per thread")[1]
    burner_row = next(line for line in table.splitlines() if line.startswith("burner-thread"))
    assert float(burner_row.split()[1]) > 10  # ms of CPU over ~0.15 s of steps
    assert "3 busy steps" in text


def _spin_seconds(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_an_unknown_profile_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        StepProfiler(0, 1, "x", then=lambda *a: None, mode="gpu")


def test_min_running_counts_only_steps_with_that_many_requests():
    """min_running: the skip and the start wait for a saturated step; once the profile runs,
    every step counts (a dip in running requests does not stretch it)."""
    profiler = StepProfiler(1, 2, "unused.txt", then=lambda *a: None, mode="python", min_running=5)
    small, full = dataclasses.replace(BUSY, num_running=3), dataclasses.replace(BUSY, num_running=5)
    for _ in range(4):
        profiler.on_step(0.01, small)
    assert profiler.seen == 0
    profiler.on_step(0.01, full)  # skipped
    profiler.on_step(0.01, full)  # starts
    assert profiler.profiler is not None
    profiler.on_step(0.01, small)  # counted while running
    assert profiler.seen == 3
    profiler.profiler.disable()
