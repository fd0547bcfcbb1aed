"""Audio streaming through Engine.step on the embedded default model (tiny random codec)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from engine import ConfigError, Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=256)
    return Engine.from_pretrained(None, cfg, cache_dir=tmp_path_factory.mktemp("cache"))


def _speechlike(seconds: float, rate: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(100, 250)
    x = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 6)) * np.sin(2 * np.pi * 3 * t)
    buf = io.BytesIO()
    sf.write(buf, (0.2 * x).astype(np.float32), rate, format="FLAC")
    return buf.getvalue()


def _collect(engine, rid):
    events = []
    while engine.has_unfinished():
        events += [e for e in engine.step() if e.request_id == rid]
    return events


def test_chunks_stream_with_exact_sizes_and_timestamps(engine):
    engine.add_request("s", "Stream me.", params=SamplingParams(seed=3, max_rows=75))
    events = _collect(engine, "s")
    chunks = [e.audio for e in events if e.audio is not None]
    sizes = [len(c.pcm) for c in chunks]
    # 75 rows at the cap -> 67 frames: 8 + 25 + 25 + 9.
    assert sizes == [15_360, 48_000, 48_000, 9 * 1920]
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert [c.is_last for c in chunks] == [False, False, False, True]
    assert [(c.start_frame, c.end_frame) for c in chunks] == [(0, 8), (8, 33), (33, 58), (58, 67)]
    first_chunk = next(i for i, e in enumerate(events) if e.audio is not None)
    # ready after the prefill row + 14 decode rows (8 frames + the 7-row lag); read back on
    # the next step, in an event of its own
    assert sum(len(e.new_rows) for e in events[:first_chunk]) == 15
    assert not events[first_chunk].new_rows
    for c in chunks:
        assert c.arrival_time <= c.first_row_time <= c.ready_time
    assert events[-1].finished and events[-1].audio is chunks[-1]


def test_emit_hands_out_audio_before_the_rows_in_the_same_order(engine):
    """`step(emit=...)`: the audio read back at the start of a step leaves through `emit`
    (before the step waits for the GPU's rows); emitted + returned events are the events of
    a plain `step()`, in the same order, for two requests with the same seeds."""

    def run(use_emit: bool):
        engine.add_request("e1", "Emit early.", params=SamplingParams(seed=11, max_rows=40))
        engine.add_request("e2", "And me.", params=SamplingParams(seed=12, max_rows=52))
        events, emitted_calls, returned = [], [], []

        def emit(outputs):
            emitted_calls.append(list(outputs))
            events.extend(outputs)

        while engine.has_unfinished():
            returned.append(engine.step(emit=emit) if use_emit else engine.step())
            events.extend(returned[-1])
        return events, emitted_calls, returned

    plain, _, _ = run(False)
    early, calls, returned = run(True)
    key = lambda e: (  # noqa: E731
        e.request_id,
        tuple(e.new_rows),
        e.finished,
        e.audio.index if e.audio else None,
        e.audio.pcm if e.audio else None,
    )
    assert [key(e) for e in early] == [key(e) for e in plain]
    chunks = sum(e.audio is not None for e in plain)
    assert chunks >= 4
    # emit carries no row here (KV blocks never run short); every chunk goes out through it
    # except those read once the GPU has nothing left to run (read before the last return)
    assert all(not e.new_rows for c in calls for e in c)
    assert not any(e.audio is not None for r in returned[:-1] for e in r)
    late = sum(e.audio is not None for e in returned[-1])
    assert sum(e.audio is not None for c in calls for e in c) == chunks - late >= 3


def test_a_raising_emit_still_reads_the_rows(engine):
    """An exception from `emit` propagates, but the step has read its rows: nothing stays in
    flight and the request carries on to its end with every row."""
    engine.add_request("boom", "Emit fails once.", params=SamplingParams(seed=13, max_rows=45))
    calls = []

    def emit(outputs):
        calls.append(outputs)
        if len(calls) == 1:
            raise RuntimeError("client gone")

    raised, events = False, []
    while engine.has_unfinished():
        try:
            events += engine.step(emit=emit)
        except RuntimeError as exc:
            assert str(exc) == "client gone" and not raised
            raised = True
            request = engine.scheduler.requests.get("boom") or engine.audio.held.get("boom")
            assert request is not None and request.num_inflight <= 1  # only the new step
    assert raised and len(calls) >= 2
    events += [e for c in calls[1:] for e in c]
    [end] = [e for e in events if e.request_id == "boom" and e.finished]
    assert end.finish_reason == "length" and len(end.rows) == 45


def _until_last_row(engine, rid: str, busy: str, max_rows: int, seed: int) -> list:
    """Adds `rid` (capped at `max_rows`) beside a longer request `busy` that keeps the GPU
    working, and steps until `rid`'s last row is out; returns `rid`'s events so far. Its last
    chunk is then still decoding: with nothing left to run, audio would not be held back."""
    engine.add_request(busy, "Keeps going.", params=SamplingParams(seed=5, max_rows=45))
    engine.add_request(rid, "Ends late.", params=SamplingParams(seed=seed, max_rows=max_rows))
    rows, events = 0, []
    while rows < max_rows:
        step = [e for e in engine.step() if e.request_id == rid]
        rows += sum(len(e.new_rows) for e in step)
        events += step
    return events


def test_a_request_ends_when_its_last_chunk_is_read(engine):
    """Its blocks are freed with the last row; the finishing event (with the last chunk)
    comes when the codec's work is read back, one step later, and nothing follows it."""
    events = _until_last_row(engine, "late", "busy", 30, seed=4)
    assert not any(e.finished for e in events)  # the last row is out, its chunk is not
    assert engine.stats.num_running == 1  # but the request no longer holds a slot
    tail = _collect(engine, "late")
    assert len(tail) == 1 and tail[0].finished and tail[0].audio.is_last
    assert len(tail[0].rows) == 30 and tail[0].finish_reason == "length"


def test_abort_while_the_last_chunk_decodes_reports_nothing_more(engine):
    _until_last_row(engine, "held", "busy2", 30, seed=2)
    assert engine.abort("held")  # finished inside, its last event not yet reported
    assert not engine.abort("held")
    assert _collect(engine, "held") == []
    assert not engine.has_unfinished()


def test_a_held_request_keeps_its_id_until_its_finish_is_reported(engine):
    _until_last_row(engine, "same", "busy3", 30, seed=2)
    assert len(engine.rows("same")) == 30  # finished inside, not yet reported
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request("same", "Second use.", params=SamplingParams(seed=9, max_rows=20))
    first = _collect(engine, "same")
    assert [e.finished for e in first] == [True] and len(first[0].rows) == 30
    engine.add_request("same", "Second use.", params=SamplingParams(seed=9, max_rows=20))
    second = _collect(engine, "same")
    assert [e.finished for e in second].count(True) == 1 and len(second[-1].rows) == 20


def test_a_codec_batch_that_cannot_be_read_back_ends_only_its_requests(engine, monkeypatch):
    """An error while reading a batch back (on CUDA: surfacing at the event) ends the requests
    whose windows were in it, with an error; a codes-only request goes on to its finish."""
    from engine.codec.chunk_decoder import PendingChunks

    original, calls = PendingChunks.result, []

    def failing_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected read-back failure")
        return original(self)

    monkeypatch.setattr(PendingChunks, "result", failing_once)
    engine.add_request("x", "Has audio.", params=SamplingParams(seed=1, max_rows=40))
    engine.add_request("y", "Codes only.", params=SamplingParams(seed=2, max_rows=40), audio=False)
    finishes = {}
    while engine.has_unfinished():
        for e in engine.step():
            if e.finished:
                assert e.request_id not in finishes
                finishes[e.request_id] = (e.finish_reason, len(e.rows))
    assert finishes["x"][0] == "error" and finishes["y"] == ("length", 40)
    assert engine.stats.num_running == 0 and not engine.audio.held and not engine.audio.in_flight


def test_generate_returns_the_concatenated_stream(engine):
    [r] = engine.generate(["Whole."], params=SamplingParams(seed=5, max_rows=40))
    assert len(r.pcm) == (40 - 8) * 1920
    assert np.abs(np.frombuffer(r.pcm, "<i2")).max() > 0


def test_codes_only_requests_carry_no_audio(engine):
    engine.add_request(
        "codes", "No audio.", params=SamplingParams(seed=1, max_rows=20), audio=False
    )
    assert all(e.audio is None for e in _collect(engine, "codes"))


def test_voice_cache_hit_skips_encoding_and_prefix_reuse_skips_prefill(engine):
    data = _speechlike(3.0, 16000, seed=1)
    before = engine.stats
    voice = engine.encode_reference(data, "what the reference says")
    again = engine.encode_reference(data, "what the reference says")
    assert again == voice
    mid = engine.stats
    assert mid.num_voice_encodes == before.num_voice_encodes + 1
    assert mid.num_voice_cache_hits == before.num_voice_cache_hits + 1
    assert len(voice.codes) == 75  # 3 s at 25 frames/s
    engine.generate(
        ["First sentence."], references=[voice], params=SamplingParams(seed=1, max_rows=9)
    )
    first_prefill = engine.stats.num_prefill_tokens_computed - mid.num_prefill_tokens_computed
    mid2 = engine.stats
    engine.generate(["Second one."], references=[again], params=SamplingParams(seed=2, max_rows=9))
    second_prefill = engine.stats.num_prefill_tokens_computed - mid2.num_prefill_tokens_computed
    assert engine.stats.num_prefix_cached_tokens - mid2.num_prefix_cached_tokens >= 80
    assert second_prefill < first_prefill / 3


def test_bad_reference_audio_is_a_clear_error(engine):
    with pytest.raises(ConfigError) as err:
        engine.encode_reference(b"definitely not audio" * 50)
    assert err.value.code == "audio_undecodable"


def test_codec_failure_ends_only_that_request(engine, monkeypatch):
    decoder = engine.codec.chunks.decoder
    original = decoder.forward

    def poisoned(codes):
        audio = original(codes)
        if len(codes) < 2:
            return audio
        # The first window of a shared batch: the victim's (it was added first).
        bad = torch.arange(len(codes)) == 0
        return torch.where(bad[:, None, None], torch.nan, audio)

    monkeypatch.setattr(decoder, "forward", poisoned)
    engine.add_request("victim", "one", params=SamplingParams(seed=1, max_rows=40))
    engine.add_request("fine", "two", params=SamplingParams(seed=2, max_rows=40))
    finals = {}
    while engine.has_unfinished():
        for e in engine.step():
            if e.finished:
                finals[e.request_id] = e
    monkeypatch.undo()
    assert finals["victim"].finish_reason == "error"
    assert finals["victim"].audio.error and finals["victim"].audio.is_last
    assert finals["fine"].finish_reason == "length"
    assert engine.stats.num_free_kv_blocks == engine.stats.num_kv_blocks


def test_abort_mid_stream_stops_audio_and_frees_blocks(engine):
    engine.add_request("ab", "abort me", params=SamplingParams(seed=1, max_rows=200))
    for _ in range(20):
        engine.step()
    assert engine.abort("ab")
    assert engine.step() == []
    assert engine.stats.num_free_kv_blocks == engine.stats.num_kv_blocks


def test_engine_without_codec_rejects_audio_requests(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=2))
    assert engine.codec is None
    with pytest.raises(ConfigError, match="no codec"):
        engine.add_request("a", "text", audio=True)
    engine.add_request("b", "text", params=SamplingParams(max_rows=2))  # codes only by default
    assert len(engine.generate(["x"], params=SamplingParams(max_rows=2))[0].rows) == 2


