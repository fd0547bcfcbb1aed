"""Python client for the clonecast WebSocket protocol `clonecast.v1` (docs/protocol.md).

Owns the client side of one connection: the handshake, one reader task that routes server
messages to utterances and pending requests, and the async API. Needs only the standard
library and `websockets`; it must not import torch, numpy or starlette. The synchronous
`Client` is `clonecast_client.sync`, a thin wrapper over `AsyncClient`.

    client = await AsyncClient.connect("ws://127.0.0.1:8737/v1/stream", api_key="KEY")
    async with client:
        voice = await client.create_voice(Path("me.wav").read_bytes(), "What I say in it.")
        utt = client.speak("Hello there.", voice_id=voice, params={"seed": 1})
        async for chunk in utt:  # Chunk(seq, data, last, start_ms, end_ms), PCM16 24 kHz
            play(chunk.data)
        print(utt.done["reason"], utt.done["stats"])

    with Client.connect("ws://127.0.0.1:8737/v1/stream", api_key="KEY") as client:
        client.speak("Hello again.").write_wav("hello.wav")
"""

from __future__ import annotations

import asyncio
import base64
import collections
import itertools
import json
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect as _ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from clonecast_client.wire import CLOSE_CODES, DEFAULT_SAMPLE_RATE, PROTOCOL, unpack_audio

DEFAULT_URL = "ws://127.0.0.1:8737/v1/stream"


class ClonecastError(Exception):
    """An `error` from the server (`code` as in docs/protocol.md), or a connection failure:
    `connection_failed`, `connection_closed`, `closed` (this client was closed) or a close
    code's name (`unauthorized`, `idle_timeout`, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def copy(self) -> ClonecastError:
        return ClonecastError(self.code, self.message)


@dataclass(frozen=True)
class Chunk:
    """One audio chunk of an utterance, in its output format; times from its `audio` message."""

    seq: int
    data: bytes
    last: bool
    start_ms: float | None = None
    end_ms: float | None = None


class Utterance:
    """One utterance: an async iterator of its `Chunk`s in order. Iteration ends on `done`
    (then `.done` holds its reason and stats) or `cancelled`, and raises `ClonecastError` on an
    `error` for this utterance or a lost connection. Read it from one task at a time."""

    def __init__(self, client: AsyncClient, uid: str, opening: dict, streaming: bool):
        output = opening.get("output") or {}
        self.id = uid
        self.format: str = output.get("format", "pcm16")
        self.sample_rate: int = output.get("sample_rate") or (
            8000 if self.format == "mulaw" else client.sample_rate
        )
        self.started: dict | None = None
        # `segment` messages so far: {"index", "text", "start_ms"}, each before its audio
        # (the sentence being heard is the last whose start_ms the playback has passed)
        self.segments: list[dict] = []
        self.done: dict | None = None
        self.error: ClonecastError | None = None
        self._client = client
        self._opening = opening  # fields the first `append` of a stream carries
        self._streaming = streaming
        self._sent = not streaming  # whether the server knows this utterance
        self._stopped = False  # iteration is over
        self._cancel_sent = False
        self._over = asyncio.Event()  # the server ended it, or the connection did
        self._queue: asyncio.Queue[Chunk | dict | ClonecastError | None] = asyncio.Queue()
        self._flush_ack: asyncio.Future | None = None

    def __aiter__(self) -> Utterance:
        return self

    async def __anext__(self) -> Chunk:
        if self._stopped:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Chunk) and not self._stopped:
            return item
        self._stopped = True
        if isinstance(item, ClonecastError):
            raise item
        raise StopAsyncIteration

    async def append(self, text: str) -> None:
        """Add text to an `open_stream()` utterance; complete sentences start speaking."""
        if not self._streaming:
            raise ValueError("append() is for utterances from open_stream(), not speak()")
        if self._flush_ack is not None:
            raise ValueError(f"utterance {self.id!r} was flushed; open a new stream to say more")
        if self._over.is_set():
            raise (self.error or ClonecastError("unknown_id", f"{self.id!r} is over")).copy()
        message = {"type": "append", "id": self.id, "text": text}
        if not self._sent:
            message.update(self._opening)
            self._sent = True
        await self._client._send(message)

    async def flush(self) -> None:
        """Speak what remains of the appended text; returns on the server's `flushed`."""
        if not self._streaming or not self._sent:
            raise ValueError("flush() needs an open_stream() utterance with appended text")
        if self._over.is_set():
            if self.error is not None:
                raise self.error.copy()
            return
        if self._flush_ack is None:
            self._flush_ack = asyncio.get_running_loop().create_future()
            await self._client._send({"type": "flush", "id": self.id})
        await self._flush_ack

    async def cancel(self) -> None:
        """Barge-in: stop now and wait until the server acknowledges (`cancelled`, or `done`
        if it finished first). Iteration ends at once; unread chunks are dropped."""
        self._stopped = True
        self._queue.put_nowait(None)  # wakes a reader waiting for the next chunk
        if not self._sent:  # the server never heard of it
            self._client._forget(self)
            self._end({"type": "cancelled", "id": self.id})
        elif not self._over.is_set():
            self._cancel_sent = True
            await self._client._send({"type": "cancel", "id": self.id})
            await self._over.wait()

    async def collect(self) -> bytes:
        """All remaining audio, joined."""
        return b"".join([chunk.data async for chunk in self])

    async def write_wav(self, path: str | Path) -> None:
        """Write the remaining audio as a mono PCM16 WAV, chunk by chunk as it arrives."""
        if self.format != "pcm16":
            raise ValueError(f"write_wav() needs pcm16 output, not {self.format!r}; use collect()")
        with wave.open(str(path), "wb") as wav:  # sizes are patched after every write
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(self.sample_rate)
            async for chunk in self:
                wav.writeframes(chunk.data)

    def _push(self, chunk: Chunk) -> None:
        if not self._over.is_set():
            self._queue.put_nowait(chunk)

    def _end(self, event: dict | ClonecastError) -> None:
        if self._over.is_set():
            return
        if isinstance(event, dict) and event.get("type") == "done":
            self.done = event
        if isinstance(event, ClonecastError):
            self.error = event
        self._over.set()
        self._queue.put_nowait(event)
        ack = self._flush_ack
        if ack is not None and not ack.done():
            if self.error is not None:
                ack.set_exception(self.error.copy())
            else:
                ack.set_result(None)


