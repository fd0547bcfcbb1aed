"""Graceful drain (service/drain.py) of `clonecast serve` as a process manager stops it: on
SIGTERM `/ready` turns 503 at once, new utterances (on an open connection, over HTTP) and
new connections are refused with `draining`, a running utterance that ends within the
drain timeout is heard to its `done`, one that does not is ended with `draining`, and the
process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.serve_process import start_serve
from tests.service.conftest import collect, open_ws, recv_until, run, speak


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals")
def test_sigterm_drains_running_streams_refuses_new_work_and_exits_0(tmp_path):
    server, http, log = start_serve(tmp_path, CLONECAST_DRAIN_TIMEOUT_S="5")
    ws_url = http.replace("http://", "ws://") + "/v1/stream"

    async def main():
        async with open_ws(ws_url) as ws:
            # a short one that ends within the drain, a long one that cannot
            await ws.send(speak("short", "A short one.", dur=3.0))
            await ws.send(speak("long", "A very long one that cannot end in time.", dur=80))
            await recv_until(ws, "audio", timeout=120, id="long")
            assert isinstance(await ws.recv(), bytes)
            t_signal = time.monotonic()
            server.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient() as client:
                deadline = time.monotonic() + 5
                while (await client.get(http + "/ready", timeout=5)).status_code != 503:
                    assert time.monotonic() < deadline, "/ready did not turn 503"
                    await asyncio.sleep(0.05)
                ready = await client.get(http + "/ready", timeout=5)
                health = await client.get(http + "/health", timeout=5)
                refused = await client.post(
                    http + "/v1/audio/speech", json={"input": "late"}, timeout=10
                )
            refused_connection = await _refused_connection(ws_url)
            await ws.send(speak("late", "Too late.", dur=0.4))
            utts = await collect(ws, ["short", "long", "late"], timeout=60)
            closed = await _close_code(ws)
            return ready, health, refused, refused_connection, utts, closed, t_signal

    ready, health, refused, refused_connection, utts, closed, t_signal = run(main())
    server.wait(timeout=60)
    output = log.read_text()
    assert ready.json()["error"]["code"] == "draining"
    assert health.status_code == 200 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert refused_connection == ("draining", 1012)
    assert [e["code"] for e in utts["late"].errors] == ["draining"]
    assert utts["short"].errors == [] and utts["short"].done is not None
    assert utts["short"].payload
    assert utts["long"].done is None and [e["code"] for e in utts["long"].errors] == ["draining"]
    assert utts["long"].payload  # it streamed until the deadline
    assert closed == 1012
    assert time.monotonic() - t_signal < 5 + 30
    assert server.returncode == 0, output[-2000:]
    assert "drained: 1 utterances finished, 1 ended" in output, output[-2000:]


async def _refused_connection(url: str) -> tuple[str, int]:
    async with connect(url, open_timeout=30) as ws:
        message = json.loads(await asyncio.wait_for(ws.recv(), 30))
        code = await _close_code(ws)
    return message["code"], code


async def _close_code(ws) -> int | None:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 30)
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else None
