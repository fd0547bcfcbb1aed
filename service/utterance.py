"""One utterance, whatever its transport (a WebSocket session or an HTTP speech request): its
text segments, their engine requests, and the order in which their audio goes out.

Segments run as separate engine requests, at most two at a time (the one being heard and
the next, so there is no gap between them); audio is handed to the utterance's listener
strictly in segment order, through one output encoder. Engine events arrive on the engine's
thread and are moved to the event loop; everything else runs on the event loop only.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine import AudioChunk, ConfigError, RequestOutput, SamplingParams, VoiceReference
from service.audio_format import OutputFormat, StreamEncoder

log = logging.getLogger("clonecast.utterance")
MAX_SEGMENTS_IN_FLIGHT = 2


class State(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class Segment:
    index: int
    text: str
    request_id: str | None = None
    chunks: deque[AudioChunk] = field(default_factory=deque)
    finished: bool = False
    reason: str | None = None
    frames: int = 0  # audio frames this segment produced so far
    announced: bool = False  # its `segment` event went out (before its first audio)


@dataclass(frozen=True)
class SegmentStart:
    """Segment `index` (its `text`) is heard from `start_frame` of the utterance on."""

    index: int
    text: str
    start_frame: int


@dataclass(frozen=True)
class AudioPiece:
    data: bytes  # encoded in the utterance's output format
    start_frame: int  # frames [start, end) of the utterance's timeline
    end_frame: int


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    first_audio: float | None = None
    audio_s: float = 0.0
    chunks: int = 0
    bytes: int = 0
    underruns: int = 0
    stalled_s: float = 0.0  # how long a player would have waited, out of audio

    def as_dict(self, segments: int) -> dict:
        elapsed = time.monotonic() - self.started
        first = (
            None if self.first_audio is None else round((self.first_audio - self.started) * 1e3, 1)
        )
        return {
            "first_audio_ms": first,
            "audio_s": round(self.audio_s, 3),
            "elapsed_s": round(elapsed, 3),
            "rtf": round(elapsed / self.audio_s, 3) if self.audio_s else None,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "segments": segments,
            "underruns": self.underruns,
        }


class Listener(Protocol):
    """Where an utterance's audio goes (the transport); called on the event loop."""

    def on_segment(self, utt: Utterance, start: SegmentStart) -> None:
        """A segment's audio begins (sent before it, so captions can follow the speech)."""

    def on_audio(self, utt: Utterance, data: bytes, start_frame: int, end_frame: int) -> None:
        """Encoded audio of frames [start, end) of the utterance's timeline."""

    def on_done(self, utt: Utterance, tail: bytes) -> None:
        """Every segment was heard; `tail`: the encoder's last bytes (may be empty)."""

    def on_failed(self, utt: Utterance, code: str, message: str) -> None:
        """The utterance failed (it has ended itself, its engine requests are aborted)."""


