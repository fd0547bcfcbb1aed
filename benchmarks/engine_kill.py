"""One engine of a multi-engine server killed mid-run: starts `clonecast serve` with several
engines (`--devices cuda:0,cuda:1`, or `--engines 2` on the CPU), opens N streams, waits
until every one has sent audio, `kill -9`s one engine process, and reports how the streams
ended (`generation_failed` on the killed engine, `done` on the others), whether `/ready`
stayed 200, how long the engine took to come back, and the restart counted per engine.

    python benchmarks/engine_kill.py --serve-args "--devices cuda:0,cuda:1 --model CKPT"
    python benchmarks/engine_kill.py --serve-args "--device cpu --engines 2" --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (spawned children, not multiprocessing's tracker)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                pids.append(int(child))
    return sorted(pids)


async def stream(url: str, uid: str, seconds: float, started: asyncio.Event) -> str:
    """One utterance to its end: 'done', or the error code that ended it."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()  # ready
        params = {"max_duration_s": seconds, "seed": 1}
        await ws.send(
            json.dumps({"type": "speak", "id": uid, "text": "A long run.", "params": params})
        )
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            data = json.loads(message)
            if data["type"] == "audio":
                started.set()
            elif data["type"] == "done":
                return "done"
            elif data["type"] == "error":
                return data["code"]


async def run(args, base: str, server: subprocess.Popen) -> dict:
    events = [asyncio.Event() for _ in range(args.streams)]
    tasks = [
        asyncio.create_task(stream(f"ws://{base}/v1/stream", f"s{i}", args.seconds, e))
        for i, e in enumerate(events)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
    victim = engine_pids(server.pid)[-1]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    await asyncio.sleep(1.0)
    ready_status, ready = await asyncio.to_thread(_get, f"http://{base}/ready")
    ends = await asyncio.gather(*tasks)
    back = None
    while time.monotonic() - killed_at < 300:
        status, body = await asyncio.to_thread(_get, f"http://{base}/ready")
        engines = body.get("engines", {}) if isinstance(body, dict) else {}
        if status == 200 and engines.get("ready") == engines.get("total"):
            back = time.monotonic() - killed_at
            break
        await asyncio.sleep(0.2)
    _, metrics = await asyncio.to_thread(_get, f"http://{base}/metrics")
    restarts = {
        line.split('engine="')[1].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("clonecast_engine_restarts_total{")
    }
    return {
        "ends": Counter(ends),
        "ready_after_kill": (
            ready_status,
            ready.get("engines") if isinstance(ready, dict) else ready,
        ),
        "back_s": back,
        "restarts": restarts,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-args", default="--device cpu --engines 2")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0, help="each stream's max_duration_s")
    args = ap.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    cmd += shlex.split(args.serve_args)
    server = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    base = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if _get(f"http://{base}/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server was not ready in 600 s"
            time.sleep(0.5)
        result = asyncio.run(run(args, base, server))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    ends = result["ends"]
    print(f"streams: {args.streams}; ended: {dict(ends)}")
    print(f"/ready 1 s after the kill: {result['ready_after_kill']}")
    print(f"all engines ready again after: {result['back_s']} s; restarts: {result['restarts']}")
    ok = (
        set(ends) <= {"done", "generation_failed"}
        and 0 < ends["generation_failed"] < args.streams
        and result["ready_after_kill"][0] == 200
        and result["back_s"] is not None
        and sorted(result["restarts"].values()).count(1.0) == 1
    )
    print("VERDICT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
