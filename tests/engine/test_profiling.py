"""StepProfiler (the service's CLONECAST_PROFILE): counts only steps with requests running,
profiles the STEPS after SKIP of them, writes its tables once, and always passes the step on."""

from __future__ import annotations

import dataclasses

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
