"""A loopback cluster for the balancer tests: `clonecast serve` processes (the embedded default
model, CPU) behind HAProxy from Debian, run with deploy/haproxy/clonecast.cfg as rendered by
`render` (loopback ports, short check intervals). Reads HAProxy's view of its servers from
its admin socket and each server's own from its /metrics. Knows nothing of what a test
asserts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.serve_process import ROOT, alive, children, free_port, spawn_serve, wait_ready

TEMPLATE = ROOT / "deploy" / "haproxy" / "clonecast.cfg"
# Debian installs it in /usr/sbin, which a user's PATH may lack
HAPROXY = shutil.which("haproxy", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
# checks every 0.2 s, out after one failed and back after one passed: the test sees the
# balancer act within a second (the template's `timeout check` still bounds each answer)
TEST_CHECKS = "inter 200ms fall 1 rise 1"
# the sections Debian's stock haproxy.cfg has above ours, reduced to what a non-root test
# needs: the admin socket it reads, logs to stderr (kept in a file for a failure's message)
TEST_GLOBAL = "global\n    stats socket {socket} level admin\n    log stderr format raw local0\n"


def render(template: str, bind: str, servers: dict[str, str], checks: str = TEST_CHECKS) -> str:
    """The template with its `bind` address, its check timing and its `server` lines (name to
    address:port) replaced. Each part must be found as the template's comments describe it:
    a changed template fails here, not in a puzzling way later."""
    lines = template.splitlines()
    binds = [i for i, line in enumerate(lines) if line.strip().startswith("bind ")]
    assert len(binds) == 1, f"one bind line expected in {TEMPLATE}, found {len(binds)}"
    lines[binds[0]] = f"    bind {bind}"
    timing = re.compile(r"inter \S+ fall \d+ rise \d+")
    hits = [i for i, line in enumerate(lines) if line.strip().startswith("default-server ")]
    assert len(hits) == 1 and timing.search(lines[hits[0]]), "one default-server line with timing"
    lines[hits[0]] = timing.sub(checks, lines[hits[0]])
    old = [i for i, line in enumerate(lines) if line.strip().startswith("server ")]
    assert old and old == list(range(old[0], old[-1] + 1)), "server lines together, at the end"
    new = [f"    server {name} {address}" for name, address in servers.items()]
    return "\n".join(lines[: old[0]] + new + lines[old[-1] + 1 :]) + "\n"


class Server:
    """One `clonecast serve` process on a fixed loopback port; `start` again after it ended
    (a deploy) keeps the port, the model cache and the log file."""

    def __init__(self, name: str, workdir: Path):
        self.name, self.port, self.workdir = name, free_port(), workdir
        self.http = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.children: set[int] = set()  # the engine process and multiprocessing's helpers

    def start(self, **env) -> None:
        self.process = spawn_serve(
            self.workdir, port=self.port, log=self.log_path,
            CLONECAST_CACHE_DIR=str(self.workdir / f"{self.name}-cache"),
            CLONECAST_DRAIN_TIMEOUT_S="120",  # streams finish; the test never waits for it
            **env,
        )  # fmt: skip
        wait_ready(self.process, self.http, self.log_path)
        self.children |= children(self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def connections(self) -> int | None:
        """Open WebSocket connections, as the server's /metrics counts them; None when it
        does not answer (killed, or at the end of its drain)."""
        try:
            text = httpx.get(self.http + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return None
        found = re.search(r"^clonecast_websocket_connections (\S+)$", text, re.M)
        assert found, "no clonecast_websocket_connections in /metrics"
        return int(float(found.group(1)))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGINT)  # twice: stop now, no drain
            time.sleep(0.2)
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.children:  # an engine left behind by a kill -9 of its server
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


class Balancer:
    """HAProxy in the foreground (-db) on a loopback port, its log in a file."""

    def __init__(self, workdir: Path, servers: list[Server]):
        self.port, self.socket = free_port(), workdir / "haproxy.sock"
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/stream"
        self.log_path = workdir / "haproxy.log"
        (workdir / "global.cfg").write_text(TEST_GLOBAL.format(socket=self.socket))
        addresses = {s.name: f"127.0.0.1:{s.port}" for s in servers}
        config = render(TEMPLATE.read_text(), f"127.0.0.1:{self.port}", addresses)
        (workdir / "clonecast.cfg").write_text(config)
        files = ["-f", str(workdir / "global.cfg"), "-f", str(workdir / "clonecast.cfg")]
        check = subprocess.run([HAPROXY, "-c", *files], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen([HAPROXY, "-db", *files], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            assert self.process.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "haproxy did not open its admin socket"
            time.sleep(0.1)

    def stats(self) -> dict[str, dict[str, str]]:
        """`show stat` for the backend's servers: name to HAProxy's columns (status, scur, stot,
        ...)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(self.socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        header, *rows = data.decode().strip().splitlines()
        names = header.lstrip("# ").split(",")
        parsed = [dict(zip(names, row.split(","), strict=False)) for row in rows]
        return {
            row["svname"]: row
            for row in parsed
            if row["pxname"] == "clonecast_servers" and row["svname"] != "BACKEND"
        }

    def current_sessions(self) -> dict[str, int]:
        """Connections open to each server, as HAProxy counts them (what leastconn reads)."""
        return {name: int(row["scur"]) for name, row in self.stats().items()}

    def wait_sessions(self, name: str, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (seen := self.current_sessions()[name]) != count:
            assert time.monotonic() < deadline, f"{name} has {seen} sessions, not {count}"
            time.sleep(0.05)

    def wait_status(self, name: str, status: str, timeout: float = 60) -> dict[str, str]:
        """Until HAProxy's health check has marked server `name` UP or DOWN; returns its row
        then (`check_status`: L7OK, L7STS with `check_code` for an HTTP answer that failed,
        L4CON for a refused connection)."""
        deadline = time.monotonic() + timeout
        while (row := self.stats()[name])["status"] != status:
            seen = row["status"]
            assert time.monotonic() < deadline, f"{name} is {seen}, not {status}, in {timeout} s"
            time.sleep(0.1)
        return row

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