class AsyncClient:
    """One connection to a clonecast server; any number of utterances run on it at once."""

    def __init__(self, ws: Any, ready: dict):
        self.ready = ready
        self.session_id: str | None = ready.get("session_id")
        self.model_untrained = bool(ready.get("model", {}).get("untrained"))
        self.sample_rate: int = ready.get("audio", {}).get("sample_rate", DEFAULT_SAMPLE_RATE)
        self.limits: dict = ready.get("limits", {})
        self.errors: collections.deque[ClonecastError] = collections.deque(maxlen=32)
        self.closed_error: ClonecastError | None = None  # why the connection is over, once it is
        self._ws = ws
        self._closing = False
        self._utterances: dict[str, Utterance] = {}
        self._voices: dict[str, asyncio.Future] = {}  # request_id -> voice.created
        # pings waiting for their pong, by request_id (a refused one gets an error instead)
        self._pings: dict[str, asyncio.Future] = {}
        self._audio_meta: dict[tuple[str, int], dict] = {}  # (id, seq) -> its `audio` message
        self._send_lock = asyncio.Lock()  # keeps voice.upload and its binary frame together
        self._utterance_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls, url: str = DEFAULT_URL, api_key: str | None = None, *, open_timeout: float = 10.0
    ) -> AsyncClient:
        """Open a connection and wait for the server's `ready`."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            ws = await _ws_connect(
                url,
                additional_headers=headers,
                subprotocols=[PROTOCOL],
                open_timeout=open_timeout,
                max_size=2**25,
            )
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            raise ClonecastError("connection_failed", f"cannot connect to {url}: {exc}") from exc
        return await cls.from_connection(ws, open_timeout)

    @classmethod
    async def from_connection(cls, ws: Any, open_timeout: float = 10.0) -> AsyncClient:
        """Start on an open websockets-like connection (as `connect()` and the tests do)."""
        try:
            message = json.loads(await asyncio.wait_for(ws.recv(), open_timeout))
        except ConnectionClosed as exc:
            raise _closed_by_server(ws.close_code, ws.close_reason, None) from exc
        except (TimeoutError, ValueError):
            message = None
        if isinstance(message, dict) and message.get("type") == "ready":
            return cls(ws, message)
        await ws.close()
        if isinstance(message, dict) and message.get("type") == "error":  # e.g. unauthorized
            raise ClonecastError(str(message.get("code")), str(message.get("message")))
        raise ClonecastError(
            "connection_failed", f"no `ready` within {open_timeout} s, got {message!r:.200}"
        )

    async def create_voice(
        self, audio: bytes, transcript: str | None = None, *, binary: bool = True
    ) -> str:
        """Register a reference recording (WAV, FLAC, OGG, Opus, MP3); returns its voice_id."""
        limit = self.limits.get("max_upload_bytes")  # sent by the server, not in the doc
        if limit and len(audio) > limit:
            raise ClonecastError(
                "message_too_large", f"the reference is {len(audio)} bytes; the limit is {limit}"
            )
        request_id = f"r{next(self._request_ids)}"
        if binary:
            message = {"type": "voice.upload", "bytes": len(audio)}
        else:
            message = {"type": "voice.create", "audio_b64": base64.b64encode(audio).decode()}
        message.update(_compact(transcript=transcript, request_id=request_id))
        created = asyncio.get_running_loop().create_future()
        self._voices[request_id] = created
        try:
            await self._send(message, bytes(audio) if binary else None)
            return (await created)["voice_id"]
        finally:
            self._voices.pop(request_id, None)

    def speak(
        self,
        text: str,
        *,
        voice_id: str | None = None,
        voice_audio: bytes | None = None,
        transcript: str | None = None,
        params: dict | None = None,
        output: dict | None = None,
        id: str | None = None,
    ) -> Utterance:
        """Speak a whole text. The `speak` message is sent in the background; iterate the
        returned utterance for its audio (a failed send surfaces there)."""
        fields = _voice_fields(voice_id, voice_audio, transcript, params, output)
        utt = self._register(id, fields, streaming=False)
        try:
            text_frame = self._encode({"type": "speak", "id": utt.id, "text": text, **fields})
        except ClonecastError:
            self._forget(utt)
            raise
        task = asyncio.create_task(self._send_speak(utt, text_frame))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return utt

    def open_stream(
        self,
        id: str | None = None,
        *,
        voice_id: str | None = None,
        voice_audio: bytes | None = None,
        transcript: str | None = None,
        params: dict | None = None,
        output: dict | None = None,
    ) -> Utterance:
        """An utterance fed incrementally with `await utt.append(text)`, then `await
        utt.flush()`; nothing is sent before the first append."""
        fields = _voice_fields(voice_id, voice_audio, transcript, params, output)
        return self._register(id, fields, streaming=True)

    async def ping(self) -> float:
        """Round trip to the server, in seconds."""
        pong = asyncio.get_running_loop().create_future()
        request_id = f"ping-{next(self._request_ids)}"
        self._pings[request_id] = pong
        t0 = time.perf_counter()
        try:
            await self._send({"type": "ping", "request_id": request_id})
            await pong
        finally:
            self._pings.pop(request_id, None)
        return time.perf_counter() - t0

    async def close(self) -> None:
        """Close the connection; running utterances end with a `closed` error."""
        self._closing = True
        await self._ws.close()
        await self._reader

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _register(self, uid: str | None, fields: dict, streaming: bool) -> Utterance:
        if self.closed_error is not None:
            raise self.closed_error.copy()
        generated = uid is None
        while uid is None or (uid in self._utterances and generated):
            uid = f"u{next(self._utterance_ids)}"  # skips ids the caller picked
        if len(uid.encode()) > 255:
            raise ValueError("an utterance id is at most 255 bytes of UTF-8")
        running = self._utterances.get(uid)
        if running is not None and not running._over.is_set():
            raise ClonecastError("duplicate_id", f"utterance {uid!r} is still running")
        utt = Utterance(self, uid, fields, streaming)
        self._utterances[uid] = utt
        return utt

    def _forget(self, utt: Utterance) -> None:
        if self._utterances.get(utt.id) is utt:
            del self._utterances[utt.id]

    def _encode(self, message: dict) -> str:
        if self.closed_error is not None:
            raise self.closed_error.copy()
        text = json.dumps(message, separators=(",", ":"))
        limit = self.limits.get("max_message_bytes")
        if limit and len(text.encode()) > limit:
            raise ClonecastError(
                "message_too_large",
                f"a {message['type']} message of {len(text.encode())} bytes is over the "
                f"server's {limit}; upload long references with create_voice(binary=True)",
            )
        return text

    async def _send(self, message: dict | str, payload: bytes | None = None) -> None:
        text = message if isinstance(message, str) else self._encode(message)
        try:
            async with self._send_lock:
                await self._ws.send(text)
                if payload is not None:
                    await self._ws.send(payload)
        except ConnectionClosed as exc:
            raise (self.closed_error or self._close_error()).copy() from exc

    async def _send_speak(self, utt: Utterance, text: str) -> None:
        try:
            await self._send(text)
        except ClonecastError as exc:
            utt._end(exc)

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                try:
                    if isinstance(message, str):
                        self._on_text(json.loads(message))
                    else:
                        self._on_audio(bytes(message))
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    self.errors.append(ClonecastError("protocol_error", f"bad message: {exc}"))
        except ConnectionClosed:
            pass
        finally:
            self._shutdown(self._close_error())

    def _on_text(self, message: dict) -> None:
        kind = message["type"]
        if kind == "error":
            self._on_error(message)
        elif kind == "voice.created":
            created = self._voices.get(message.get("request_id"))
            if created is not None and not created.done():
                created.set_result(message)
        elif kind == "pong":
            # a server that does not echo request_id answers in order
            key = message.get("request_id", next(iter(self._pings), None))
            pong = self._pings.pop(key, None)
            if pong is not None and not pong.done():
                pong.set_result(message)
        elif (utt := self._utterances.get(message.get("id"))) is None:
            return  # a late message for an utterance this client has finished with
        elif kind == "audio":
            self._audio_meta[(utt.id, message["seq"])] = message
            utt.format = message.get("format", utt.format)
            utt.sample_rate = message.get("sample_rate", utt.sample_rate)
        elif kind == "started":
            utt.started = message
        elif kind == "segment":
            utt.segments.append(message)
        elif kind == "flushed" and utt._flush_ack is not None and not utt._flush_ack.done():
            utt._flush_ack.set_result(None)
        elif kind in ("done", "cancelled"):
            del self._utterances[utt.id]
            utt._end(message)

    def _on_audio(self, frame_bytes: bytes) -> None:
        frame = unpack_audio(frame_bytes)
        meta = self._audio_meta.pop((frame.utterance_id, frame.seq), {})
        utt = self._utterances.get(frame.utterance_id)
        if utt is not None:
            start, end = meta.get("start_ms"), meta.get("end_ms")
            utt._push(Chunk(frame.seq, frame.payload, frame.last, start, end))

    def _on_error(self, message: dict) -> None:
        error = ClonecastError(str(message.get("code", "internal")), str(message.get("message")))
        utt = self._utterances.get(message.get("id"))
        created = self._voices.get(message.get("request_id"))
        ping = None
        if utt is None and created is None:
            ping = self._pings.pop(message.get("request_id"), None)
        if utt is not None:  # the server has ended (or never began) it: nothing more comes
            del self._utterances[utt.id]
            if utt._cancel_sent and error.code == "unknown_id":  # it finished as we cancelled
                utt._end({"type": "cancelled", "id": utt.id})
            else:
                utt._end(error)
        elif created is not None:
            if not created.done():
                created.set_exception(error)
        elif ping is not None:  # refused (rate_limited): the connection goes on
            if not ping.done():
                ping.set_exception(error)
        else:
            self.errors.append(error)

    def _close_error(self) -> ClonecastError:
        if self._closing:
            return ClonecastError("closed", "the client was closed")
        return _closed_by_server(self._ws.close_code, self._ws.close_reason, self.errors)

    def _shutdown(self, error: ClonecastError) -> None:
        self.closed_error = error
        for utt in self._utterances.values():
            utt._end(error.copy())
        self._utterances.clear()
        for waiter in [*self._voices.values(), *self._pings.values()]:
            if not waiter.done():
                waiter.set_exception(error.copy())
        self._pings.clear()


def _closed_by_server(code: int | None, reason: str, errors: Any) -> ClonecastError:
    name = CLOSE_CODES.get(code, "connection_closed")
    said = next((e for e in reversed(errors or ()) if e.code == name), None)
    detail = said.message if said else (reason or "the server closed the connection")
    return ClonecastError(name, f"{detail} (close code {code})")


def _voice_fields(
    voice_id: str | None,
    voice_audio: bytes | None,
    transcript: str | None,
    params: dict | None,
    output: dict | None,
) -> dict:
    if voice_id is not None and voice_audio is not None:
        raise ValueError("give voice_id or voice_audio, not both")
    if transcript is not None and voice_audio is None:
        raise ValueError("transcript describes voice_audio; give both (or use create_voice)")
    voice = None
    if voice_audio is not None:
        voice = _compact(audio_b64=base64.b64encode(voice_audio).decode(), transcript=transcript)
    return _compact(voice_id=voice_id, voice=voice, params=params, output=output)


def _compact(**fields: Any) -> dict:
    """Drops unset fields rather than sending nulls."""
    return {k: v for k, v in fields.items() if v is not None}
