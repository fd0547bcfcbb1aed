"""From generated rows to audio events: each request's streaming state, the codec batches in
flight, and the finishes held back for their last chunk.

A step's rows complete chunk windows (engine/streaming.py); `submit` hands them to the codec
as one batch per shape, which runs on its own CUDA stream and is read back by `collect` on a
later step. With `defer_steps`, steady chunks (neither a request's first nor its last) may
wait a few steps to join a larger batch (see `_may_wait`). A request that ends while its
last chunk is decoding is finished at once by the engine (blocks and slot freed) and
`hold`-ed here: its finishing event goes out with that chunk, and its id stays taken until
then. Also home of the event types the engine returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.codec.chunk_decoder import ChunkDecoder, DecodedChunk, PendingChunks
from engine.config import FRAMES_PER_SECOND, StreamConfig
from engine.prompt import AudioRow
from engine.request import FinishReason, Request
from engine.streaming import AudioStream, ChunkWindow

log = logging.getLogger("clonecast.engine")

# A steady chunk waits only while the audio its client already has (reckoned from when its
# first chunk was ready) lasts this much longer: several steps and a codec batch even at 256
# streams (served steps of 11-15 ms), so waiting never makes a chunk late.
DEFER_SLACK_S = 0.25


@dataclass(frozen=True)
class AudioChunk:
    """A piece of a request's audio: PCM16 little-endian, 24 kHz mono, frames `[start, end)`
    (40 ms each). The last chunk of a request has `is_last` (it may be empty). Times are
    `time.monotonic()` seconds: request arrival, its first generated row, this chunk ready."""

    request_id: str
    index: int
    pcm: bytes
    start_frame: int
    end_frame: int
    is_last: bool
    arrival_time: float
    first_row_time: float | None
    ready_time: float
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / 24000


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: its new delayed audio rows, the audio chunk
    that became ready (if any), and on the last event the finish reason and every row.
    (Not frozen: one is made per running request per step, and frozen dataclasses are
    several times slower to build; treat it as read-only.)"""

    request_id: str
    new_rows: list[AudioRow]
    finished: bool = False
    finish_reason: str | None = None
    rows: list[AudioRow] | None = None  # all rows, on the finishing event only
    audio: AudioChunk | None = None
    error: str | None = None  # why it ended, with finish_reason "error" (else the audio's)


class AudioOutput:
    """`defer_steps` (0: never) and `defer_batch`: the plan's codec_defer_steps and
    codec_defer_batch. `clock`: time.monotonic, or a test's."""

    def __init__(
        self,
        chunks: ChunkDecoder | None,
        config: StreamConfig,
        defer_steps: int = 0,
        defer_batch: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.chunks = chunks  # None: the engine has no codec (codes-only requests)
        self.config = config
        self.defer_steps, self.defer_batch, self.clock = defer_steps, defer_batch, clock
        self.streams: dict[str, AudioStream] = {}
        # submitted batches not read back yet, oldest first, with each window's request and
        # the time it was submitted
        self.in_flight: list[tuple[PendingChunks, list[Request], float]] = []
        self.batch_latencies: list[tuple[float, int]] = []  # (seconds, windows) per batch read
        self.held: dict[str, Request] = {}
        # steady windows waiting to join a batch, oldest first, with the submit call (one a
        # step) that made each
        self.deferred: list[tuple[ChunkWindow, Request, int]] = []
        self.submits = 0
        self.first_chunk_times: dict[str, float] = {}  # when each stream's first chunk was read

    def open(self, request_id: str) -> None:
        self.streams[request_id] = AudioStream(request_id, self.config)

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.first_chunk_times.pop(request_id, None)
        if self.deferred:  # an ended request's waiting chunks are not spoken
            self.deferred = [d for d in self.deferred if d[1].request_id != request_id]

    def hold(self, request: Request) -> None:
        """A finished request whose last chunk is decoding: reported when it is read."""
        self.held[request.request_id] = request

    def release(self, request_id: str) -> bool:
        """Forgets a held request (aborted): nothing more is reported for it."""
        return self.held.pop(request_id, None) is not None

    def submit(self, updates) -> tuple[set[str], dict[str, str]]:
        """Submits the windows that `updates` (request, row, finish reason) made ready, one
        codec batch per shape, with any deferred ones that are due; returns the ids of the
        requests submitted, and the requests whose window could not be made (id -> why):
        they fail alone, the batch goes on. Called once a step."""
        self.submits += 1
        now = self.clock()
        windows: list[ChunkWindow] = []
        owners: list[Request] = []
        failed: dict[str, str] = {}
        streams = self.streams
        for request, _, reason in updates:
            stream = streams.get(request.request_id)
            if stream is None or (reason is None and len(request.output_rows) < stream.rows_due):
                continue  # no chunk is ready: the common case, checked without a call
            try:
                window = stream.next_window(request.output_rows, finished=reason is not None)
            except Exception as exc:
                log.exception("making an audio window of %s failed", request.request_id)
                failed[request.request_id] = f"audio window failed: {type(exc).__name__}: {exc}"
                continue
            if window is None:
                continue
            if self._may_wait(window, now):
                self.deferred.append((window, request, self.submits))
            else:
                windows.append(window)
                owners.append(request)
        if self.deferred and self._deferred_due(owners, now):
            # the waiting windows go first: a request's chunks must be read in order
            windows = [w for w, _, _ in self.deferred] + windows
            owners = [r for _, r, _ in self.deferred] + owners
            self.deferred = []
        if windows:
            pending = self.chunks.submit(windows)
            # the batch's latency counts from its launch (on the CPU, after its decoding)
            self.in_flight.append((pending, owners, self.clock()))
        return {r.request_id for r in owners}, failed

    def _may_wait(self, window: ChunkWindow, now: float) -> bool:
        """Whether a steady chunk may wait for a larger codec batch. Per window a batch costs
        less the larger it is (on the H200, fp32: 0.72 ms for one 33-frame window, 1.32 ms
        for four, 2.21 ms for eight), and a steady chunk is due only when the audio before
        it has played: at 64 streams a second of audio is made in about 0.12 s. First
        chunks (first audio: no first-chunk time is known before it is read) and last ones
        (the request's end) never wait. Checked once a step: a chunk let go reaches its
        client a step later, well inside the slack unless two steps take 0.25 s."""
        if not self.defer_steps or window.is_last:
            return False
        first = self.first_chunk_times.get(window.request_id)
        return first is not None and first + window.start / FRAMES_PER_SECOND - now >= DEFER_SLACK_S

    def _deferred_due(self, owners: list[Request], now: float) -> bool:
        """The deferred windows go now if they make a full batch, the oldest has waited its
        steps, one's client is running short of audio, or a request that has one is
        submitting its next (its last chunk, say: chunks are read in order)."""
        if len(self.deferred) >= self.defer_batch:
            return True
        if self.submits - self.deferred[0][2] >= self.defer_steps:
            return True
        if any(not self._may_wait(w, now) for w, _, _ in self.deferred):
            return True
        waiting = {r.request_id for _, r, _ in self.deferred}
        return any(r.request_id in waiting for r in owners)

    def collect(self, finish: Callable[[Request, FinishReason], None]) -> list[RequestOutput]:
        """Reads every submitted batch (waiting for any still running) and turns its chunks
        into events. A codec failure, or a batch that cannot be read back, ends its requests
        alone with an error (through `finish` when they are still running)."""
        outputs = []
        batches, self.in_flight = self.in_flight, []
        for pending, owners, submitted in batches:
            try:
                decoded_chunks = pending.result()
            except Exception as exc:
                log.exception("reading a codec batch back failed")
                error = f"codec read-back failed: {type(exc).__name__}: {exc}"
                decoded_chunks = [DecodedChunk(w, b"", error) for w in pending.windows]
            now = self.clock()
            self.batch_latencies.append((now - submitted, len(owners)))
            for decoded, request in zip(decoded_chunks, owners, strict=True):
                event = self._event(decoded, request, now, finish)
                if (
                    self.defer_steps
                    and decoded.window.index == 0
                    and request.request_id in self.streams
                ):
                    self.first_chunk_times[request.request_id] = now
                if event is not None:
                    outputs.append(event)
        return outputs

    def take_batch_latencies(self) -> list[tuple[float, int]]:
        taken, self.batch_latencies = self.batch_latencies, []
        return taken

    def _event(self, decoded: DecodedChunk, request: Request, now: float, finish):
        w = decoded.window
        held = self.held.get(request.request_id) is request
        if request.is_finished and not held:
            return None  # aborted, or already ended by an earlier chunk's error
        chunk = AudioChunk(
            w.request_id,
            w.index,
            decoded.pcm,
            w.start,
            w.end,
            w.is_last or bool(decoded.error),
            request.arrival_time,
            request.first_row_time,
            now,
            decoded.error,
        )
        reason = None
        if decoded.error:
            reason = FinishReason.ERROR
        elif w.is_last and held:
            reason = request.finish_reason
        if reason is None:
            return RequestOutput(request.request_id, [], audio=chunk)
        self.held.pop(request.request_id, None)
        if not request.is_finished:
            finish(request, reason)
        return RequestOutput(request.request_id, [], True, reason.value, request.output_rows, chunk)
