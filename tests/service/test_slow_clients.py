"""Slow and idle HTTP clients over raw sockets: a request head or body that arrives too slowly
is answered 408 `request_timeout` and its connection closed, a connection that never speaks
is closed, and other clients are served all along (service/transport_guards.py, the body
deadline of service/http_api.py's read_body). Timeouts made small for the test."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from .conftest import collect, connect_ready, open_ws, run, speak

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(
        header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S, idle_timeout_s=1.0
    )


def _socket(server) -> socket.socket:
    port = int(server.http.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _read_to_close(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _get_health(sock: socket.socket) -> bytes:
    """GET /health on a kept-alive connection; its whole response (head and body)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return data


def _json_body(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])


def _served(server) -> None:
    r = httpx.get(server.http + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_head_sent_a_byte_at_a_time_gets_408_and_others_are_served(srv):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with _socket(srv) as sock:
        t0 = time.monotonic()
        for i, byte in enumerate(head):  # a byte every 0.2 s: the head would take 45 s
            if select.select([sock], [], [], 0.2)[0]:  # the server answered (or closed)
                break
            sock.sendall(bytes([byte]))
            if i % 3 == 0:
                _served(srv)  # meanwhile other clients are answered
        else:
            pytest.fail("the server waited for the whole slow head")
        closed_after = time.monotonic() - t0
        response = _read_to_close(sock)
    assert response.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in response.lower()
    assert _json_body(response)["error"]["code"] == "request_timeout"
    assert HEADER_TIMEOUT_S * 0.8 <= closed_after <= HEADER_TIMEOUT_S + 15
    _served(srv)


def test_the_next_head_on_a_kept_alive_connection_has_the_same_deadline(srv):
    with _socket(srv) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # and never the rest
        response = _read_to_close(sock)
    assert response.startswith(b"HTTP/1.1 408 ")
    assert _json_body(response)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    "path", ["/v1/voices", "/v1/audio/speech", "/v1/tokens"], ids=["voices", "speech", "tokens"]
)
def test_a_body_that_stops_arriving_gets_408_and_the_connection_ends(srv, path):
    with _socket(srv) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"input": "Hel')  # 14 of its 1000 bytes, then nothing
        t0 = time.monotonic()
        _served(srv)
        response = _read_to_close(sock)
        waited = time.monotonic() - t0
    assert response.startswith(b"HTTP/1.1 408 "), response[:200]
    assert _json_body(response)["error"]["code"] == "request_timeout"
    assert waited <= BODY_TIMEOUT_S + 15


def test_a_body_trickled_after_its_answer_does_not_hold_the_connection(srv):
    """A body refused before it was read (413: its length is over the limit) and then sent a
    byte at a time: the connection is closed once the head deadline has passed again."""
    with _socket(srv) as sock:
        head = "POST /v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
        sock.sendall(head.encode())
        t0 = time.monotonic()
        got = b""
        for _ in range(300):  # a byte every 0.1 s: the body would take hours
            if select.select([sock], [], [], 0.1)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            pytest.fail("the server kept reading a body it had answered")
        waited = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 413 ")
    assert HEADER_TIMEOUT_S * 0.8 <= waited <= HEADER_TIMEOUT_S + 15


def test_a_body_trickled_within_the_deadline_is_read(srv):
    """The deadline bounds the whole body, not a fast one: a small body in a few pieces."""
    body = json.dumps({"ttl_s": 60}).encode()
    with _socket(srv) as sock:
        head = f"POST /v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode())
        for i in range(0, len(body), 4):
            sock.sendall(body[i : i + 4])
            time.sleep(0.02)
        sock.settimeout(30)
        response = sock.recv(65536)
    assert response.startswith(b"HTTP/1.1 201 "), response[:200]


def test_many_idle_connections_are_closed_and_others_served_meanwhile(srv):
    """Never-speaking TCP connections, kept-alive HTTP connections and WebSockets that say
    nothing: while they are open a speak is answered in full, then the server closes every
    one of them by itself (head deadline, keep-alive, idle_timeout_s)."""
    silent = [_socket(srv) for _ in range(30)]
    kept_alive = []
    for _ in range(10):
        sock = _socket(srv)
        assert _get_health(sock).startswith(b"HTTP/1.1 200 ")
        kept_alive.append(sock)

    async def main():
        idle = [await connect_ready(srv.ws) for _ in range(10)]
        async with open_ws(srv.ws) as ws:
            await ws.send(speak("u", dur=0.4))
            utts = await collect(ws, ["u"], timeout=120)
        for ws in idle:
            await ws.wait_closed()  # by the server: idle_timeout_s
        return utts["u"], [ws.close_code for ws in idle]

    utt, codes = run(main())
    assert utt.done is not None and utt.errors == []
    assert codes == [4408] * 10
    t0 = time.monotonic()
    for sock in silent + kept_alive:
        assert _read_to_close(sock) == b"", "an idle connection got an answer"
        sock.close()
    assert time.monotonic() - t0 <= 30
    _served(srv)


def test_a_head_too_large_to_hold_is_refused_at_once(srv):
    """A head that grows past h11's 16 KiB (headers without an end) is answered 400 before
    its deadline: the server never buffers an endless head."""
    with _socket(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
        response = _read_to_close(sock)
    assert response.startswith(b"HTTP/1.1 400 "), response[:200]  # for its size, not a 408
