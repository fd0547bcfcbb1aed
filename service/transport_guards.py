"""Guards below the ASGI app, where uvicorn offers none: a deadline for an HTTP request's head
(uvicorn's keep-alive timer stops at a request's first byte and is not armed before the first
request, so a client sending its headers a byte at a time, or nothing at all, held a
connection forever), and a rate for WebSocket ping frames (answered by the protocol layer,
never seen by the app). Subclasses of uvicorn's h11 and websockets protocols (pinned by
tests/service/test_slow_clients.py); what they guard is configured in service/config.py.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from clonecast_client.wire import CLOSE_POLICY
from service.config import Limits
from service.message_rate import TokenBucket


def guarded_protocols(limits: Limits) -> dict:
    """uvicorn.Config's `http` and `ws` protocol classes, configured from `limits`."""
    http = type("GuardedH11", (HeaderDeadline,), {"header_timeout_s": limits.header_timeout_s})
    ws = type(
        "GuardedWebSocket",
        (PingRate,),
        {"max_pings_per_s": limits.max_messages_per_s, "ping_burst": limits.message_burst},
    )
    return {"http": http, "ws": ws}


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "code": "request_timeout",
                "message": f"the request's headers did not arrive within {timeout_s:g} s",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeaderDeadline(H11Protocol):
    """An HTTP connection whose next request's head has not arrived `header_timeout_s` after
    the connection opened or the previous response ended is closed: with 408
    `request_timeout` when part of a head came, silently when nothing did (an idle
    keep-alive connection, as uvicorn's own keep-alive timer closes it)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head arrived (or the socket failed)
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._cancel_head_timer()  # the next request's head, from now
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data  # bytes of a head that has not completed
        if partial:
            self.logger.info("closing a connection whose request head took too long")
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


class PingRate(WebSocketsSansIOProtocol):
    """Ping frames over `max_pings_per_s` (bursts of `ping_burst`) close the connection with
    1008: a client needs one every few seconds at most, and each costs a pong write even when
    the client reads none of them."""

    max_pings_per_s: float = 50.0
    ping_burst: int = 100

    def handle_ping(self) -> None:
        bucket = getattr(self, "_pings", None)
        if bucket is None:
            bucket = self._pings = TokenBucket(self.max_pings_per_s, self.ping_burst)
        if not bucket.take():
            super().handle_ping()
            return
        if self.close_sent or self.transport.is_closing():
            return
        self.conn.fail(CLOSE_POLICY, "rate_limited: too many pings")
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.transport.close()
