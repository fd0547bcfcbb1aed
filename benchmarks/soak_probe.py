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
    pid: int
    rss_mb: float
    fds: int
    threads: int


@dataclass
class Sample:
    t_s: float  # since the load started (the baseline: 0, just before it)
    phase: str  # baseline, load or idle
    requests: int  # requests ended so far (every outcome)
    server: ProcessState | None
    engine: ProcessState | None
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


def engine_pid(server_pid: int) -> int | None:
    """The spawned engine process: the server's child running multiprocessing's spawn_main
    (the other child, multiprocessing's resource tracker, is not it). Looked up at every
    sample: an engine restarted by the server has a new pid."""
    for child in children(server_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"multiprocessing.spawn" in cmdline:
            return child
    return None


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


def kv_blocks_used(metrics: dict[str, float]) -> int:
    free = metrics["clonecast_kv_cache_free_blocks"]
    usage = metrics["clonecast_kv_cache_usage_perc"]
    if usage >= 1.0:
        return -1  # every block in use: the total is not recoverable from these two
    return round(free / (1.0 - usage) - free)


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
        child = engine_pid(self.server_pid) if server else None
        return Sample(
            t_s=round(time.monotonic() - self.started, 1),
            phase=phase,
            requests=requests,
            server=server,
            engine=process_state(child) if child else None,
            kv_blocks_used=kv_blocks_used(metrics),
            voice_cache_bytes=int(metrics.get("clonecast_voice_cache_bytes", -1)),
            engine_running=int(
                metrics["clonecast_num_requests_running"]
                + metrics["clonecast_num_requests_waiting"]
            ),
            connections=int(metrics["clonecast_websocket_connections"]),
        )
