"""`clonecast serve` as a process, for the tests that need the real command (signals, the
drain, its logs, several servers behind a balancer): a free loopback port, the server started
on the embedded default model (CPU) with its output in a file, ready once `/ready` answers
200, and stopped as a process manager stops it. Also the /proc helpers that tell whether its
children (the engine process) are gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
READY_S = 240  # writing the embedded model, importing torch, the engine process, a warm-up


def free_port() -> int:
    """A loopback port nothing listens on now (two test runs on one host never share one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_serve(workdir: Path, *args: str, port: int, log: Path, **env: str) -> subprocess.Popen:
    """`clonecast serve ARGS` on `port`, its model cache in `workdir`, stdout and stderr
    appended to `log` (a file: a pipe nobody reads would fill and block the server); returns
    at once."""
    environ = {
        **os.environ,
        "CLONECAST_CACHE_DIR": str(workdir / "cache"),
        "CLONECAST_DEVICE": "cpu",
        "CLONECAST_PORT": str(port),
        **env,
    }
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", *args],
            cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def wait_ready(server: subprocess.Popen, url: str, log: Path) -> None:
    """Until `url`/ready answers 200; fails with the end of the log if the server exits."""
    deadline = time.monotonic() + READY_S
    while True:
        assert server.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready in {READY_S} s: {log.read_text()[-3000:]}"
        time.sleep(0.3)


def start_serve(
    workdir: Path, *args: str, port: int | None = None, log: Path | None = None, **env: str
) -> tuple[subprocess.Popen, str, Path]:
    """`spawn_serve` on a free port (or `port`) with its log in workdir/serve.log (or `log`),
    then `wait_ready`; returns (process, base URL, log)."""
    port = port or free_port()
    log = log or workdir / "serve.log"
    server = spawn_serve(workdir, *args, port=port, log=log, **env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url, log)
    except BaseException:
        server.kill()
        server.wait()
        raise
    return server, url, log


def stop_serve(server: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the drain, then exit), killed if it is still there after `timeout` s."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def children(pid: int) -> set[int]:
    """Direct children of pid (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing
