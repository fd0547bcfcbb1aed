"""One utterance of a connection: its text segments, their engine requests, and the order in
which their audio goes out.

Segments run as separate engine requests, at most two at a time (the one being heard and
the next, so there is no gap between them); audio is emitted strictly in segment order, with
one continuous sequence number and one output encoder. Runs on the event loop only.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from engine import AudioChunk, SamplingParams, VoiceReference
from service.audio_format import OutputFormat, StreamEncoder

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


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    first_audio: float | None = None
    audio_s: float = 0.0
    chunks: int = 0
    bytes: int = 0
    underruns: int = 0

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


class Utterance:
    def __init__(
        self,
        uid: str,
        voice: VoiceReference | None,
        params: SamplingParams,
        fmt: OutputFormat,
        flushed: bool,
    ):
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
        self.buffered_bytes = 0  # queued for the socket, not yet sent
        self.stats = Stats()
        self.text_chars = 0

    def add_segments(self, texts: list[str]) -> None:
        for text in texts:
            self.segments.append(Segment(len(self.segments), text))

    def to_submit(self) -> list[Segment]:
        """Segments that may start now (keeping at most two in flight)."""
        if not self.ready or self.state is not State.RUNNING:
            return []
        in_flight = sum(1 for s in self.segments if s.request_id is not None and not s.finished)
        waiting = [s for s in self.segments if s.request_id is None]
        return waiting[: max(0, MAX_SEGMENTS_IN_FLIGHT - in_flight)]

    def active_request_ids(self) -> list[str]:
        return [s.request_id for s in self.segments if s.request_id and not s.finished]

    def next_audio(self) -> list[tuple[bytes, int, int]]:
        """Encoded audio that may go out now, in order: (bytes, start frame, end frame) of the
        segment being heard, frames counted from the start of the utterance."""
        out = []
        while self.emit_index < len(self.segments):
            seg = self.segments[self.emit_index]
            while seg.chunks:
                chunk = seg.chunks.popleft()
                seg.frames = chunk.end_frame
                if chunk.pcm:
                    offset = self.frames_done
                    data = self.encoder.encode(chunk.pcm)
                    out.append((data, offset + chunk.start_frame, offset + chunk.end_frame))
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
    def finish_reason(self) -> str:
        return "length" if any(s.reason == "length" for s in self.segments) else "eos"
