"""Steady chunks waiting a few steps for a larger codec batch (plan codec_defer_steps): when
they wait and when they go, and that the audio and its order are what they were."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from engine import ConfigError, Engine, EngineConfig, SamplingParams
from engine.audio_output import DEFER_SLACK_S, AudioOutput
from engine.codec.chunk_decoder import DecodedChunk
from engine.config import StreamConfig


@dataclass
class _Request:  # what AudioOutput reads of a request
    request_id: str
    output_rows: list = field(default_factory=list)
    is_finished: bool = False
    arrival_time: float = 0.0
    first_row_time: float | None = 0.0
    finish_reason: object = None


class _Pending:
    def __init__(self, windows):
        self.windows = windows

    def result(self):
        return [DecodedChunk(w, bytes(2 * 960 * w.num_frames)) for w in self.windows]


class _Codec:
    """Records each batch's windows as (request id, chunk index)."""

    def __init__(self):
        self.batches: list[list[tuple[str, int]]] = []

    def submit(self, windows):
        self.batches.append([(w.request_id, w.index) for w in windows])
        return _Pending(windows)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _output(steps=4, batch=3):
    clock, codec = _Clock(), _Codec()
    return AudioOutput(codec, StreamConfig(), steps, batch, clock), codec, clock


def _step(out, requests, rows=1, finish=()):
    """One step: `rows` new rows for each request (a finish reason for those in `finish`),
    then the batches submitted are read back."""
    updates = []
    for r in requests:
        for _ in range(rows):
            r.output_rows.append((0,) * 8)
        updates.append((r, None, "eos" if r.request_id in finish else None))
    out.submit(updates)
    return out.collect(lambda request, reason: None)


def _to_second_chunk(out, requests):
    """Rows up to one short of each request's second chunk (the first read back)."""
    for r in requests:
        out.open(r.request_id)
    _step(out, requests, rows=15)  # the first chunk: 8 frames + the 7-row lag
    _step(out, requests, rows=24)  # one row short of frame 33


def test_first_and_last_chunks_never_wait():
    out, codec, _ = _output(steps=24, batch=64)
    a = _Request("a")
    out.open("a")
    _step(out, [a], rows=15)
    assert codec.batches == [[("a", 0)]]  # the first chunk at once
    _step(out, [a], rows=3, finish={"a"})
    assert codec.batches[-1] == [("a", 1)]  # the last one too (index 1 here)
    assert not out.deferred


def test_steady_chunks_go_when_the_batch_is_full():
    out, codec, _ = _output(steps=24, batch=3)
    reqs = [_Request(n) for n in "abc"]
    _to_second_chunk(out, reqs)
    before = len(codec.batches)
    _step(out, reqs[:1])  # a's second chunk is ready: it waits
    _step(out, reqs[1:2])  # b's: waits
    assert len(codec.batches) == before and len(out.deferred) == 2
    _step(out, reqs[2:])  # c's makes three
    assert codec.batches[before:] == [[("a", 1), ("b", 1), ("c", 1)]]
    assert not out.deferred


def test_a_steady_chunk_waits_no_more_than_its_steps():
    out, codec, _ = _output(steps=4, batch=64)
    a, b = _Request("a"), _Request("b")
    _to_second_chunk(out, [a, b])
    before = len(codec.batches)
    _step(out, [a])  # a's second chunk waits from here
    for _ in range(3):
        _step(out, [b], rows=0)
        assert len(codec.batches) == before
    _step(out, [b], rows=0)  # its fourth step since
    assert codec.batches[before:] == [[("a", 1)]]


