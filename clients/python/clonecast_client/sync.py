"""Synchronous clonecast client: `AsyncClient` (clonecast_client.aio) run on a private event
loop in a background thread. Owns only that thread and the blocking calls into it; the
protocol lives in clonecast_client.aio alone. Standard library plus `websockets`; no torch,
numpy or starlette.

    with Client.connect("ws://127.0.0.1:8737/v1/stream", api_key="KEY") as client:
        voice = client.create_voice(Path("me.wav").read_bytes(), "What I say in it.")
        for chunk in client.speak("Hello there.", voice_id=voice):
            play(chunk.data)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from clonecast_client.aio import DEFAULT_URL, AsyncClient, Chunk, ClonecastError, Utterance

__all__ = ["Client", "SyncUtterance", "ClonecastError", "Chunk"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread; `run()` blocks on one coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="clonecast-sdk", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C: do not leave the coroutine running on the loop
            raise

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a plain function on the loop's thread (it may create tasks there)."""

        async def call() -> T:
            return fn(*args, **kwargs)

        return self.run(call())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _next_chunk(utt: Utterance) -> Chunk | None:
    try:
        return await anext(utt)
    except StopAsyncIteration:
        return None


class SyncUtterance:
    """One utterance: iterate it for `Chunk`s; iteration raises `ClonecastError` on an error."""

    def __init__(self, utt: Utterance, loop: _LoopThread):
        self._utt = utt
        self._loop = loop

    @property
    def id(self) -> str:
        return self._utt.id

    @property
    def done(self) -> dict | None:
        """The `done` message (reason and stats) once the utterance finished."""
        return self._utt.done

    @property
    def started(self) -> dict | None:
        return self._utt.started

    @property
    def error(self) -> ClonecastError | None:
        return self._utt.error

    def __iter__(self) -> Iterator[Chunk]:
        while (chunk := self._loop.run(_next_chunk(self._utt))) is not None:
            yield chunk

    def append(self, text: str) -> None:
        self._loop.run(self._utt.append(text))

    def flush(self) -> None:
        self._loop.run(self._utt.flush())

    def cancel(self) -> None:
        self._loop.run(self._utt.cancel())

    def collect(self) -> bytes:
        return self._loop.run(self._utt.collect())

    def write_wav(self, path: str | Path) -> None:
        self._loop.run(self._utt.write_wav(path))


class Client:
    """A blocking connection to a clonecast server; see `AsyncClient` for the semantics."""

    def __init__(self, client: AsyncClient, loop: _LoopThread):
        self._client = client
        self._loop = loop
        self._closed = False

    @classmethod
    def connect(
        cls, url: str = DEFAULT_URL, api_key: str | None = None, *, open_timeout: float = 10.0
    ) -> Client:
        loop = _LoopThread()
        try:
            client = loop.run(AsyncClient.connect(url, api_key, open_timeout=open_timeout))
        except BaseException:
            loop.stop()
            raise
        return cls(client, loop)

    @property
    def ready(self) -> dict:
        return self._client.ready

    @property
    def session_id(self) -> str | None:
        return self._client.session_id

    @property
    def model_untrained(self) -> bool:
        return self._client.model_untrained

    @property
    def errors(self) -> list[ClonecastError]:
        """Recent errors the server sent about no particular utterance or voice request."""
        return list(self._client.errors)

    def create_voice(
        self, audio: bytes, transcript: str | None = None, *, binary: bool = True
    ) -> str:
        return self._loop.run(self._client.create_voice(audio, transcript, binary=binary))

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
    ) -> SyncUtterance:
        """Speak a whole text; iterate the result for its audio."""
        utt = self._loop.call(
            self._client.speak,
            text,
            voice_id=voice_id,
            voice_audio=voice_audio,
            transcript=transcript,
            params=params,
            output=output,
            id=id,
        )
        return SyncUtterance(utt, self._loop)

    def open_stream(
        self,
        id: str | None = None,
        *,
        voice_id: str | None = None,
        voice_audio: bytes | None = None,
        transcript: str | None = None,
        params: dict | None = None,
        output: dict | None = None,
    ) -> SyncUtterance:
        """An utterance fed with append() and flush(); iterate it for its audio."""
        utt = self._loop.call(
            self._client.open_stream,
            id,
            voice_id=voice_id,
            voice_audio=voice_audio,
            transcript=transcript,
            params=params,
            output=output,
        )
        return SyncUtterance(utt, self._loop)

    def ping(self) -> float:
        return self._loop.run(self._client.ping())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._client.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
