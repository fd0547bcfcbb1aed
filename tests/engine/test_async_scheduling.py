"""Asynchronous scheduling on the CPU: the host launches step N+1 before it reads step N, so a
finish is seen one step late. Rows, finish reasons and audio must not depend on it."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.config import EOC
from engine.runner import sample_buckets
from tests.engine.test_parity import make_reference


def _force_eos(engine: Engine) -> None:
    """Codebook 0 emits EOC from row `10 + seed % 7` on (a property of the request alone, not
    of the step it runs in), so requests end by EOS at different steps."""
    sampler = engine.runner.sampler
    original = sampler.sample

    def sample(logits, forbidden, slots, row_index):
        force = row_index >= 10 + sampler.seed[slots] % 7
        logits = logits.clone()
        logits[:, 0, EOC] += torch.where(force, 1e9, 0.0)
        return original(logits, forbidden, slots, row_index)

    sampler.sample = sample


def _engine(tiny_ckpt, async_scheduling: bool, num_kv_blocks: int | None, max_num_seqs: int):
    """Block size 4, a 48-token budget, EOS forced per request (see `_force_eos`)."""
    config = EngineConfig(
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=48,
        num_kv_blocks=num_kv_blocks,
        plan_overrides={"async_scheduling": async_scheduling},
    )
    engine = Engine.from_pretrained(tiny_ckpt, config)
    _force_eos(engine)
    return engine


def _run(tiny_ckpt, async_scheduling: bool, num_kv_blocks: int | None = None):
    engine = _engine(tiny_ckpt, async_scheduling, num_kv_blocks, max_num_seqs=6)
    texts, refs, params = [], [], []
    for i in range(14):
        texts.append(f"request {i} " * (1 + i % 4))
        refs.append(make_reference(i, 9 + 3 * i, "ref") if i % 3 == 0 else None)
        # Even seeds end by EOS (row 10..23); odd ones hit a max_rows below that first.
        params.append(SamplingParams(seed=2 * i + (i % 2), max_rows=40 if i % 2 == 0 else 9))
    results = engine.generate(texts, references=refs, params=params, audio=False)
    return engine, results


@pytest.mark.parametrize("num_kv_blocks", [None, 48])
def test_async_and_sync_scheduling_give_the_same_rows(tiny_ckpt, num_kv_blocks):
    sync_engine, sync = _run(tiny_ckpt, False, num_kv_blocks)
    async_engine, asynchronous = _run(tiny_ckpt, True, num_kv_blocks)
    assert [r.rows for r in asynchronous] == [r.rows for r in sync]
    assert [r.finish_reason for r in asynchronous] == [r.finish_reason for r in sync]
    reasons = {r.finish_reason for r in sync}
    assert reasons == {"eos", "length"}
    for i, r in enumerate(sync):
        if r.finish_reason == "eos":
            assert len(r.rows) == 10 + (2 * i) % 7 + 8  # EOC row, then the 7-row ramp
        else:
            assert len(r.rows) == 9
    # Rows that finished requests computed in flight are dropped, never reported.
    stats = async_engine.stats
    assert stats.num_rows_generated == sum(len(r.rows) for r in asynchronous)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert not async_engine.has_unfinished()
    if num_kv_blocks is not None:  # the small cache really preempted, in both modes
        assert sync_engine.stats.num_preemptions > 0
        assert stats.num_preemptions > 0


def test_a_request_at_its_row_cap_is_not_scheduled_again(tiny_ckpt):
    """With its last row in flight a request is skipped: no wasted row, no extra block."""
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, max_num_seqs=2))
    engine.add_request("cap", "short", params=SamplingParams(seed=3, max_rows=2), audio=False)
    launched = []
    original = engine.runner.launch

    def launch(sched):
        launched.append([(c.request.request_id, c.num_tokens) for c in sched.chunks])
        return original(sched)

    engine.runner.launch = launch
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert [e.finished for e in events] == [False, True]
    assert len(launched) == 2  # the prefill (row 1) and one decode (row 2), nothing after
    assert engine.stats.num_rows_generated == 2


def test_sample_buckets_cover_every_row_count():
    for max_rows in (1, 3, 8, 17, 64, 256):
        buckets = sample_buckets(max_rows)
        assert buckets[-1] == max_rows and list(buckets) == sorted(set(buckets))
        for n in range(1, max_rows + 1):
            b = next(b for b in buckets if b >= n)
            assert b - n < 8  # padding wastes at most 7 rows


def test_async_scheduling_preempts_no_more_than_sync(tiny_ckpt):
    """Short of KV blocks, rows in flight are read before scheduling (they may end requests
    and free blocks), so asynchronous scheduling never preempts a request that synchronous
    scheduling would have kept."""

    def preemptions(async_scheduling: bool, num_kv_blocks: int) -> tuple[int, list]:
        engine = _engine(tiny_ckpt, async_scheduling, num_kv_blocks, max_num_seqs=4)
        texts = ["hello world " * k for k in (1, 1, 2, 2)]
        params = [SamplingParams(seed=i, max_rows=16) for i in range(4)]
        results = engine.generate(texts, params=params, audio=False)
        return engine.stats.num_preemptions, [r.rows for r in results]

    preempted = 0
    for num_kv_blocks in range(20, 36):
        sync_count, sync_rows = preemptions(False, num_kv_blocks)
        async_count, async_rows = preemptions(True, num_kv_blocks)
        assert async_count == sync_count and async_rows == sync_rows, num_kv_blocks
        preempted += sync_count
    assert preempted > 0  # the cache sizes really were short


def test_a_failure_while_reading_rows_ends_those_requests_and_the_engine_goes_on(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, max_num_seqs=4))
    for i in range(2):
        engine.add_request(f"f{i}", "fail soon", params=SamplingParams(seed=i, max_rows=30))
    engine.step()
    engine.step()
    original = engine._append_rows

    def broken(sampled):
        engine._append_rows = original
        raise RuntimeError("injected")

    engine._append_rows = broken
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished():
            engine.step()
    # Both requests were in the step that failed to be read: both ended (as errors).
    assert not engine.has_unfinished() and not engine.scheduler.requests
    stats = engine.stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked
    [after] = engine.generate(["still works"], params=SamplingParams(seed=9, max_rows=5))
    assert after.finish_reason == "length" and len(after.rows) == 5
