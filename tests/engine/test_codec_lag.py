"""The plan's `codec_lag_steps`: a codec batch is read at the first step at which it has
finished, or waited for once it is that many steps overdue; the audio and its order are the
same either way. On the CPU every batch has finished when submitted, so a codec still running
is simulated by `PendingChunks.ready`."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.codec.chunk_decoder import PendingChunks

REQUESTS = (("a", "First of two.", 3, 60), ("b", "Second, shorter.", 4, 41))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _run(cache, lag: int, device: str = "cpu") -> list[tuple[int, str, int, bool, bytes]]:
    """(step, request, chunk index, finished, pcm) of every audio event, in event order."""
    config = EngineConfig(
        device=device, block_size=8, max_num_seqs=4, max_num_batched_tokens=256,
        plan_overrides={"codec_lag_steps": lag},
    )  # fmt: skip
    engine = Engine.from_pretrained(None, config, cache_dir=cache)
    assert engine.plan.codec_lag_steps == lag
    for rid, text, seed, rows in REQUESTS:
        engine.add_request(rid, text, params=SamplingParams(seed=seed, max_rows=rows))
    chunks, step = [], 0
    while engine.has_unfinished():
        step += 1
        for e in engine.step():
            if e.audio is not None:
                chunks.append((step, e.request_id, e.audio.index, e.finished, e.audio.pcm))
    return chunks


def test_a_finished_batch_is_read_at_once_whatever_the_lag(cache):
    assert _run(cache, 2) == _run(cache, 0)


def test_a_running_batch_is_read_when_overdue_with_the_same_audio_in_order(cache, monkeypatch):
    """Never finished: each batch is waited for `lag` steps later than without a lag (those
    still unread when nothing is left to run are read at once), and every chunk is the same,
    in the same order; each request's finish still comes with its last chunk."""
    plain = _run(cache, 0)
    monkeypatch.setattr(PendingChunks, "ready", lambda self: False)
    lagged = _run(cache, 2)
    assert [c[1:] for c in lagged] == [c[1:] for c in plain]
    last_step = lagged[-1][0]
    delays = [late[0] - on_time[0] for late, on_time in zip(lagged, plain, strict=True)]
    for (step, *_), delay in zip(lagged, delays, strict=True):
        assert delay == 2 or (step == last_step and 0 <= delay < 2), delays
    assert delays.count(2) >= len(delays) - 2
    assert [c[1] for c in lagged if c[3]] == [c[1] for c in plain if c[3]] == ["b", "a"]


@pytest.mark.cuda
def test_on_the_gpu_a_lagged_read_gives_the_same_chunks(cache):
    """The codec on its own CUDA stream, in graphs, polled through its events."""
    plain, lagged = _run(cache, 0, "cuda"), _run(cache, 3, "cuda")
    assert [c[1:] for c in lagged] == [c[1:] for c in plain]
    assert all(late[0] >= on_time[0] for late, on_time in zip(lagged, plain, strict=True))


def test_a_batch_whose_event_reports_an_error_is_read_at_once(cache, monkeypatch):
    """A CUDA error surfacing at the poll (not at the read) must not fail the whole step:
    the batch is read as if finished, where a failed read-back ends only its requests."""

    class FaultyEvent:  # what a CUDA event does after a fault on its stream
        def query(self):
            raise RuntimeError("CUDA error: an illegal instruction was encountered")

        def synchronize(self):
            pass  # (here the read-back itself works: the audio must be the same)

    plain = _run(cache, 0)
    add_batch = PendingChunks.add_batch
    monkeypatch.setattr(
        PendingChunks,
        "add_batch",
        lambda self, members, pcm, finite, event: add_batch(
            self, members, pcm, finite, FaultyEvent()
        ),
    )
    assert _run(cache, 2) == plain
