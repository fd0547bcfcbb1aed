"""AudioOutput's reading of codec batches (engine/audio_output.py): first chunks are read at
the next collect even if that means waiting, later chunks only when ready (or when too many
are outstanding), and a request's chunks never out of order. Codec batches are stand-ins
whose readiness the test controls."""

from __future__ import annotations

import pytest

from engine.audio_output import MAX_STEADY_IN_FLIGHT, AudioOutput
from engine.codec.chunk_decoder import DecodedChunk
from engine.config import SamplingParams, StreamConfig
from engine.prompt import Prompt
from engine.request import Request
from engine.streaming import ChunkWindow, window_codes


class Batch:
    """A submitted codec batch: `ready()` as the test sets it; `result()` records whether it
    had to wait (it was not ready yet)."""

    def __init__(self, windows, urgent=False):
        self.windows, self.urgent = windows, urgent
        self.is_ready = False
        self.waited = False

    def ready(self):
        return self.is_ready

    def result(self):
        self.waited = not self.is_ready
        return [DecodedChunk(w, b"\0\0" * 960 * w.num_frames) for w in self.windows]


class Chunks:
    def __init__(self):
        self.submitted = []

    def submit(self, windows, urgent=False):
        self.submitted.append(Batch(windows, urgent))
        return self.submitted[-1]


def request(rid: str) -> Request:
    return Request(rid, Prompt((1, 2), (None, None), 1), SamplingParams(), seed=0)


def window(rid: str, index: int) -> ChunkWindow:
    start = 0 if index == 0 else 8 + 25 * (index - 1)
    frames = 8 if index == 0 else 25
    context = 0 if index == 0 else 8
    rows = [(1,) * 8] * (start + frames + 7)
    codes = window_codes(rows, start - context, start + frames)
    return ChunkWindow(rid, index, start, start + frames, context, 0, codes, False)


def entry(audio: AudioOutput, req: Request, index: int, ready: bool = False) -> Batch:
    batch = Batch([window(req.request_id, index)], urgent=index == 0)
    batch.is_ready = ready
    audio.in_flight.append((batch, [req], batch.urgent))
    return batch


def never_finish(request, reason):
    raise AssertionError("no request ends here")


@pytest.fixture
def audio():
    return AudioOutput(Chunks(), StreamConfig())


def read(outputs) -> list[tuple[str, int]]:
    return [(o.request_id, o.audio.index) for o in outputs]


def test_later_chunks_are_read_when_ready_first_chunks_at_once(audio):
    a, b = request("a"), request("b")
    steady = entry(audio, a, 1)
    first = entry(audio, b, 0)
    assert read(audio.collect(never_finish)) == [("b", 0)]  # waited for the first chunk
    assert first.waited and audio.in_flight == [(steady, [a], False)]
    assert audio.collect(never_finish) == []  # still decoding: the step goes on
    steady.is_ready = True
    assert read(audio.collect(never_finish)) == [("a", 1)] and not steady.waited
    assert audio.in_flight == []


def test_without_wait_nothing_unready_is_read(audio):
    first = entry(audio, request("b"), 0)
    assert audio.collect(never_finish, wait=False) == []
    first.is_ready = True
    assert read(audio.collect(never_finish, wait=False)) == [("b", 0)]


def test_too_many_outstanding_later_chunks_make_collect_wait_for_the_oldest(audio):
    batches = [entry(audio, request(f"r{i}"), 1) for i in range(MAX_STEADY_IN_FLIGHT + 2)]
    got = read(audio.collect(never_finish))
    assert got == [("r0", 1), ("r1", 1)]  # the two beyond the limit, oldest first
    assert [b.waited for b in batches] == [True, True] + [False] * MAX_STEADY_IN_FLIGHT
    assert len(audio.in_flight) == MAX_STEADY_IN_FLIGHT


def test_a_chunk_is_never_read_before_an_earlier_chunk_of_its_request(audio):
    """An earlier chunk of `a` still decoding: a later ready batch holding `a`'s next chunk
    waits for it (wait=False: both stay), or reads it first (wait=True); `b` is unaffected."""
    a, b = request("a"), request("b")
    older = entry(audio, a, 1)
    newer = Batch([window("a", 2), window("b", 1)])
    newer.is_ready = True
    audio.in_flight.append((newer, [a, b], False))
    assert audio.collect(never_finish, wait=False) == []
    older_first = entry(audio, request("c"), 0)  # an urgent batch makes collect wait anyway
    got = read(audio.collect(never_finish))
    assert got.index(("a", 1)) < got.index(("a", 2))
    assert sorted(got) == [("a", 1), ("a", 2), ("b", 1), ("c", 0)]
    assert older.waited and older_first.waited and audio.in_flight == []


def test_collect_all_reads_everything(audio):
    batches = [entry(audio, request("a"), 1), entry(audio, request("b"), 0)]
    assert read(audio.collect_all(never_finish)) == [("a", 1), ("b", 0)]
    assert all(b.waited for b in batches) and audio.in_flight == []


def test_first_chunks_go_to_the_urgent_stream_by_length(audio):
    """Windows no longer than a first chunk (8 frames) are submitted as urgent, longer ones
    and empty last chunks as steady; each request's window in the batch of its kind."""
    chunks = audio.chunks
    fresh, steady_req, ending = request("fresh"), request("steady"), request("ending")
    for r in (fresh, steady_req, ending):
        audio.open(r.request_id)
    fresh.output_rows = [(5,) * 8] * 15  # 8 complete frames: the first chunk
    steady_req.output_rows = [(5,) * 8] * 40
    audio.streams["steady"].emitted, audio.streams["steady"].index = 8, 1  # next: 25 frames
    ending.output_rows = [(5,) * 8] * 16
    audio.streams["ending"].emitted, audio.streams["ending"].index = 8, 1  # then it ends
    ids = audio.submit([(fresh, None, None), (steady_req, None, None), (ending, None, "length")])
    assert ids == {"fresh", "steady", "ending"}
    kinds = {
        b.urgent: [(w.request_id, w.window_frames) for w in b.windows] for b in chunks.submitted
    }
    assert kinds == {True: [("fresh", 8)], False: [("steady", 33), ("ending", 8)]}
    assert [urgent for *_, urgent in audio.in_flight] == [True, False]