def test_a_chunk_whose_client_runs_short_goes_at_once():
    out, codec, clock = _output(steps=24, batch=64)
    a = _Request("a")
    _to_second_chunk(out, [a])
    # the first chunk (320 ms) was read at t = 100: the second may wait only until the
    # client has less than DEFER_SLACK_S of it left
    clock.t = 100.0 + 0.32 - DEFER_SLACK_S - 0.01
    before = len(codec.batches)
    _step(out, [a])
    assert len(out.deferred) == 1 and len(codec.batches) == before
    clock.t += 0.02  # now short of the slack: it goes on the next step
    _step(out, [a], rows=0)
    assert codec.batches[before:] == [[("a", 1)]]
    b = _Request("b")
    _to_second_chunk(out, [b])
    clock.t += 0.32 - DEFER_SLACK_S + 0.01  # already short when it is ready: never waits
    _step(out, [b])
    assert codec.batches[-1] == [("b", 1)] and not out.deferred


def test_a_last_chunk_takes_its_waiting_chunk_ahead_of_it():
    out, codec, _ = _output(steps=24, batch=64)
    a, b = _Request("a"), _Request("b")
    _to_second_chunk(out, [a, b])
    _step(out, [a, b])  # both second chunks wait
    assert len(out.deferred) == 2
    events = _step(out, [a], finish={"a"})  # a ends: its last chunk and every waiting one
    assert codec.batches[-1] == [("a", 1), ("b", 1), ("a", 2)]
    assert [(e.request_id, e.audio.index) for e in events] == [("a", 1), ("b", 1), ("a", 2)]


def test_an_ended_request_leaves_nothing_waiting():
    out, codec, _ = _output(steps=24, batch=64)
    a = _Request("a")
    _to_second_chunk(out, [a])
    _step(out, [a])
    assert len(out.deferred) == 1
    out.close("a")  # aborted
    assert not out.deferred and "a" not in out.first_chunk_times
    before = len(codec.batches)
    for _ in range(30):
        _step(out, [], rows=0)
    assert len(codec.batches) == before  # nothing decoded for it


def test_a_batch_latency_counts_from_its_launch_and_off_keeps_no_clock():
    """Deferral off (the default): a batch's latency runs from when the codec took it to its
    read-back (the clonecast_codec_batch_seconds metric), and no first-chunk times are kept."""
    clock = _Clock()

    class _SlowCodec(_Codec):
        def submit(self, windows):
            clock.t += 0.05  # decoding on the CPU happens in submit
            return super().submit(windows)

    out = AudioOutput(_SlowCodec(), StreamConfig(), clock=clock)
    a = _Request("a")
    out.open("a")
    _step(out, [a], rows=15)
    assert out.take_batch_latencies() == [(0.0, 1)]
    assert not out.first_chunk_times


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"codec_defer_steps": 25}, "codec_defer_steps must be in 0..24"),
        ({"codec_defer_batch": 0}, "codec_defer_batch must be at least 1"),
        ({"codec_defer_steps": -1}, "codec_defer_steps must be an integer >= 0"),
    ],
)
def test_bad_deferral_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(plan_overrides=overrides)


def _stream(engine, starts: dict[str, int], max_rows: dict[str, int]):
    """Requests added at the given steps (so their chunks come due on different steps);
    returns each request's chunks as (index, pcm) and the codec's batch sizes."""
    chunks = {rid: [] for rid in starts}
    step = 0
    engine.audio.take_batch_latencies()
    while step <= max(starts.values()) or engine.has_unfinished():
        for rid, at in starts.items():
            if at == step:
                params = SamplingParams(seed=len(rid) + at, max_rows=max_rows[rid])
                engine.add_request(rid, f"Say {rid} slowly.", params=params)
        for e in engine.step():
            if e.audio is not None:
                chunks[e.request_id].append((e.audio.index, e.audio.pcm))
        step += 1
    return chunks, [n for _, n in engine.audio.take_batch_latencies()]


