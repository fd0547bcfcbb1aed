"""The voice cache: hits and misses, LRU by bytes, one encode per key under concurrency,
failures; and through the real `Codec` (file and waveform keys, real encoder)."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.codec.audio_io import HOP, AudioLimits, ReferenceAudioError, decode_audio
from engine.codec.voice_cache import BYTES_PER_FRAME, VoiceCache

JOIN_TIMEOUT = 20.0  # generous: only there so that a deadlock fails instead of hanging


def frames(n: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(seed)
    return tuple(tuple(int(c) for c in row) for row in rng.integers(0, 1024, (n, 8)))


class Encoder:
    """An encode callable that counts its calls (thread-safe)."""

    def __init__(self, result, *, sleep: float = 0.0, fail: bool = False):
        self.result, self.sleep, self.fail = result, sleep, fail
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail:
            raise ValueError("encoder exploded")
        return self.result


def never():
    raise AssertionError("encode must not run on a cache hit")


def run_threads(n: int, target) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def join_all(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "deadlock: threads still waiting"


# --------------------------------------------------------------------------- basics


def test_miss_then_hit_does_not_encode_again():
    cache = VoiceCache()
    f = frames(10, 0)
    enc = Encoder(f)
    assert cache.get_or_encode(b"a", enc) == (f, False)
    assert enc.calls == 1
    assert cache.get_or_encode(b"a", never) == (f, True)
    assert cache.get_or_encode(b"a", never) == (f, True)
    assert enc.calls == 1
    s = cache.stats
    assert (s.hits, s.misses, s.entries, s.bytes, s.evictions) == (2, 1, 1, 10 * BYTES_PER_FRAME, 0)
    # Another key is a miss of its own.
    g = frames(3, 1)
    assert cache.get_or_encode(b"b", Encoder(g)) == (g, False)
    assert (cache.stats.misses, cache.stats.entries) == (2, 2)
    assert cache.stats.bytes == 13 * BYTES_PER_FRAME


def test_lru_eviction_is_bounded_by_bytes_and_keeps_the_recently_used():
    cache = VoiceCache(max_bytes=30 * BYTES_PER_FRAME)  # room for three 10-frame voices
    fa, fb, fc, fd = (frames(10, i) for i in range(4))
    for key, f in ((b"A", fa), (b"B", fb), (b"C", fc)):
        cache.get_or_encode(key, Encoder(f))
    assert (cache.stats.entries, cache.stats.bytes, cache.stats.evictions) == (
        3,
        30 * BYTES_PER_FRAME,
        0,
    )
    assert cache.get_or_encode(b"A", never) == (fa, True)  # A is now the most recent
    cache.get_or_encode(b"D", Encoder(fd))  # over budget: B, the least recent, goes
    assert (cache.stats.entries, cache.stats.bytes, cache.stats.evictions) == (
        3,
        30 * BYTES_PER_FRAME,
        1,
    )
    for key, f in ((b"A", fa), (b"C", fc), (b"D", fd)):  # all still there (order now A, C, D)
        assert cache.get_or_encode(key, never) == (f, True)
    enc_b = Encoder(fb)
    assert cache.get_or_encode(b"B", enc_b) == (fb, False)  # B was evicted: encoded again
    assert enc_b.calls == 1
    assert cache.stats.evictions == 2  # ... which pushed out A, now the least recent
    assert cache.get_or_encode(b"D", never) == (fd, True)
    enc_a = Encoder(fa)
    assert cache.get_or_encode(b"A", enc_a) == (fa, False)
    assert enc_a.calls == 1
    s = cache.stats
    assert s.entries == 3 and s.bytes == 30 * BYTES_PER_FRAME and s.evictions == 3
    assert s.bytes <= cache.max_bytes


def test_a_big_entry_evicts_as_many_as_needed():
    cache = VoiceCache(max_bytes=30 * BYTES_PER_FRAME)
    for i, key in enumerate((b"A", b"B", b"C")):
        cache.get_or_encode(key, Encoder(frames(10, i)))
    big = frames(25, 9)
    cache.get_or_encode(b"E", Encoder(big))
    s = cache.stats
    assert (s.entries, s.bytes, s.evictions) == (1, 25 * BYTES_PER_FRAME, 3)
    assert cache.get_or_encode(b"E", never) == (big, True)
    small = frames(5, 10)
    cache.get_or_encode(b"F", Encoder(small))  # 30 frames: fits exactly, nothing evicted
    assert (cache.stats.entries, cache.stats.bytes, cache.stats.evictions) == (
        2,
        30 * BYTES_PER_FRAME,
        3,
    )


def test_an_entry_larger_than_the_whole_cache_is_returned_and_kept_alone():
    # The code keeps the newest entry even when it alone exceeds max_bytes (it never evicts
    # the entry it has just stored); everything older is evicted for it.
    cache = VoiceCache(max_bytes=10 * BYTES_PER_FRAME)
    small = frames(4, 0)
    cache.get_or_encode(b"s", Encoder(small))
    huge = frames(40, 1)
    assert cache.get_or_encode(b"h", Encoder(huge)) == (huge, False)
    s = cache.stats
    assert (s.entries, s.bytes, s.evictions) == (1, 40 * BYTES_PER_FRAME, 1)
    assert cache.get_or_encode(b"h", never) == (huge, True)


# --------------------------------------------------------------------------- concurrency


def test_concurrent_requests_for_one_new_key_encode_once():
    cache = VoiceCache()
    f = frames(12, 3)
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_encode():
        calls.append(threading.get_ident())
        started.set()
        assert release.wait(JOIN_TIMEOUT)
        time.sleep(0.05)
        return f

    barrier = threading.Barrier(8)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            barrier.wait(JOIN_TIMEOUT)
            results[i] = cache.get_or_encode(b"voice", slow_encode)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = run_threads(8, worker)
    assert started.wait(JOIN_TIMEOUT)
    time.sleep(0.2)  # give the other seven time to reach the cache and block
    assert len(calls) == 1  # they wait for the one encode instead of starting their own
    assert results == {}  # and nobody has an answer before it finishes
    release.set()
    join_all(threads)
    assert errors == []
    assert len(calls) == 1
    assert len(results) == 8
    assert all(frames_ == f for frames_, _ in results.values())
    # The leader reports a miss; the waiters find the stored result afterwards: hits.
    cached = sorted(was_cached for _, was_cached in results.values())
    assert cached == [False] + [True] * 7
    s = cache.stats
    assert (s.misses, s.hits, s.entries) == (1, 7, 1)
    assert cache._inflight == {}


def test_concurrent_same_key_with_sleeping_encoder():
    cache = VoiceCache()
    f = frames(6, 4)
    enc = Encoder(f, sleep=0.2)
    barrier = threading.Barrier(8)
    results = []

    def worker(i):
        barrier.wait(JOIN_TIMEOUT)
        results.append(cache.get_or_encode(b"k", enc))

    join_all(run_threads(8, worker))
    assert enc.calls == 1
    assert len(results) == 8 and all(r[0] == f for r in results)
    assert [r[1] for r in results].count(False) == 1
    assert (cache.stats.misses, cache.stats.hits) == (1, 7)


def test_different_keys_encode_in_parallel():
    cache = VoiceCache()
    # Each encode waits for the other to be running too: if the cache serialised encodes of
    # different keys, the barrier would time out and the encodes would fail.
    both_running = threading.Barrier(2, timeout=JOIN_TIMEOUT / 2)
    expected = {b"x": frames(5, 5), b"y": frames(7, 6)}
    calls: list[bytes] = []
    results: dict[bytes, tuple] = {}
    errors: list[BaseException] = []

    def worker(i):
        key = (b"x", b"y")[i]

        def enc():
            calls.append(key)
            both_running.wait()
            return expected[key]

        try:
            results[key] = cache.get_or_encode(key, enc)
        except BaseException as exc:  # reported below
            errors.append(exc)

    join_all(run_threads(2, worker))
    assert errors == []
    assert sorted(calls) == [b"x", b"y"]
    assert results == {k: (v, False) for k, v in expected.items()}
    assert (cache.stats.misses, cache.stats.entries) == (2, 2)


# --------------------------------------------------------------------------- failures


def test_a_failing_encode_raises_caches_nothing_and_can_be_retried():
    cache = VoiceCache()
    bad = Encoder(None, fail=True)
    with pytest.raises(ValueError, match="exploded"):
        cache.get_or_encode(b"k", bad)
    assert bad.calls == 1
    s = cache.stats
    assert (s.entries, s.bytes, s.hits) == (0, 0, 0)
    assert cache._inflight == {}
    f = frames(4, 7)
    good = Encoder(f)
    assert cache.get_or_encode(b"k", good) == (f, False)  # no hang, a fresh attempt
    assert good.calls == 1
    assert cache.get_or_encode(b"k", never) == (f, True)
    assert (cache.stats.misses, cache.stats.entries) == (2, 1)


def test_waiters_on_a_failing_leader_retry_themselves():
    cache = VoiceCache()
    f = frames(9, 8)
    started, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    calls = []

    def flaky():  # the first encode fails (after the others are waiting); later ones work
        with lock:
            calls.append(threading.get_ident())
            first = len(calls) == 1
        if first:
            started.set()
            assert release.wait(JOIN_TIMEOUT)
            raise ValueError("first encode fails")
        return f

    barrier = threading.Barrier(8)
    outcomes: list = []

    def worker(i):
        barrier.wait(JOIN_TIMEOUT)
        try:
            outcomes.append(cache.get_or_encode(b"k", flaky))
        except ValueError as exc:
            outcomes.append(exc)

    threads = run_threads(8, worker)
    assert started.wait(JOIN_TIMEOUT)
    time.sleep(0.2)
    assert len(calls) == 1
    release.set()
    join_all(threads)
    failures = [o for o in outcomes if isinstance(o, ValueError)]
    successes = [o for o in outcomes if not isinstance(o, ValueError)]
    assert len(failures) == 1  # only the caller whose encode failed sees the error
    assert len(successes) == 7 and all(fr == f for fr, _ in successes)
    assert len(calls) == 2  # one waiter took over and encoded; the rest hit its result
    assert sorted(c for _, c in successes) == [False] + [True] * 6
    assert (cache.stats.misses, cache.stats.hits, cache.stats.entries) == (2, 6, 1)
    assert cache._inflight == {}


def test_when_every_encode_fails_every_caller_fails_without_deadlock():
    cache = VoiceCache()
    bad = Encoder(None, sleep=0.05, fail=True)
    barrier = threading.Barrier(8)
    outcomes: list = []

    def worker(i):
        barrier.wait(JOIN_TIMEOUT)
        try:
            outcomes.append(cache.get_or_encode(b"k", bad))
        except ValueError as exc:
            outcomes.append(exc)

    join_all(run_threads(8, worker))
    assert len(outcomes) == 8 and all(isinstance(o, ValueError) for o in outcomes)
    assert bad.calls == 8  # each caller, finding nothing cached, tried once itself
    assert (cache.stats.misses, cache.stats.entries, cache.stats.bytes) == (8, 0, 0)
    assert cache._inflight == {}


# --------------------------------------------------------------------------- real codec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.checkpoint_writer import default_model_dir

    return default_model_dir(tmp_path_factory.mktemp("codec-cache"))


@pytest.fixture
def codec(model_dir):
    from engine.codec.codec import Codec

    return Codec.load(model_dir, torch.device("cpu"), 1 << 20)


def voiced(sr: int, seconds: float, f0: float) -> np.ndarray:
    t = np.arange(int(round(sr * seconds))) / sr
    env = 0.2 + 0.8 * (0.5 - 0.5 * np.cos(2 * np.pi * t / seconds))
    x = np.sin(2 * np.pi * f0 * t) + 0.4 * np.sin(4 * np.pi * f0 * t + 0.3)
    return (0.2 * env * x).astype(np.float32)


def wav(samples: np.ndarray, sr: int, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


def check_frames(fr, n_frames: int) -> None:
    assert isinstance(fr, tuple) and len(fr) == n_frames
    for row in fr:
        assert isinstance(row, tuple) and len(row) == 8
        assert all(isinstance(c, int) and 0 <= c <= 1023 for c in row)


def test_codec_encodes_the_same_file_once(codec):
    limits = AudioLimits()
    src = voiced(16000, 1.27, 180.0)
    data = wav(src, 16000, "PCM_16")
    n_frames = decode_audio(data, limits).shape[0] // HOP
    assert n_frames == 32  # 1.27 s = 31.75 frames, padded to 32

    fr, was_cached = codec.encode_file(data, limits)
    assert was_cached is False
    assert codec.encoder.num_encodes == 1
    check_frames(fr, n_frames)
    assert len({row for row in fr}) > 1  # not one code repeated

    again, was_cached = codec.encode_file(bytes(data), limits)  # equal bytes, new object
    assert was_cached is True
    assert again == fr
    assert codec.encoder.num_encodes == 1

    other = wav(voiced(16000, 1.27, 260.0), 16000, "PCM_16")
    fr2, was_cached = codec.encode_file(other, limits)
    assert was_cached is False
    assert codec.encoder.num_encodes == 2
    check_frames(fr2, n_frames)
    s = codec.voices.stats
    assert (s.hits, s.misses, s.entries) == (1, 2, 2)


def test_codec_waveform_key_is_separate_but_codes_match_lossless_24k_file(codec):
    limits = AudioLimits()
    src = voiced(24000, 1.0, 200.0)  # exactly 25 frames
    fr_file, was_cached = codec.encode_file(wav(src, 24000, "FLOAT"), limits)
    assert was_cached is False
    check_frames(fr_file, 25)

    fr_wave, was_cached = codec.encode_waveform(torch.from_numpy(src), 24000, limits)
    assert was_cached is False  # a different cache key from the file's
    assert codec.encoder.num_encodes == 2
    assert fr_wave == fr_file  # the same samples reached the encoder

    fr_again, was_cached = codec.encode_waveform(torch.from_numpy(src.copy()), 24000, limits)
    assert was_cached is True and fr_again == fr_file
    assert codec.encoder.num_encodes == 2
    # Same samples, another declared rate: another key (and a resampled input).
    _, was_cached = codec.encode_waveform(torch.from_numpy(src), 16000, limits)
    assert was_cached is False
    assert codec.encoder.num_encodes == 3


def test_codec_rejects_bad_audio_without_encoding_or_caching(codec):
    with pytest.raises(ReferenceAudioError) as info:
        codec.encode_file(b"definitely not audio" * 20, AudioLimits())
    assert info.value.code == "audio_undecodable"
    with pytest.raises(ReferenceAudioError) as info:
        codec.encode_waveform(torch.zeros(24000), 24000, AudioLimits())
    assert info.value.code == "audio_silent"
    assert codec.encoder.num_encodes == 0
    assert (codec.voices.stats.entries, codec.voices.stats.bytes) == (0, 0)
    assert codec.voices._inflight == {}
