"""What the soak samples (benchmarks/soak.py): the server process and its engine process
(resident memory, open files, threads, from /proc) and the server's /metrics (KV blocks in
use, voice-cache bytes, engine requests, open connections, outcome and error counters).
Linux only (/proc). Knows nothing of the load it is sampling."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@dataclass(frozen=True)
class ProcessState:
    pid: int | str  # the engines': their pids joined by commas
    rss_mb: float
    fds: int
    threads: int


@dataclass
class Sample:
    t_s: float  # since the load started (the baseline: 0, just before it)
    phase: str  # baseline, load or idle
    requests: int  # requests ended so far (every outcome)
    server: ProcessState | None
    engine: ProcessState | None  # every engine process of the server, summed
    kv_blocks_used: int
    voice_cache_bytes: int
    engine_running: int
    connections: int

    def row(self) -> dict:
        """A flat dict: the table's, the CSV's and the JSON's columns."""
        flat = {k: v for k, v in asdict(self).items() if k not in ("server", "engine")}
        for name in ("server", "engine"):
            state = getattr(self, name)
            for key in ("pid", "rss_mb", "fds", "threads"):
                flat[f"{name}_{key}"] = getattr(state, key) if state else None
        return flat


def process_state(pid: int) -> ProcessState | None:
    """None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields["VmRSS"].split()[0]) if "VmRSS" in fields else 0
    return ProcessState(pid, round(rss_kb / 1024, 1), fds, int(fields["Threads"]))


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread just ended
            pass
    return found


def engine_pids(server_pid: int) -> list[int]:
    """The spawned engine processes (one per engine of the server): the server's children
    running multiprocessing's spawn_main (multiprocessing's resource tracker is not one).
    Looked up at every sample: an engine restarted by the server has a new pid."""
    found = []
    for child in children(server_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"multiprocessing.spawn" in cmdline:
            found.append(child)
    return sorted(found)


def engines_state(pids: list[int]) -> ProcessState | None:
    """Every engine process together: memory, files and threads summed, pids joined."""
    states = [state for state in map(process_state, pids) if state is not None]
    if not states:
        return None
    return ProcessState(
        ",".join(str(state.pid) for state in states),
        round(sum(state.rss_mb for state in states), 1),
        sum(state.fds for state in states),
        sum(state.threads for state in states),
    )


def listening_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on `port` (a server attached by URL)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(str(Path(fd).readlink()) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except (PermissionError, FileNotFoundError, OSError):
            continue
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value}."""
    values = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match:
            values[match[1] + (match[2] or "")] = float(match[3])
    return values


def scrape(http_url: str) -> dict[str, float]:
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def series(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{labels: value} of one series, with or without labels (an `engine` label per engine)."""
    return {
        k[len(name) :]: v
        for k, v in metrics.items()
        if k == name or k[: len(name) + 1] == name + "{"
    }


def summed(metrics: dict[str, float], name: str) -> int:
    """A series summed over its labels (every engine's); -1 when the server has none."""
    found = series(metrics, name)
    return round(sum(found.values())) if found else -1


def kv_blocks_used(metrics: dict[str, float]) -> int:
    """Summed over the engines, each from its free blocks and usage fraction."""
    usage = series(metrics, "clonecast_kv_cache_usage_perc")
    used = 0
    for labels, free in series(metrics, "clonecast_kv_cache_free_blocks").items():
        if usage[labels] >= 1.0:
            return -1  # every block in use: the total is not recoverable from these two
        used += round(free / (1.0 - usage[labels]) - free)
    return used


def labelled(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: summed value} of a labelled series (every other label summed over)."""
    found: dict[str, float] = {}
    pattern = re.compile(rf'^{name}\{{.*\b{label}="([^"]*)"')
    for key, value in metrics.items():
        match = pattern.match(key)
        if match:
            found[match[1]] = found.get(match[1], 0.0) + value
    return found


@dataclass
class Probe:
    http_url: str
    server_pid: int | None
    started: float = field(default_factory=time.monotonic)

    def sample(self, phase: str, requests: int) -> Sample:
        metrics = scrape(self.http_url)
        server = process_state(self.server_pid) if self.server_pid else None
        return Sample(
            t_s=round(time.monotonic() - self.started, 1),
            phase=phase,
            requests=requests,
            server=server,
            engine=engines_state(engine_pids(self.server_pid)) if server else None,
            kv_blocks_used=kv_blocks_used(metrics),
            voice_cache_bytes=summed(metrics, "clonecast_voice_cache_bytes"),
            engine_running=summed(metrics, "clonecast_num_requests_running")
            + summed(metrics, "clonecast_num_requests_waiting"),
            connections=summed(metrics, "clonecast_websocket_connections"),
        )