def test_a_failed_last_chunk_ends_the_request_with_error(engine, monkeypatch):
    from engine.codec.chunk_decoder import DecodedChunk

    original = engine.codec.chunks.submit

    def failing_last(windows):
        pending = original(windows)
        result = pending.result

        def with_failure():
            return [
                DecodedChunk(d.window, b"", "injected") if d.window.is_last else d for d in result()
            ]

        pending.result = with_failure
        return pending

    monkeypatch.setattr(engine.codec.chunks, "submit", failing_last)
    [result] = engine.generate(["tail fails"], params=SamplingParams(seed=1, max_rows=20))
    assert result.finish_reason == "error"


def test_generate_is_all_or_nothing(engine):
    with pytest.raises(ConfigError):
        engine.generate(["fine", "   "], params=SamplingParams(max_rows=2))
    assert not engine.has_unfinished()


def test_observations_name_each_steps_kind_queue_times_and_codec_batches(engine):
    """`take_observations`: every step once with what it launched (the first prefills both
    prompts, later ones decode one row each, a mixed step admits a late request beside a
    decode), each request's queue time once, and a latency per codec batch read back; then
    nothing until the next steps."""
    engine.take_observations()  # what earlier tests left
    engine.add_request("o1", "Observed one.", params=SamplingParams(seed=1, max_rows=40))
    engine.add_request("o2", "Observed two.", params=SamplingParams(seed=2, max_rows=40))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            engine.add_request("o3", "Late.", params=SamplingParams(seed=3, max_rows=12))
    seen = engine.take_observations()
    assert len(seen.steps) == steps and all(seconds > 0 for seconds, _ in seen.steps)
    kinds = [shape.kind for _, shape in seen.steps]
    first = seen.steps[0][1]
    assert first.kind == "prefill" and first.requests == 2 and first.tokens > 10
    assert seen.steps[3][1].kind == "mixed" and seen.steps[3][1].requests == 3
    decodes = [shape for _, shape in seen.steps if shape.kind == "decode"]
    assert len(decodes) >= 30 and all(s.tokens == s.requests for s in decodes)
    assert set(kinds) <= {"prefill", "decode", "mixed", "readback"}
    assert kinds[-1] == "readback"  # the last rows and audio read back with nothing launched
    assert len(seen.queue_seconds) == 3 and all(q >= 0 for q in seen.queue_seconds)
    windows = sum(n for _, n in seen.codec_batches)
    assert windows >= 2 + 2 + 1 and all(seconds >= 0 for seconds, _ in seen.codec_batches)
    assert not engine.take_observations()
