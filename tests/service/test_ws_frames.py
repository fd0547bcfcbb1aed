"""Abusive WebSocket clients over raw sockets: malformed frames close that connection with the
right close code, a flood of messages is `rate_limited` (then closed with 1008 if it goes
on), a flood of ping frames is closed with 1008; other connections are served all along."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import time

import pytest
from websockets.exceptions import ConnectionClosed

from .conftest import assert_alive, open_ws, recv_json, run, scrape

MAX_MESSAGE = 4096  # so the transport's frame limit is 8 KiB
RATE_PER_S = 0.2  # a token every 5 s: a burst is never refilled while the test sends it
BURST = 3


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(
        max_message_bytes=MAX_MESSAGE, max_messages_per_s=RATE_PER_S, message_burst=BURST
    )


def _handshake(server) -> socket.socket:
    """A raw TCP connection upgraded to the WebSocket, its `ready` message read."""
    port = int(server.http.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            "GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(4096)
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 "), head
    opcode, payload, _ = _read_frame(sock, rest)
    assert opcode == 0x1 and json.loads(payload)["type"] == "ready"
    return sock


def _read_frame(sock: socket.socket, buf: bytes = b"") -> tuple[int, bytes, bytes]:
    """One server frame (never masked): (opcode, payload, bytes read beyond it)."""

    def need(n: int) -> None:
        nonlocal buf
        while len(buf) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before a whole frame")
            buf += chunk

    need(2)
    opcode, length, at = buf[0] & 0x0F, buf[1] & 0x7F, 2
    if length == 126:
        need(4)
        length, at = struct.unpack(">H", buf[2:4])[0], 4
    elif length == 127:
        need(10)
        length, at = struct.unpack(">Q", buf[2:10])[0], 10
    need(at + length)
    return opcode, buf[at : at + length], buf[at + length :]


def _frame(opcode: int, payload: bytes, fin: bool = True, mask: bool = True, rsv: int = 0):
    first = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    if n < 126:
        head = struct.pack(">BB", first, (0x80 if mask else 0) | n)
    else:
        head = struct.pack(">BBH", first, (0x80 if mask else 0) | 126, n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def _close_code(sock: socket.socket) -> int:
    """Reads frames until the server's close frame; its code."""
    rest = b""
    while True:
        opcode, payload, rest = _read_frame(sock, rest)
        if opcode == 0x8:
            return struct.unpack(">H", payload[:2])[0]


BAD_FRAMES = {
    "reserved-opcode": (_frame(0x3, b"hi"), 1002),
    "unmasked": (_frame(0x1, b'{"type":"ping"}', mask=False), 1002),
    "invalid-utf8-text": (_frame(0x1, b'{"type":"ping","x":"\xff\xfe"}'), 1007),
    "oversized": (_frame(0x2, b"\0" * (2 * MAX_MESSAGE + 1)), 1009),
    "fragmented-ping": (_frame(0x9, b"p", fin=False), 1002),
    "control-over-125-bytes": (_frame(0x9, b"p" * 126), 1002),
    "reserved-bit": (_frame(0x1, b'{"type":"ping"}', rsv=0x40), 1002),
    "continuation-first": (_frame(0x0, b"x"), 1002),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_malformed_frame_closes_its_connection_only(srv, name):
    frame, code = BAD_FRAMES[name]

    async def main():
        async with open_ws(srv.ws) as other:
            sock = _handshake(srv)
            with sock:
                sock.sendall(frame)
                got = _close_code(sock)
            await assert_alive(other)  # the other connection is unaffected
        return got

    assert run(main()) == code


def _counts_up_to(server, series: str, value: float, timeout: float = 20.0) -> None:
    """The series reaches `value` (the server counts a close once its handler has ended)."""
    deadline = time.monotonic() + timeout
    while (got := scrape(server)[series]) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got == value


def _pings(n: int) -> list[str]:
    return [json.dumps({"type": "ping", "request_id": f"p{i}"}) for i in range(n)]


def test_messages_over_the_rate_are_refused_with_rate_limited_then_served_again(srv):
    async def main():
        async with open_ws(srv.ws) as ws:
            for message in _pings(BURST + 2):
                await ws.send(message)
            got = [await recv_json(ws) for _ in range(BURST + 2)]
            refused = [m for m in got if m["type"] == "error"]
            await asyncio.sleep(max(m["retry_after_s"] for m in refused) + 0.1)
            await assert_alive(ws)  # served again once the bucket has refilled
            return got, refused

    got, refused = run(main())
    assert [m["type"] for m in got] == ["pong"] * BURST + ["error"] * 2
    assert [m["request_id"] for m in refused] == [f"p{BURST}", f"p{BURST + 1}"]
    for m in refused:
        assert m["code"] == "rate_limited" and "id" not in m
        assert 0 < m["retry_after_s"] <= 1 / RATE_PER_S
        assert "a second" in m["message"]


def test_a_client_that_floods_on_after_being_told_is_closed_with_1008(srv):
    closes = 'clonecast_websocket_closes_total{reason="rate_limited"}'
    before = scrape(srv).get(closes, 0.0)

    async def main():
        async with open_ws(srv.ws) as other:
            async with open_ws(srv.ws) as ws:
                with pytest.raises(ConnectionClosed):
                    for message in _pings(200):
                        await ws.send(message)
                    while True:
                        await recv_json(ws)
                code = ws.close_code
            await assert_alive(other)
        return code

    assert run(main()) == 1008
    _counts_up_to(srv, closes, before + 1)


def test_a_ping_frame_flood_is_closed_with_1008(srv):
    closes = 'clonecast_websocket_closes_total{reason="rate_limited"}'
    before = scrape(srv).get(closes, 0.0)

    async def main():
        async with open_ws(srv.ws) as other:
            sock = _handshake(srv)
            with sock:
                try:  # the server may close (and reset) before the last pings are written
                    sock.sendall(b"".join(_frame(0x9, b"ping") for _ in range(BURST + 5)))
                    got = _close_code(sock)
                except (ConnectionResetError, BrokenPipeError):
                    got = "reset"  # its close frame lost to the reset: the counter below tells
            await assert_alive(other)
        return got

    assert run(main()) in (1008, "reset")
    _counts_up_to(srv, closes, before + 1)  # closed for its rate, not for anything else
