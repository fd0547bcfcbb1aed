"""`clonecast serve` as a process manager stops it: SIGINT (a terminal's Ctrl-C) and SIGTERM
(systemd, Docker, Kubernetes) both end the server after a graceful shutdown, take the engine
process with it, and leave no multiprocessing semaphore behind."""

from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.serve_process import alive, children, free_port, spawn_serve, wait_ready


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_server_and_engine_without_leaks(sig, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    server = spawn_serve(tmp_path, port=port, log=log)
    try:
        wait_ready(server, f"http://127.0.0.1:{port}", log)
        engine = children(server.pid)
        assert engine  # the engine process (and multiprocessing's resource tracker)
        server.send_signal(sig)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = log.read_text()
    assert server.returncode in (0, -sig), (server.returncode, output[-2000:])
    assert "Application shutdown complete" in output  # graceful: the lifespan's shutdown ran
    assert "leaked" not in output, output[-2000:]
    deadline = time.monotonic() + 10
    while any(alive(c) for c in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(c) for c in engine)


def test_the_port_answers_while_the_model_loads(tmp_path):
    """The first answers come before the model is ready: /health 200 "loading" and /ready
    503 saying what loading does; then both turn ready. (Loading the embedded model takes
    seconds: writing it, importing torch, spawning the engine process, a warm-up.)"""
    import json as json_

    port = free_port()
    server = spawn_serve(tmp_path, port=port, log=tmp_path / "serve.log")
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
