"""`clonecast serve` as a process manager stops it: SIGINT (a terminal's Ctrl-C) and SIGTERM
(systemd, Docker, Kubernetes) both end the server after a graceful shutdown, take the engine
process with it, and leave no multiprocessing semaphore behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    """Direct children of pid (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_server_and_engine_without_leaks(sig, tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "CLONECAST_CACHE_DIR": str(tmp_path / "cache"),
        "CLONECAST_DEVICE": "cpu",
        "CLONECAST_PORT": str(port),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server was not ready in 240 s"
            time.sleep(0.5)
        children = _children(server.pid)
        assert children  # the engine process (and multiprocessing's resource tracker)
        server.send_signal(sig)
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode in (0, -sig), (server.returncode, stderr[-2000:])
    assert "Application shutdown complete" in stderr  # graceful: the lifespan's shutdown ran
    assert "leaked" not in stderr, stderr[-2000:]
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)


def test_the_port_answers_while_the_model_loads(tmp_path):
    """The first answers come before the model is ready: /health 200 "loading" and /ready
    503 saying what loading does; then both turn ready. (Loading the embedded model takes
    seconds: writing it, importing torch, spawning the engine process, a warm-up.)"""
    import json as json_

    port = _free_port()
    env = {**os.environ, "CLONECAST_CACHE_DIR": str(tmp_path / "cache"), "CLONECAST_DEVICE": "cpu"}
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    seen = []
    try:
        deadline = time.monotonic() + 240
        while not seen or seen[-1][0] != "ok":
            assert server.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    status = json_.loads(r.read())["status"]
            except OSError:
                time.sleep(0.02)
                continue
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
                ready = 200, None
            except urllib.error.HTTPError as exc:
                ready = exc.code, json_.loads(exc.read())
            seen.append((status, ready))
    finally:
        server.terminate()
        server.wait(timeout=60)
    first_status, (first_code, first_body) = seen[0]
    assert first_status == "loading" and first_code == 503, seen[:3]
    assert first_body["error"]["code"] == "not_ready" and first_body["progress"]
    assert seen[-1] == ("ok", (200, None))
