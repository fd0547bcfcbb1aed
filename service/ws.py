"""The WebSocket endpoint `/v1/stream`: authentication, origin and capacity checks, the
receive loop with its idle timeout and message rate limit, and clean-up when the client goes
away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from clonecast_client.wire import (
    CLOSE_CAPACITY,
    CLOSE_FORBIDDEN,
    CLOSE_IDLE,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    CLOSE_UNAUTHORIZED,
    PROTOCOL,
)
from engine import FRAME_MS, SAMPLE_RATE, AudioLimits, StreamConfig
from service.auth import OPEN, Caller, caller_for, extract_key, origin_allowed
from service.message_rate import CLOSE, MessageRate, retry_after_s
from service.protocol import as_object
from service.session import Session
from service.tokens import TokenError

log = logging.getLogger("clonecast.ws")
STREAM = StreamConfig()  # the service's chunk sizes: the engine's defaults


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int, services) -> None:
    services.metrics.errors.labels(code, "websocket").inc()
    await ws.send_text(json.dumps({"type": "error", "code": code, "message": message}))
    await ws.close(close_code, message[:120])


async def stream_endpoint(ws: WebSocket) -> None:
    services = ws.app.state.services
    settings = services.settings
    offered = [
        p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()
    ]
    await ws.accept(subprotocol=PROTOCOL if PROTOCOL in offered else None)
    caller = _authenticate(ws, offered, services)
    if isinstance(caller, str):
        return await _refuse(ws, "unauthorized", caller, CLOSE_UNAUTHORIZED, services)
    if not origin_allowed(ws.headers.get("origin"), settings.allowed_origins):
        return await _refuse(
            ws, "forbidden_origin", "this origin is not allowed", CLOSE_FORBIDDEN, services
        )
    # still loading, or draining (1012, service restart: reconnect, to another server); a
    # connection made while the engine restarts is kept (its utterances wait for /ready)
    refusal = services.refusal(engine=services.draining)
    if refusal is not None:
        close_code = CLOSE_SERVICE_RESTART if refusal[0] == "draining" else CLOSE_CAPACITY
        return await _refuse(ws, *refusal, close_code, services)
    if services.connections >= settings.limits.max_connections:
        return await _refuse(
            ws,
            "over_capacity",
            "the server has no room for another connection",
            CLOSE_CAPACITY,
            services,
        )
    services.connections += 1
    services.metrics.connections.set(services.connections)
    session = Session(ws, services, caller)
    services.sessions.add(session)
    sender = asyncio.create_task(session.sender())
    reason = "client_lost"
    try:
        session.send_json(_ready_message(session, services))
        reason = await _receive_loop(ws, session, sender)
    except WebSocketDisconnect as exc:
        reason = _close_reason(exc.code, exc.reason)
    finally:
        services.metrics.closes.labels(reason).inc()
        session.close()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        services.connections -= 1
        services.sessions.discard(session)
        services.metrics.connections.set(services.connections)


def _close_reason(code: int | None, reason: str | None = None) -> str:
    """A close frame with 1000 (normal) or 1001 (going away) is the client closing; 1008 with
    a `rate_limited` reason the transport closing a ping flood (service/transport_guards.py);
    any other code, or none (1005, 1006: no close frame), is a client lost."""
    if code == CLOSE_POLICY and (reason or "").startswith("rate_limited"):
        return "rate_limited"
    return "client_closed" if code in (1000, 1001) else "client_lost"


async def _receive_loop(ws: WebSocket, session: Session, sender: asyncio.Task) -> str:
    """Serves the connection until it ends; returns why (a CLOSE_REASONS of the metrics)."""
    limits = session.limits
    idle = limits.idle_timeout_s
    rate = MessageRate(limits.max_messages_per_s, limits.message_burst)
    receive = None
    while True:
        receive = receive or asyncio.ensure_future(ws.receive())  # kept across idle checks
        done, _ = await asyncio.wait(
            {receive, sender}, timeout=idle, return_when=asyncio.FIRST_COMPLETED
        )
        if sender in done:  # the socket failed while sending
            receive.cancel()
            return "client_lost"
        if not done:
            if any(not u.waiting_for_text for u in session.utterances.values()):
                continue  # audio is still being produced: not idle
            receive.cancel()
            await ws.close(CLOSE_IDLE, f"idle for {idle:g} s")
            return "idle_timeout"
        message, receive = receive.result(), None
        if message["type"] == "websocket.disconnect":
            return _close_reason(message.get("code"), message.get("reason"))
        wait = rate.take()
        if wait == CLOSE:  # it went on at full speed after being told
            await ws.close(CLOSE_POLICY, "rate_limited: too many messages")
            return "rate_limited"
        if wait:
            _refuse_message(session, message, wait)
            continue
        if message.get("text") is not None:
            await session.on_text(message["text"])
        elif message.get("bytes") is not None:
            await session.on_bytes(message["bytes"])


def _refuse_message(session: Session, message: dict, wait: float) -> None:
    """A message over the connection's rate, refused unhandled: `rate_limited` with when to
    retry, and its request_id (never its `id`: an utterance it names goes on)."""
    limits = session.limits
    extra = {}
    text = message.get("text")
    if text is not None and len(text) <= 4096:  # a small message's request_id costs little
        value = as_object(text).get("request_id")
        if isinstance(value, str | int):
            extra["request_id"] = value
    session.send_error(
        "rate_limited",
        f"more than {limits.max_messages_per_s:g} messages a second (bursts of "
        f"{limits.message_burst}) on this connection: this one was not handled; send it again "
        "after retry_after_s",
        retry_after_s=retry_after_s(wait),
        **extra,
    )


def _authenticate(ws: WebSocket, offered: list[str], services) -> Caller | str:
    """Who connects (a Caller), or why the connection is refused: an API key, or a browser
    token that is unexpired, signed by this server's secret and (if bound) from its origin
    (its caller: the key that asked for it)."""
    token = ws.query_params.get("token")
    if token is not None:
        try:
            owner, name = services.tokens.verify(token, ws.headers.get("origin"))
        except TokenError as exc:
            return str(exc)
        return Caller(owner, name=name) if owner is not None else OPEN
    key = extract_key(ws.headers, ws.query_params, offered)
    caller = caller_for(key, services.keys)
    return caller if caller is not None else "a valid API key is required"


def _ready_message(session: Session, services) -> dict:
    limits = services.settings.limits
    return {
        "type": "ready",
        "protocol": PROTOCOL,
        "session_id": session.id,
        "model": services.model_info(),
        "audio": {
            "sample_rate": SAMPLE_RATE,
            "first_chunk_ms": STREAM.first_chunk_frames * FRAME_MS,
            "chunk_ms": STREAM.chunk_frames * FRAME_MS,
        },
        "limits": {
            "max_text_chars": limits.max_text_chars,
            "max_utterances": limits.max_utterances,
            "max_message_bytes": limits.max_message_bytes,
            "max_upload_bytes": limits.max_upload_bytes,
            "max_reference_seconds": int(AudioLimits().max_seconds),
            "idle_timeout_s": limits.idle_timeout_s,
            "max_buffered_audio_bytes": limits.max_buffered_audio_bytes,
            "max_messages_per_s": limits.max_messages_per_s,
            "message_burst": limits.message_burst,
        },
    }
