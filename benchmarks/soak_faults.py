"""The soak's faults and bad inputs (benchmarks/soak.py): clients that vanish mid-stream
(over the WebSocket, with or without a close frame, and over streamed HTTP), and bad inputs
over both transports, each with the error code docs/protocol.md gives it. Every bad input
leaves the connection open: the next scenario reuses it, so a connection a bad input broke
fails that scenario."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time

import numpy as np

from benchmarks.soak_conn import (
    Conn,
    Unexpected,
    UtteranceReader,
    expect_error,
    until_first_audio,
)
from benchmarks.soak_load import Client, expect_done, utterance


def _wav(samples: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), 24000, format="WAV")
    return buf.getvalue()


SILENT_WAV = _wav(np.zeros(24000 * 2))
GARBAGE = os.urandom(6000)  # no container any decoder knows
OVERSIZE = 8 * 1024 * 1024 + 1024  # over max_message_bytes (8 MiB), under twice it (1009)


async def disconnect(c: Client) -> list[str]:
    """A connection of its own, one utterance, gone after its first audio: half the time
    without a close frame (a vanished client), half with one (a closed tab)."""
    conn, uid = await Conn.open(c.load.ws_url), c.next_id()
    queue = conn.expect(uid, "r" + uid)
    message = c.speak(uid, voice_id=c.rng.choice(c.load.voice_ids))
    message["params"]["max_duration_s"] = 6.0
    await conn.send(message)
    reader = UtteranceReader(queue, uid)
    end = asyncio.create_task(reader.until_end(time.monotonic() + 60))
    try:
        await until_first_audio(reader, end, 60)
        if not reader.first_audio.is_set():
            raise Unexpected("no audio before the utterance ended or in 60 s")
    finally:
        end.cancel()
        if c.rng.random() < 0.5:
            conn.abort()
        await conn.close()
        await asyncio.gather(end, return_exceptions=True)  # its end is the closed connection
    return ["disconnected"]


async def http_disconnect(c: Client) -> list[str]:
    """A streamed speech request whose client leaves after the first bytes."""
    body = {"input": "One moment please. I am looking that up.", "stream": True}
    body.update(c.params(6.0), response_format="pcm")
    async with c.http.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise Unexpected(f"streamed speech answered {response.status_code}")
        async for chunk in response.aiter_raw():
            if chunk:
                break
    return ["disconnected"]


def _speak(c: Client, uid: str, **changes) -> dict:
    message = c.speak(uid)
    for key, value in changes.items():
        if key in ("params", "output"):
            message[key] = {**message.get(key, {}), **value}
        elif value is None:
            message.pop(key)
        else:
            message[key] = value
    return message


def _bad_ws_messages(c: Client, uid: str) -> list[tuple[str, object, str]]:
    """(what, message, code); each message carries request_id r<uid> when it can."""
    rid = "r" + uid
    b64 = base64.b64encode
    return [
        ("broken_json", '{"type": "speak", "id": "' + uid, "bad_json"),
        ("unknown_type", {"type": "sing", "request_id": rid}, "unknown_type"),
        ("negative_temperature", _speak(c, uid, params={"temperature": -1}), "bad_parameter"),
        ("repetition_penalty", _speak(c, uid, params={"repetition_penalty": 1.1}), "bad_parameter"),
        ("format_aac", _speak(c, uid, output={"format": "aac"}), "bad_parameter"),
        ("rate_12345", _speak(c, uid, output={"sample_rate": 12345}), "bad_parameter"),
        ("empty_text", _speak(c, uid, text="  "), "empty_text"),
        ("text_too_long", _speak(c, uid, text="a " * 2600), "text_too_long"),
        ("missing_text", _speak(c, uid, text=None), "bad_request"),
        ("unknown_voice", _speak(c, uid, voice_id="v_00000000000000000000"), "unknown_voice"),
        ("cancel_unknown", {"type": "cancel", "id": uid, "request_id": rid}, "unknown_id"),
        (
            "garbage_audio",
            {"type": "voice.create", "audio_b64": b64(GARBAGE).decode(), "request_id": rid},
            "audio_undecodable",
        ),
        (
            "silent_audio",
            {"type": "voice.create", "audio_b64": b64(SILENT_WAV).decode(), "request_id": rid},
            "audio_silent",
        ),
        ("unexpected_binary", GARBAGE, "unexpected_binary"),
        (
            "oversize_frame",
            '{"type": "ping", "pad": "' + "x" * OVERSIZE + '"}',
            "message_too_large",
        ),
    ]


async def bad_ws(c: Client) -> list[str]:
    """One bad message, its error (matched by request_id, or the one error of the connection
    naming no request when the message could not be read), and the connection still works."""
    conn, uid = await c.connection(), c.next_id()
    what, message, code = c.rng.choice(_bad_ws_messages(c, uid))
    readable = isinstance(message, dict)
    queue = conn.expect(uid, "r" + uid) if readable else conn.general
    try:
        await conn.send(message)
        outcome = await expect_error(queue, code, time.monotonic() + 60)
    finally:
        conn.forget(uid, "r" + uid)
    return [outcome]


async def bad_upload(c: Client) -> list[str]:
    """`voice.upload` announcing N bytes, then N bytes of no known format."""
    conn, rid = await c.connection(), c.next_id("r")
    queue = conn.expect(rid)
    try:
        upload = {
            "type": "voice.upload",
            "bytes": len(GARBAGE),
            "transcript": "Hi.",
            "request_id": rid,
        }
        await conn.send(upload)
        await conn.send(GARBAGE)
        return [await expect_error(queue, "audio_undecodable", time.monotonic() + 60)]
    finally:
        conn.forget(rid)


async def duplicate_id(c: Client) -> list[str]:
    """A speak under the id of a running one: `duplicate_id` (by request_id); the first
    utterance is unharmed."""
    conn, uid = await c.connection(), c.next_id()
    queue = conn.expect("d" + uid)
    first = utterance(conn, c.speak(uid))
    again = {**c.speak(uid), "request_id": "d" + uid}
    task = asyncio.create_task(first)
    await asyncio.sleep(0)  # the first speak is on the wire before the second
    try:
        await conn.send(again)
        refused = await expect_error(queue, "duplicate_id", time.monotonic() + 60)
    finally:
        conn.forget("d" + uid)
    return [*expect_done(await task), refused]


def _bad_http(c: Client) -> list[tuple[str, str, object, int, str]]:
    """(what, path, body (dict: JSON), status, code)."""
    speech = "/v1/audio/speech"
    return [
        ("broken_json", speech, b'{"input": "hi', 400, "bad_json"),
        ("unknown_field", speech, {"input": "Hi.", "bogus": 1}, 400, "unknown_field"),
        ("speed", speech, {"input": "Hi.", "speed": 2.0}, 400, "bad_parameter"),
        ("format_aac", speech, {"input": "Hi.", "response_format": "aac"}, 400, "bad_parameter"),
        ("top_p_zero", speech, {"input": "Hi.", "top_p": 0}, 400, "bad_parameter"),
        ("empty_input", speech, {"input": ""}, 400, "empty_text"),
        (
            "unknown_voice",
            speech,
            {"input": "Hi.", "voice": "v_00000000000000000000"},
            404,
            "unknown_voice",
        ),
        ("oversize", speech, {"input": "x" * OVERSIZE}, 413, "message_too_large"),
        ("garbage_voice", "/v1/voices?transcript=Hi.", GARBAGE, 400, "audio_undecodable"),
    ]


async def bad_http(c: Client) -> list[str]:
    what, path, body, status, code = c.rng.choice(_bad_http(c))
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"content-type": "application/json" if isinstance(body, dict) else "audio/wav"}
    response = await c.http.post(path, content=content, headers=headers)
    got = response.json().get("error", {}).get("code") if response.content else None
    if (response.status_code, got) != (status, code):
        raise Unexpected(f"{what}: expected {status} {code}, got {response.status_code} {got}")
    return ["error:" + code]


FAULTS = {  # name: (scenario, weight)
    "disconnect": (disconnect, 5),
    "http_disconnect": (http_disconnect, 3),
    "bad_ws": (bad_ws, 10),
    "bad_upload": (bad_upload, 1),
    "duplicate_id": (duplicate_id, 2),
    "bad_http": (bad_http, 6),
}
