"""One soak client's WebSocket connection (benchmarks/soak.py): a reader task routes each
server message to the request that waits for it (by `request_id`, else by utterance `id`;
binary audio frames by the id in their header; an error naming neither goes to `general`),
and checks each utterance's stream as it reads it. A message nobody waits for is `stray`:
the protocol promised none (audio after `cancelled`, a second `done`...), and the soak counts
it as a failure."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from clonecast_client.wire import AudioFrame, unpack_audio

CLOSED = object()  # queued to every waiter when the connection ends


class Unexpected(Exception):
    """The server did something the protocol does not allow for this request."""


class Conn:
    def __init__(self, ws, ready: dict):
        self.ws, self.ready = ws, ready
        self.routes: dict[str, asyncio.Queue] = {}
        self.general: asyncio.Queue = asyncio.Queue()
        self.stray: list[str] = []
        self.close_code: int | None = None
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str) -> Conn:
        ws = await connect(url, max_size=None, open_timeout=30, ping_interval=None)
        ready = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if ready.get("type") != "ready":
            raise Unexpected(f"the first message was not ready: {ready}")
        return cls(ws, ready)

    @property
    def closed(self) -> bool:
        return self.reader.done()

    def expect(self, *keys: str) -> asyncio.Queue:
        """A queue receiving every message routed to any of `keys` (ids, request_ids)."""
        queue: asyncio.Queue = asyncio.Queue()
        for key in keys:
            self.routes[key] = queue
        return queue

    def forget(self, *keys: str) -> None:
        for key in keys:
            self.routes.pop(key, None)

    async def send(self, message: dict | str | bytes) -> None:
        await self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)

    def abort(self) -> None:
        """Drops the TCP connection without a close frame (a client that vanished)."""
        self.ws.transport.abort()

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self._route(raw)
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            for queue in {id(q): q for q in [*self.routes.values(), self.general]}.values():
                queue.put_nowait(CLOSED)

    def _route(self, raw: str | bytes) -> None:
        if isinstance(raw, bytes):
            try:
                frame = unpack_audio(raw)
            except ValueError as e:
                self.stray.append(f"bad binary frame: {e}")
                return
            queue = self.routes.get(frame.utterance_id)
            if queue is None:
                self.stray.append(f"audio frame for {frame.utterance_id!r}, nobody waiting")
            else:
                queue.put_nowait(frame)
            return
        message = json.loads(raw)
        queue = self.routes.get(message.get("request_id")) or self.routes.get(message.get("id"))
        if queue is not None:
            queue.put_nowait(message)
        elif message.get("type") == "error" and "id" not in message and "request_id" not in message:
            self.general.put_nowait(message)
        elif message.get("type") != "pong":
            self.stray.append(f"{message.get('type')} for {message.get('id')!r}, nobody waiting")


async def next_item(queue: asyncio.Queue, deadline: float):
    try:
        item = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise Unexpected("timed out waiting for the server") from None
    if item is CLOSED:
        raise Unexpected("the connection closed")
    return item


async def expect_error(queue: asyncio.Queue, code: str, deadline: float) -> str:
    message = await next_item(queue, deadline)
    if message.get("type") != "error" or message.get("code") != code:
        raise Unexpected(f"expected error {code}, got {message}")
    return "error:" + code


class UtteranceReader:
    """Reads one utterance's messages and checks them: `audio` messages numbered 0, 1, 2...,
    each followed by its binary frame (same seq, `bytes` long), nothing after the `last`
    one, `done` only after it. `first_audio` is set when the first audio message arrives."""

    def __init__(self, queue: asyncio.Queue, uid: str):
        self.queue, self.uid = queue, uid
        self.seq, self.last, self.audio_bytes = 0, False, 0
        self.started, self.flushed = False, False
        self.first_audio = asyncio.Event()
        self.pending: dict | None = None  # the audio message whose frame comes next

    async def until_end(self, deadline: float) -> str:
        """The utterance's end: "done", "cancelled" or "error:CODE"."""
        while True:
            outcome = self._take(await next_item(self.queue, deadline))
            if outcome is not None:
                return outcome

    def _take(self, item) -> str | None:
        if isinstance(item, AudioFrame):
            header, self.pending = self.pending, None
            if header is None:
                raise Unexpected(f"binary frame {item.seq} without its audio message")
            if (item.seq, len(item.payload), item.last) != (
                header["seq"],
                header["bytes"],
                header["last"],
            ):
                raise Unexpected(f"frame {item.seq} differs from its audio message {header}")
            self.audio_bytes += len(item.payload)
            return None
        kind = item.get("type")
        if self.pending is not None:
            raise Unexpected(f"{kind} came between audio message {self.seq - 1} and its frame")
        if kind == "audio":
            if self.last or item.get("seq") != self.seq:
                raise Unexpected(f"audio seq {item.get('seq')} after {self.seq - 1}/{self.last}")
            self.seq, self.last, self.pending = self.seq + 1, item.get("last"), item
            self.first_audio.set()
        elif kind == "done":
            if not self.last:
                raise Unexpected("done before the last audio frame")
            return "done"
        elif kind == "cancelled":
            return "cancelled"
        elif kind == "error":
            return "error:" + str(item.get("code"))
        elif kind == "started":
            self.started = True
        elif kind == "flushed":
            self.flushed = True
        elif kind != "segment":
            raise Unexpected(f"unexpected {kind} for utterance {self.uid}")
        return None


async def until_first_audio(reader: UtteranceReader, end: asyncio.Task, timeout: float) -> None:
    """Returns at the utterance's first audio or its end (`end`: its until_end task)."""
    audio = asyncio.create_task(reader.first_audio.wait())
    try:
        await asyncio.wait([end, audio], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        audio.cancel()
