"""Server-wide limits over real sockets: connection capacity (4429), idle timeout (4408),
a full engine queue (over_capacity), and a client that stops reading (slow_consumer) while
the server's memory stays bounded and other clients are served."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from .conftest import (
    assert_alive,
    check_complete,
    collect,
    open_ws,
    recv_json,
    recv_until,
    run,
    scrape,
    speak,
    summed,
    wait_engine_idle,
)


async def _closed_with(ws, timeout: float = 10.0) -> tuple[int | None, list]:
    """Reads until the server closes; returns its close code and what arrived before."""
    got = []
    with pytest.raises(ConnectionClosed):
        while True:
            got.append(await asyncio.wait_for(ws.recv(), timeout))
    return ws.close_code, got


def test_over_capacity_connection_gets_error_then_4429(make_server):
    server = make_server(max_connections=1)

    async def main():
        async with open_ws(server.ws) as first:
            async with connect(server.ws, open_timeout=30) as second:
                err = await recv_json(second)
                code, rest = await _closed_with(second)
            await assert_alive(first)  # the admitted connection is unaffected
        # the slot is released once the first connection is gone
        deadline = time.monotonic() + 10
        while True:
            async with connect(server.ws, open_timeout=30) as third:
                message = await recv_json(third)
                if message["type"] == "ready":
                    await assert_alive(third)
                    break
            assert time.monotonic() < deadline, "the closed connection still counts"
            await asyncio.sleep(0.1)
        return err, code, rest

    err, code, rest = run(main())
    assert err["type"] == "error" and err["code"] == "over_capacity"
    assert code == 4429 and rest == []


@pytest.fixture(scope="module")
def idle_server(make_server):
    return make_server(idle_timeout_s=1)


def test_idle_connection_closes_with_4408(idle_server):
    async def main():
        t0 = time.monotonic()  # before the server's idle clock starts (at its accept)
        async with open_ws(idle_server.ws) as ws:
            code, got = await _closed_with(ws)
            return code, got, time.monotonic() - t0

    code, got, waited = run(main())
    assert code == 4408 and got == []
    assert 0.8 <= waited <= 5.0


def test_messages_and_running_audio_keep_a_connection_open(idle_server):
    async def main():
        async with open_ws(idle_server.ws) as ws:
            for _ in range(10):  # 2 s of pings, each well within the 1 s timeout
                await asyncio.sleep(0.2)
                await assert_alive(ws)
            # An utterance whose generation outlasts the idle timeout is not cut off. How long
            # generating takes depends on the host (6 s of audio took 0.96 s on a fast one):
            # the utterance grows until one outlasts the timeout twice over, on any host.
            for seconds in (20.0, 81.6):
                await ws.send(speak(f"long-{seconds}", dur=seconds, seed=3))
                t0 = time.monotonic()
                u = (await collect(ws, [f"long-{seconds}"]))[f"long-{seconds}"]
                generating = time.monotonic() - t0
                check_complete(u)
                if generating > 2.0:
                    break
            code, got = await _closed_with(ws)
            return generating, code, got

    generating, code, got = run(main())
    if generating <= 2.0:
        pytest.fail(f"81.6 s of audio took {generating:.2f} s: this host cannot test the timeout")
    assert code == 4408 and got == []


def test_an_append_waiting_for_more_text_does_not_keep_the_connection_open(idle_server):
    """An `append` utterance never flushed, whose text so far has been spoken, waits for its
    client: the connection idles out as if it had none (the utterance is cancelled)."""
    opening = {"type": "append", "id": "w", "text": "Hello there. And", "params": {"seed": 1}}
    opening["params"]["max_duration_s"] = 0.4

    async def main():
        async with open_ws(idle_server.ws) as ws:
            await ws.send(json.dumps(opening))
            return await _closed_with(ws, timeout=60)

    code, got = run(main())
    kinds = [json.loads(m)["type"] for m in got if isinstance(m, str)]
    assert code == 4408
    assert kinds[0] == "started" and "audio" in kinds and "done" not in kinds


def test_full_engine_queue_is_over_capacity(make_server):
    server = make_server(max_num_seqs=1, max_waiting_requests=1)

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("q1", dur=4.0, seed=1))
            await ws.send(speak("q2", dur=1.0, seed=2))  # waits: one sequence at a time
            sent = []

            async def hook(message):
                if message["type"] == "audio" and not sent:  # q2 is waiting by now
                    sent.append(True)
                    await ws.send(speak("q3", dur=1.0, seed=3))

            return await collect(ws, ["q1", "q2", "q3"], timeout=90, hook=hook)

    async def http_while_full():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("h1", dur=4.0, seed=1))
            await ws.send(speak("h2", dur=1.0, seed=2))
            await recv_until(ws, "audio", id="h1")
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(
                    server.http + "/v1/audio/speech", json={"input": "Hi.", "max_duration_s": 1}
                )
            await ws.send(json.dumps({"type": "cancel", "id": "h1"}))
            await ws.send(json.dumps({"type": "cancel", "id": "h2"}))
            return r

    utts = run(main())
    assert [e["code"] for e in utts["q3"].errors] == ["over_capacity"]
    assert utts["q3"].errors[0]["id"] == "q3"
    check_complete(utts["q1"])
    check_complete(utts["q2"])
    r = run(http_while_full())
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "over_capacity"
    wait_engine_idle(server)


def _stalled_socket(server) -> socket.socket:
    """A TCP connection that holds almost nothing in flight: a 4 KiB receive buffer, and a
    small MSS so the server's kernel send buffer stays small too."""
    port = int(server.http.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def test_slow_reader_is_ended_with_slow_consumer(make_server):
    limit = 100_000
    server = make_server(max_buffered_audio_bytes=limit)
    dur = 20.0

    async def main():
        sock = _stalled_socket(server)
        async with connect(server.ws, sock=sock, max_queue=1, compression=None) as slow:
            assert (await recv_json(slow))["type"] == "ready"
            return await stalled(slow)

    async def stalled(slow):
        await slow.send(speak("slow", "Talk for a long time.", dur=dur, seed=1))
        # stop reading: wait until the server gives up on the utterance
        deadline = time.monotonic() + 30
        slow_consumer = 'clonecast_errors_total{code="slow_consumer",transport="websocket"}'
        while scrape(server).get(slow_consumer, 0) < 1:
            assert time.monotonic() < deadline, "no slow_consumer while the client is stalled"
            await asyncio.sleep(0.2)
        # still not reading: the engine is free again, nothing grows
        await asyncio.to_thread(wait_engine_idle, server, 10)
        # another client is served normally meanwhile
        async with open_ws(server.ws) as other:
            await other.send(speak("fast", dur=1.0, seed=2))
            fast = (await collect(other, ["fast"]))["fast"]
        # now read everything the stalled client was sent
        err, before = await recv_until(slow, "error", timeout=30)
        extra = await assert_alive(slow)
        return fast, err, before, extra

    fast, err, before, extra = run(main())
    check_complete(fast)
    assert len(fast.payload) == 48000
    assert err["code"] == "slow_consumer" and err["id"] == "slow"
    assert str(limit) in err["message"]
    messages = [m for m in before if isinstance(m, dict)]
    assert messages[0] == {"type": "started", "id": "slow", "segments": 1}
    assert messages[1]["type"] == "segment" and messages[1]["index"] == 0  # its caption
    audio = messages[2:]
    assert all(m["type"] == "audio" and m["id"] == "slow" for m in audio)
    assert not any(m["last"] for m in audio)
    sent = sum(m["bytes"] for m in audio)
    assert sent < dur * 48000 / 2, "the utterance should have been ended early"
    assert extra == [], "nothing (no done, no audio) follows the slow_consumer error"
    m = wait_engine_idle(server)
    assert summed(m, "clonecast_num_requests_running") == 0
