"""Guards below the ASGI app, where uvicorn offers none: a deadline for an HTTP request's head
(uvicorn's keep-alive timer stops at a request's first byte and is not armed before the first
request, so a client sending its headers a byte at a time, or nothing at all, held a
connection forever) and for the rest of a body answered before it was read; a rate for
WebSocket ping frames (answered by the protocol layer, never seen by the app). Subclasses of
uvicorn's h11 and websockets-sansio protocols (pinned by tests/service/test_slow_clients.py
and test_ws_frames.py); what they guard is configured in service/config.py.
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
    """What an HTTP connection waits for from its client must come within `header_timeout_s`:
    the next request's head (from the connection opening or the previous answer), else 408
    `request_timeout` when part of a head came, a silent close when nothing did (an idle
    keep-alive connection, as uvicorn's own keep-alive timer closes it); and the rest of a
    body already answered (a 413 sent before a large body was read), else a close. While a
    request is being served, service/http_api.py's read_body bounds its body."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:
        self._timer, self._timer_phase = None, None
        super().connection_made(transport)
        self._rearm()

    def handle_events(self) -> None:
        super().handle_events()
        self._rearm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._rearm()

    def connection_lost(self, exc) -> None:
        self._set_timer(None)
        super().connection_lost(exc)

    def _phase(self) -> str | None:
        """ "head" (of the next request), "rest" (of a body answered early), or None (a
        request is being served: no deadline here)."""
        if self.conn.their_state is h11.IDLE:
            return "head"
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state is h11.DONE:
            return "rest"
        return None

    def _rearm(self) -> None:
        """A deadline per phase: it runs from the phase's start, not from the last byte."""
        phase = None if self.transport.is_closing() else self._phase()
        if phase != self._timer_phase:
            self._set_timer(phase)

    def _set_timer(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_phase = phase
        self._timer = None
        if phase is not None:
            self._timer = self.loop.call_later(self.header_timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._phase() != self._timer_phase:
            return
        partial, _ = self.conn.trailing_data  # bytes of a head that has not completed
        if self._timer_phase == "head" and partial:
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
        reason = "rate_limited: too many pings"
        self.conn.fail(CLOSE_POLICY, reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        # the app learns why (its metrics count the close as rate_limited)
        self.queue.put_nowait(
            {"type": "websocket.disconnect", "code": CLOSE_POLICY, "reason": reason}
        )
        self.close_sent = True
        self.transport.close()