def test_deferred_batches_carry_the_same_audio_in_order(tmp_path_factory):
    """The tiny model and its codec on the CPU, four requests started on different steps:
    with steady chunks waiting up to 6 steps (a clock that stands still, so no client ever
    runs short) the codec runs fewer, larger batches, and every request's chunks come in
    the same order with the same audio as without, to the rounding of a batch's size."""
    cache = tmp_path_factory.mktemp("cache")
    base = EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=256)
    plain = Engine.from_pretrained(None, base, cache_dir=cache)
    overrides = {"codec_defer_steps": 6, "codec_defer_batch": 4}
    deferring = Engine.from_pretrained(
        None, replace(base, plan_overrides=overrides), cache_dir=cache
    )
    assert deferring.plan.codec_defer_steps == 6 and plain.plan.codec_defer_steps == 0
    deferring.audio.clock = lambda: 0.0
    starts = {"a": 0, "bb": 2, "ccc": 5, "dddd": 7}
    max_rows = {"a": 90, "bb": 100, "ccc": 80, "dddd": 95}
    want, plain_batches = _stream(plain, starts, max_rows)
    got, deferred_batches = _stream(deferring, starts, max_rows)
    for rid, chunks in got.items():
        assert [i for i, _ in chunks] == list(range(len(chunks))), rid
        assert len(chunks) >= 4, rid  # first, two steady ones at least, last
        assert [len(pcm) for _, pcm in chunks] == [len(pcm) for _, pcm in want[rid]], rid
        for (i, pcm), (_, pcm_want) in zip(chunks, want[rid], strict=True):
            # a batch's convolutions round by its size: 1 step of PCM16 at most
            diff = np.frombuffer(pcm, np.int16).astype(int) - np.frombuffer(pcm_want, np.int16)
            assert np.abs(diff).max(initial=0) <= 1, (rid, i)
    assert sum(deferred_batches) == sum(plain_batches)
    assert len(deferred_batches) < len(plain_batches)
    assert max(deferred_batches) > max(plain_batches)


@pytest.mark.parametrize("seed, kv_blocks", [(0, None), (1, 40)])
def test_aborts_and_preemptions_leave_no_chunk_behind(tmp_path_factory, seed, kv_blocks):
    """Requests started at random steps, some aborted mid-stream, and (with 40 KV blocks)
    preempted, on a clock that moves 5-30 ms a step: every request's chunks arrive in order
    with its last chunk carrying its finish, nothing follows an abort, the engine has work
    while a chunk waits, and nothing is left waiting or remembered at the end."""
    rng = random.Random(seed)
    overrides = {"codec_defer_steps": 6, "codec_defer_batch": 4}
    config = EngineConfig(
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        num_kv_blocks=kv_blocks,
        plan_overrides=overrides,
    )
    engine = Engine.from_pretrained(None, config, cache_dir=tmp_path_factory.mktemp("cache"))
    clock = _Clock()
    engine.audio.clock = clock
    chunks: dict[str, list[int]] = {}
    aborted, finished, most_waiting = set(), set(), 0
    for _ in range(2000):
        clock.t += rng.choice([0.005, 0.01, 0.03])
        if len(chunks) < 10 and rng.random() < 0.2:
            rid = f"r{len(chunks)}"
            params = SamplingParams(seed=len(chunks), max_rows=rng.randint(40, 120))
            engine.add_request(rid, f"Say {rid} slowly please.", params=params)
            chunks[rid] = []
        live = sorted(set(chunks) - aborted - finished)
        if live and rng.random() < 0.03:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        if len(chunks) == 10 and not engine.has_unfinished():
            break
        for e in engine.step():
            assert e.request_id not in aborted | finished, e
            if e.audio is not None:
                chunks[e.request_id].append(e.audio.index)
                assert e.finished or not e.audio.is_last, e
            if e.finished:
                finished.add(e.request_id)
                assert chunks[e.request_id] == list(range(len(chunks[e.request_id])))
        most_waiting = max(most_waiting, len(engine.audio.deferred))
        assert engine.has_unfinished() or not engine.audio.deferred
    assert len(chunks) == 10 and not engine.has_unfinished()
    assert finished | aborted == set(chunks) and aborted
    assert most_waiting >= 2  # chunks did wait for each other
    if kv_blocks:
        assert engine.stats.num_preemptions > 0
    audio = engine.audio
    assert not (audio.deferred or audio.first_chunk_times or audio.streams or audio.held)
