"""The server's own figures inside the served benchmark's saturated window: a thread scrapes
`/metrics` every 0.1 s; `RunningSampler.stop(start, end)` turns the samples taken inside the
window into per-step figures. (The server's whole-load averages include the tail where fewer
than C requests remain, with fast small steps, so they understate the loaded step.)
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import urllib.request

_STEPS = "clonecast_engine_step_seconds"  # by kind: summed over the kinds here


class RunningSampler:
    """After `stop(start, end)`: the mean running and waiting requests (returned) and, from the
    first and last sample inside the window, `window_rows` (rows per step), `window_wall_ms`
    (wall time per step), `window_step_ms` (time inside step() per step), `window_phase_ms`
    (that time by phase, engine.STEP_PHASES), `window_long_steps` (steps over 20 ms) and
    `scrape_ms` (mean and max time /metrics took to answer during the load). All
    NaN when fewer than two samples fall inside the window, or when the server does not
    export the figure."""

    def __init__(self, port: int):
        self.port, self.values, self.waiting, self.counters = port, [], [], []
        self.scrapes: list[float] = []  # how long each /metrics answer took (s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url = f"http://127.0.0.1:{self.port}/metrics"
        while not self._stop.wait(0.1):
            sent = time.perf_counter()
            text = urllib.request.urlopen(url).read().decode()
            now = time.perf_counter()
            self.scrapes.append(now - sent)
            rows = math.nan
            steps = inside = under_20ms = 0.0
            phases: dict[str, float] = {}
            running = waiting = 0.0  # summed over the server's engines
            for line in text.splitlines():
                value = line.split()[-1] if line and not line.startswith("#") else None
                if line.startswith("clonecast_num_requests_running"):
                    running += float(value)
                elif line.startswith("clonecast_num_requests_waiting"):
                    waiting += float(value)
                elif line.startswith(_STEPS + "_count{"):
                    steps += float(value)
                elif line.startswith(_STEPS + "_sum{"):
                    inside += float(value)
                elif line.startswith("clonecast_engine_rows_total "):
                    rows = float(value)
                elif line.startswith("clonecast_engine_phase_seconds_total{"):
                    phases[line.split('"')[1]] = float(value)
                elif line.startswith(_STEPS + "_bucket{") and 'le="0.02"' in line:
                    under_20ms += float(value)
            self.values.append((now, running))
            self.waiting.append((now, waiting))
            self.counters.append((now, steps, rows, inside, under_20ms, phases))

    def stop(self, start: float, end: float) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()

        def mean(samples):
            inside = [v for t, v in samples if start <= t <= end]
            return statistics.fmean(inside) if inside else 0.0

        inside = [c for c in self.counters if start <= c[0] <= end]
        # /metrics under this load: (mean, max) ms of its answers
        self.scrape_ms = (
            (statistics.fmean(self.scrapes) * 1e3, max(self.scrapes) * 1e3)
            if self.scrapes
            else (math.nan, math.nan)
        )
        nan = math.nan
        self.window_rows = self.window_wall_ms = self.window_step_ms = nan
        self.window_long_steps = nan
        self.window_phase_ms: dict[str, float] = {}
        if len(inside) >= 2:
            (t0, n0, r0, s0, u0, p0), (t1, n1, r1, s1, u1, p1) = inside[0], inside[-1]
            steps = max(1.0, n1 - n0)
            self.window_rows = (r1 - r0) / steps
            self.window_wall_ms = (t1 - t0) / steps * 1e3
            self.window_step_ms = (s1 - s0) / steps * 1e3
            # steps over 20 ms (stalls: a 320 ms first chunk has about 8 steps to spare)
            self.window_long_steps = (n1 - n0) - (u1 - u0)
            self.window_phase_ms = {k: (p1[k] - p0.get(k, nan)) / steps * 1e3 for k in p1}
        return mean(self.values), mean(self.waiting)