class Utterance:
    def __init__(
        self,
        uid: str,
        voice: VoiceReference | None,
        params: SamplingParams,
        fmt: OutputFormat,
        flushed: bool,
        engine,
        loop,
        listener: Listener,
        tag: str,
        registry: set | None = None,
    ):
        """`engine`: the service's engine client (submit, abort, check_text); `loop`: the
        event loop engine events are moved to; `tag`: the start of its engine request ids;
        `registry`: the server's running utterances (it is in there while running)."""
        self.id = uid
        self.voice = voice
        self.params = params
        self.format = fmt
        self.encoder = StreamEncoder(fmt)
        self.flushed = flushed  # no more text will come
        self.state = State.RUNNING
        self.ready = True  # False while an inline reference voice is being encoded
        self.segments: list[Segment] = []
        self.emit_index = 0
        self.frames_done = 0  # frames of the segments already heard
        self.seq = 0
        self.buffered_bytes = 0  # queued for the transport, not yet sent
        self.stats = Stats()
        self.text_chars = 0
        self.engine = engine  # another may be set until a segment is submitted
        # picks a ready engine for its voice (None: none is): where an utterance with nothing
        # in flight goes on when its engine has died since (set by its transport)
        self.pick_engine: Callable[[], object | None] | None = None
        self._loop, self._listener = loop, listener
        self.tag = tag
        self._prefix = f"{tag}/{uuid.uuid4().hex[:8]}"  # engine request ids of its segments
        self.voice_id: str | None = None  # the server's id of its voice, for reports
        self.report = None  # its transport's UtteranceReport
        self._registry = registry if registry is not None else set()
        self._registry.add(self)

    # -- text --------------------------------------------------------------------------------

    def add_segments(self, texts: list[str]) -> None:
        """Queues complete segments after the engine's text check (structural tokens, prompt
        length with the utterance's voice); raises ConfigError for a text it refuses."""
        self.check_texts(texts)
        for text in texts:
            self.segments.append(Segment(len(self.segments), text))

    def check_texts(self, texts: list[str]) -> None:
        for text in texts:
            self.engine.check_text(text, self.voice)

    # -- the engine --------------------------------------------------------------------------

    def pump(self) -> None:
        """Hands out audio that may go out, starts segments that may run, finishes when
        every segment was heard."""
        for item in self.next_audio():  # first: a failure to submit below loses none of it
            if isinstance(item, SegmentStart):
                self._listener.on_segment(self, item)
                continue
            self._listener.on_audio(self, item.data, item.start_frame, item.end_frame)
            if self.state is not State.RUNNING:
                return  # the listener ended it (a slow reader)
        submit = self.to_submit()
        if submit and not self._on_a_live_engine():
            return
        for seg in submit:
            seg.request_id = f"{self._prefix}/{seg.index}"
            future = self.engine.submit(
                seg.request_id, seg.text, self.voice, self.params, self._sink(seg)
            )
            future.add_done_callback(lambda f, seg=seg: self._submitted(f, seg))
        if self.complete:
            tail = self.encoder.finish()
            self.state = State.DONE
            self._registry.discard(self)
            self._listener.on_done(self, tail)

    def _on_a_live_engine(self) -> bool:
        """Before submitting: an utterance whose engine has died with none of its segments in
        flight (an `append` utterance whose text so far was all spoken, or a speak between
        segments) lost nothing, and goes on on a ready engine; with none ready it fails with
        `not_ready` (retryable). With segments in flight it stays: they fail with the engine."""
        if self.pick_engine is None or self.engine.alive or self.active_request_ids():
            return True
        engine = self.pick_engine()
        if engine is None:
            self.fail("not_ready", "its engine stopped and no engine is ready: retry shortly")
            return False
        log.info("utterance %s moves to another engine: its own stopped", self.tag)
        self.engine = engine
        return True

    def end(self, state: State) -> None:
        """Cancels or fails the utterance: aborts its engine requests; nothing more goes to
        the listener."""
        self.state = state
        self._registry.discard(self)
        for request_id in self.active_request_ids():
            self.engine.abort(request_id)

    def _sink(self, seg: Segment):
        def deliver(out: RequestOutput | BaseException) -> None:  # the engine's thread
            if self.state is State.RUNNING:
                self._loop.call_soon_threadsafe(self._on_output, seg, out)

        return deliver

    def _submitted(self, future, seg: Segment) -> None:
        exc = future.exception()
        if exc is not None and self.state is State.RUNNING:
            self._loop.call_soon_threadsafe(self._on_output, seg, exc)

    def _on_output(self, seg: Segment, out: RequestOutput | BaseException) -> None:
        if self.state is not State.RUNNING or seg.finished:
            return
        try:
            self._take(seg, out)
        except Exception:  # a bug: this utterance ends with `internal`, not silence forever
            log.exception("handling engine output for %s failed", self.id)
            if self.state is State.RUNNING:
                self.fail("internal", "the server failed to produce this audio")

    def _take(self, seg: Segment, out: RequestOutput | BaseException) -> None:
        if isinstance(out, BaseException) or out.finish_reason == "error":
            if isinstance(out, BaseException):
                detail = str(out)
            else:
                detail = out.error or (out.audio.error if out.audio else "") or ""
            code = "bad_parameter" if isinstance(out, ConfigError) else "generation_failed"
            self.fail(code, f"segment {seg.index} failed: {detail}")
            return
        if out.audio is not None:
            seg.chunks.append(out.audio)
        if out.finished:
            seg.finished, seg.reason = True, out.finish_reason
        self.pump()

    def fail(self, code: str, message: str) -> None:
        self.end(State.FAILED)
        self._listener.on_failed(self, code, message)

    # -- bookkeeping -------------------------------------------------------------------------

    def to_submit(self) -> list[Segment]:
        """Segments that may start now (keeping at most two in flight)."""
        if not self.ready or self.state is not State.RUNNING:
            return []
        in_flight = sum(1 for s in self.segments if s.request_id is not None and not s.finished)
        waiting = [s for s in self.segments if s.request_id is None]
        return waiting[: max(0, MAX_SEGMENTS_IN_FLIGHT - in_flight)]

    def active_request_ids(self) -> list[str]:
        return [s.request_id for s in self.segments if s.request_id and not s.finished]

    def next_audio(self) -> list[SegmentStart | AudioPiece]:
        """What may go out now, in order: the audio of the segment being heard, frames counted
        from the start of the utterance, each segment's start before its first audio."""
        out: list[SegmentStart | AudioPiece] = []
        while self.emit_index < len(self.segments):
            seg = self.segments[self.emit_index]
            while seg.chunks:
                chunk = seg.chunks.popleft()
                seg.frames = chunk.end_frame
                if chunk.pcm:
                    offset = self.frames_done
                    if not seg.announced:
                        seg.announced = True
                        out.append(SegmentStart(seg.index, seg.text, offset + chunk.start_frame))
                    data = self.encoder.encode(chunk.pcm)
                    out.append(
                        AudioPiece(data, offset + chunk.start_frame, offset + chunk.end_frame)
                    )
            if not seg.finished:
                break
            self.frames_done += seg.frames
            self.emit_index += 1
        return out

    @property
    def complete(self) -> bool:
        """All text arrived, every segment finished and its audio handed out."""
        return (
            self.flushed and self.emit_index == len(self.segments) and self.state is State.RUNNING
        )

    @property
    def waiting_for_text(self) -> bool:
        """Open for more text with nothing left to make or send: only its client moves it on
        (so it does not keep an idle connection open)."""
        return (
            not self.flushed
            and self.ready
            and self.emit_index == len(self.segments)
            and self.buffered_bytes == 0
        )

    @property
    def finish_reason(self) -> str:
        return "length" if any(s.reason == "length" for s in self.segments) else "eos"
