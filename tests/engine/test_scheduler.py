"""CPU tests of continuous batching: budgets, admission, preemption, abort, prefix reuse.

The engine loop is simulated here: schedule, mark every chunk done, append a fake row for
each chunk that samples, and finish a request once it has `max_rows` rows. No torch.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest

from engine.block_manager import NULL_BLOCK, BlockManager
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.prompt import Prompt
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import HOLD_POSITIONS, Scheduler, SchedulerOutput

BS = 4


def fake_row(i: int) -> tuple[int, ...]:
    return tuple((i * 8 + c) % 1024 for c in range(8))


def make_prompt(token_ids, audio_rows=None, prefix_len: int = 1) -> Prompt:
    token_ids = tuple(token_ids)
    if audio_rows is None:
        audio_rows = (None,) * len(token_ids)
    return Prompt(token_ids=token_ids, audio_rows=tuple(audio_rows), prefix_len=prefix_len)


def make_request(rid: str, prompt, max_rows: int = 8, seed: int = 0) -> Request:
    if isinstance(prompt, int):  # token ids unique to this id: no accidental prefix hits
        base = 10_000 + zlib.crc32(rid.encode()) % 10_000 * 1000
        prompt = make_prompt(range(base, base + prompt))
    elif not isinstance(prompt, Prompt):
        prompt = make_prompt(prompt)
    return Request(rid, prompt, SamplingParams(max_rows=max_rows), seed)


def make_config(**kw) -> EngineConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=BS)
    base.update(kw)
    return EngineConfig(**base)


class Sim:
    """A scheduler plus the engine's side of the loop, checking invariants on every step."""

    def __init__(self, num_blocks: int, caching: bool = True, admission_wait_steps=0, **config):
        self.config = make_config(**config)
        self.bm = BlockManager(num_blocks, self.config.block_size, caching)
        self.sched = Scheduler(self.config, self.bm, admission_wait_steps)
        self.finished: list[Request] = []
        self.history: list[SchedulerOutput] = []
        self.num_preempted = 0

    def add(self, request: Request) -> Request:
        self.sched.add(request)
        return request

    def step(self) -> SchedulerOutput:
        # short_of_blocks is the schedule's dry run (the engine reads rows in flight first
        # when it says so): it must foresee exactly the steps that preempt
        short = self.sched.short_of_blocks()
        out = self.sched.schedule()
        assert short == bool(out.preempted)
        self.check(out)
        self.history.append(out)
        self.num_preempted += len(out.preempted)
        sampling = [c for c in out.chunks if c.samples]
        self.sched.on_launched(out)
        for chunk in out.chunks:
            assert chunk.request.num_computed == chunk.start + chunk.num_tokens
            assert chunk.request.num_inflight == chunk.samples
        self.sched.on_rows_read([c.request for c in sampling])  # read back at once
        for chunk in sampling:
            req = chunk.request
            req.output_rows.append(fake_row(len(req.output_rows)))
            if len(req.output_rows) >= req.params.max_rows:
                self.finish(req, FinishReason.LENGTH)
        self.check_blocks()
        return out

    def finish(self, req: Request, reason: FinishReason) -> None:
        self.sched.finish(req, reason)
        assert req.status is RequestStatus.FINISHED
        assert req.finish_reason is reason
        assert req.block_ids == []
        assert req.slot is None
        self.finished.append(req)

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

    # -- invariants --------------------------------------------------------------------------

    def check(self, out: SchedulerOutput) -> None:
        sched, cfg = self.sched, self.config
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_tokens <= cfg.max_num_batched_tokens
        decodes = [c.num_tokens == 1 and c.start >= c.request.prompt_len for c in out.chunks]
        assert out.num_decodes == sum(decodes)
        assert len(sched.running) <= cfg.max_num_seqs
        reqs = [c.request for c in out.chunks]
        assert len(reqs) == len({id(r) for r in reqs}), "a request got two chunks in one step"
        for chunk in out.chunks:
            req = chunk.request
            assert req in sched.running
            assert req.status is RequestStatus.RUNNING
            assert chunk.num_tokens >= 1
            assert chunk.start == req.num_computed
            assert chunk.start + chunk.num_tokens <= req.num_positions
            assert len(req.block_ids) >= self.bm.blocks_needed(chunk.start + chunk.num_tokens)
            assert req.slot is not None
        for victim in out.preempted:
            assert victim not in sched.running
            assert victim in sched.waiting
            assert victim not in reqs
            assert victim.num_computed == 0
            assert victim.block_ids == []
            assert victim.status is RequestStatus.WAITING
            assert victim.slot is not None
        self.check_blocks()

    def check_blocks(self) -> None:
        sched, bm = self.sched, self.bm
        held = Counter()
        for req in sched.running:
            assert NULL_BLOCK not in req.block_ids
            assert len(set(req.block_ids)) == len(req.block_ids)
            held.update(req.block_ids)
        for req in sched.waiting:
            assert req.block_ids == []
            assert req.status is RequestStatus.WAITING
        for b in range(1, bm.num_blocks):
            assert bm._ref_count[b] == held[b], f"block {b} ref count is off"
        assert bm.num_free_blocks == bm.num_usable_blocks - len(held)
        slots = [r.slot for r in [*sched.running, *sched.waiting] if r.slot is not None]
        assert len(slots) == len(set(slots))
        assert all(r.slot is not None for r in sched.running)
        assert sorted(slots + sched._free_slots) == list(range(self.config.max_num_seqs))
        live = {r.request_id for r in [*sched.running, *sched.waiting]}
        assert live == set(sched.requests)


def chunks_of(sim: Sim, req: Request) -> list[tuple[int, int, int]]:
    """(step, start, num_tokens) of every chunk the request got."""
    return [
        (i, c.start, c.num_tokens)
        for i, out in enumerate(sim.history)
        for c in out.chunks
        if c.request is req
    ]


# -- token budget and batching ---------------------------------------------------------------


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    a = sim.add(make_request("a", 6, max_rows=40))
    sim.step()
    assert len(a.output_rows) == 1  # 6-position prompt fits one step and samples
    b = sim.add(make_request("b", 50, max_rows=4))
    while not b.output_rows:
        out = sim.step()
        assert out.num_tokens <= 16
        kinds = {c.request.request_id: c.num_tokens for c in out.chunks}
        assert kinds["a"] == 1  # a decodes every step while b prefills
        assert 1 <= kinds["b"] <= 15
        assert len(sim.history) < 20
    b_chunks = chunks_of(sim, b)
    # 50 positions over four steps, each taking what the decode row leaves of the budget.
    assert [n for _, _, n in b_chunks] == [15, 15, 15, 5]
    assert [sim.history[i].num_tokens for i, _, _ in b_chunks] == [16, 16, 16, 6]
    pos = 0
    for _, start, n in b_chunks:
        assert start == pos
        pos += n
    assert pos == 50
    # Only the chunk that reaches the last prompt position sampled.
    assert len(b.output_rows) == 1
    sim.run()
    assert len(a.output_rows) == 40 and len(b.output_rows) == 4


def test_budget_shared_by_many_prefills():
    sim = Sim(num_blocks=200, max_num_batched_tokens=20, max_num_seqs=8)
    reqs = [sim.add(make_request(f"r{i}", 13 + i, max_rows=3)) for i in range(6)]
    first = sim.step()
    assert first.num_tokens == 20
    assert [(c.request.request_id, c.start, c.num_tokens) for c in first.chunks] == [
        ("r0", 0, 13),
        ("r1", 0, 7),
    ]
    sim.run()
    for r in reqs:
        assert len(r.output_rows) == 3
    assert all(out.num_tokens <= 20 for out in sim.history)
    assert max(out.num_tokens for out in sim.history) == 20


def test_max_num_seqs_respected():
    sim = Sim(num_blocks=200, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [sim.add(make_request(f"r{i}", 5, max_rows=3)) for i in range(5)]
    out = sim.step()
    assert len(out.chunks) == 2
    assert len(sim.sched.running) == 2
    assert [r.request_id for r in sim.sched.waiting] == ["r2", "r3", "r4"]
    assert all(r.slot is None for r in sim.sched.waiting)
    peak = 2
    while sim.sched.has_unfinished():
        sim.step()
        peak = max(peak, len(sim.sched.running))
        assert len(sim.sched.running) <= 2
    assert peak == 2
    assert all(len(r.output_rows) == 3 for r in reqs)
    assert sorted(sim.sched._free_slots) == [0, 1]


# -- admission control -----------------------------------------------------------------------


def admitted_at(sim: Sim, req: Request) -> int:
    return chunks_of(sim, req)[0][0]


@pytest.mark.parametrize("wait", [0, 2, 3])
def test_admissions_while_others_decode_come_at_most_every_wait_plus_one_steps(wait):
    """One request arrives every step beside a long-running one: with `wait` 0 each is
    admitted the step it arrives; with `wait` N the admissions are N + 1 steps apart, each
    taking every request that arrived since, none waiting more than N steps."""
    sim = Sim(num_blocks=400, admission_wait_steps=wait, max_num_seqs=16, max_num_batched_tokens=64)
    long = sim.add(make_request("long", 5, max_rows=40))
    sim.step()
    assert admitted_at(sim, long) == 0  # an idle engine admits at once
    arrivals = {}
    for i in range(12):
        arrivals[sim.add(make_request(f"r{i}", 3, max_rows=30))] = len(sim.history)
        sim.step()
    admissions = sorted({admitted_at(sim, r) for r in arrivals})
    # "long" was admitted at step 0: the next admission comes N + 1 steps after it
    assert admissions == list(range(wait + 1, 13, wait + 1))
    assert all(0 <= admitted_at(sim, r) - step <= wait for r, step in arrivals.items())
    mixed = [out for out in sim.history[1:] if any(c.start == 0 for c in out.chunks)]
    assert len(mixed) == len(admissions)
    sim.run()
    assert all(len(r.output_rows) == 30 for r in arrivals)


def test_admission_wait_never_holds_an_idle_engine():
    """With nothing running a request goes at once, however recent the last admission."""
    sim = Sim(num_blocks=200, admission_wait_steps=8, max_num_batched_tokens=64)
    first = sim.add(make_request("a", 5, max_rows=1))
    sim.step()
    assert sim.sched.running == [] and first.output_rows  # done in its first step
    second = sim.add(make_request("b", 5, max_rows=1))
    sim.step()
    assert admitted_at(sim, second) == 1


def test_admission_wait_holds_prompts_only_while_they_compute_few_positions():
    """A prompt the prefix cache mostly serves is held for company; once the waiting prompts
    compute HOLD_POSITIONS or more (a clone prompt of a voice not in the cache) they all go at
    once, the step after an admission too: held, they would queue behind the token budget."""
    sim = Sim(
        num_blocks=400,
        admission_wait_steps=3,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=512,
    )
    voice = list(range(500, 500 + 2 * HOLD_POSITIONS))
    sim.add(make_request("first", voice, max_rows=40))
    sim.step()  # an idle engine admits at once; its prompt's blocks are now cached
    warm = sim.add(make_request("warm", voice, max_rows=5))
    sim.step()
    assert not chunks_of(sim, warm)  # held: only its last block to compute
    cold = sim.add(make_request("cold", HOLD_POSITIONS - BS, max_rows=5))
    sim.step()
    assert chunks_of(sim, warm) == [(2, len(voice) - BS, BS)]  # beside "cold", not 3 steps on
    assert admitted_at(sim, cold) == 2
    colder = sim.add(make_request("colder", HOLD_POSITIONS, max_rows=5))
    sim.step()
    assert admitted_at(sim, colder) == 3
    sim.run()
    assert all(len(r.output_rows) == 5 for r in (warm, cold, colder))


def test_requests_wait_for_blocks_and_all_finish():
    sim = Sim(num_blocks=9, max_num_batched_tokens=64)  # 8 usable blocks
    reqs = [sim.add(make_request(f"r{i}", 12, max_rows=8)) for i in range(5)]
    out = sim.step()  # each prompt needs 3 blocks: only two fit
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert [r.request_id for r in sim.sched.waiting] == ["r2", "r3", "r4"]
    assert len(sim.sched.requests) == 5  # nobody dropped
    saw_waiting_while_running = False
    while sim.sched.has_unfinished():
        sim.step()
        if sim.sched.waiting and sim.sched.running:
            saw_waiting_while_running = True
        # Every unfinished request is still tracked somewhere.
        unfinished = {r.request_id for r in reqs if not r.is_finished}
        assert unfinished == set(sim.sched.requests)
    assert saw_waiting_while_running
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert len(r.output_rows) == 8
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks


def test_waiting_request_admitted_once_blocks_free():
    sim = Sim(num_blocks=7, max_num_batched_tokens=64)  # 6 usable
    a = sim.add(make_request("a", 16, max_rows=2))  # 4 blocks, 5 with its rows
    b = sim.add(make_request("b", 12, max_rows=2))  # 3 blocks
    sim.step()
    assert a.status is RequestStatus.RUNNING
    assert b.status is RequestStatus.WAITING and b.slot is None
    sim.step()  # a decodes its last row and finishes
    assert a.is_finished
    assert b.status is RequestStatus.WAITING  # admitted only from the next schedule on
    out = sim.step()
    assert [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(b, 0, 12)]
    sim.run()
    assert len(b.output_rows) == 2


# -- preemption ------------------------------------------------------------------------------


def test_preemption_of_newest_request_and_recompute():
    sim = Sim(num_blocks=9, caching=False, max_num_batched_tokens=32)  # 8 usable
    a = sim.add(make_request("a", 8, max_rows=16))
    b = sim.add(make_request("b", 8, max_rows=16))
    sim.step()
    assert len(sim.sched.running) == 2
    b_slot = b.slot
    while not sim.history[-1].preempted:
        sim.step()
        assert len(sim.history) < 50
    out = sim.history[-1]
    assert out.preempted == [b]  # the newest running request
    assert all(c.request is not b for c in out.chunks)
    assert [c.request for c in out.chunks] == [a]
    assert b.num_preemptions == 1
    assert b.num_computed == 0 and b.block_ids == []
    assert b.slot == b_slot  # keeps its slot (and so its sampling state)
    assert b_slot not in sim.sched._free_slots
    assert sim.sched.waiting[0] is b
    rows_before = list(b.output_rows)
    assert rows_before  # it had generated rows that must be recomputed
    while b.status is not RequestStatus.RUNNING:
        sim.step()
        assert len(sim.history) < 200
    resume = chunks_of(sim, b)[-1]
    assert resume[1] == 0  # recomputes from position 0
    assert resume[2] == len(b.prompt) + len(rows_before)  # prompt and generated rows
    assert b.output_rows[: len(rows_before)] == rows_before
    assert len(b.output_rows) == len(rows_before) + 1  # the resumed chunk sampled one row
    assert b.slot == b_slot
    sim.run()
    assert len(a.output_rows) == 16 and len(b.output_rows) == 16
    assert a.num_preemptions == 0
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks


def test_preemption_frees_blocks_for_the_older_request():
    sim = Sim(num_blocks=9, caching=False, max_num_batched_tokens=32)
    a = sim.add(make_request("a", 8, max_rows=16))
    b = sim.add(make_request("b", 8, max_rows=16))
    sim.step()
    c = sim.add(make_request("c", 24, max_rows=1))  # 6 blocks: more than the 4 left
    sim.step()
    assert sim.sched.waiting[0] is c
    # Waiting requests are not admitted in a step that preempted.
    while not sim.history[-1].preempted:
        sim.step()
    assert sim.history[-1].preempted == [b]
    assert all(ch.request is not c for ch in sim.history[-1].chunks)
    # The preempted request goes ahead of the one that was already waiting.
    assert list(sim.sched.waiting) == [b, c]
    sim.run()
    assert all(r.is_finished for r in (a, b, c))


def test_preempted_request_resumes_from_its_cached_prompt():
    sim = Sim(num_blocks=9, caching=True, max_num_batched_tokens=32)
    a = sim.add(make_request("a", 8, max_rows=16))
    b = sim.add(make_request("b", make_prompt(range(500, 508)), max_rows=16))
    sim.step()
    while not sim.history[-1].preempted:
        sim.step()
    assert sim.history[-1].preempted == [b]
    rows_before = len(b.output_rows)
    while b.status is not RequestStatus.RUNNING:
        sim.step()
    _, start, n = chunks_of(sim, b)[-1]
    # Its freed tail blocks were recycled first, so both prompt blocks are still cached and
    # may all be reused: the generated rows after them supply the last position.
    assert start == b.num_cached_tokens == len(b.prompt) == 8
    assert start + n == len(b.prompt) + rows_before
    sim.run()
    assert len(b.output_rows) == 16 and len(a.output_rows) == 16
    assert a.num_preemptions == 0


def test_self_preemption_when_last_running_request_needs_blocks():
    # a and b grow in lockstep; when both need a fifth block only a can get it, so b (the
    # newest, and the one asking) preempts itself.
    sim = Sim(num_blocks=6, caching=False, max_num_batched_tokens=32)  # 5 usable
    a = sim.add(make_request("a", 4, max_rows=12))
    b = sim.add(make_request("b", 4, max_rows=12))
    while True:
        a_blocks_before = len(a.block_ids)
        out = sim.step()
        if out.preempted:
            break
        assert len(sim.history) < 50
    assert out.preempted == [b]
    assert [c.request for c in out.chunks] == [a]
    assert len(a.block_ids) == a_blocks_before + 1  # a took the last free block
    assert sim.bm.num_free_blocks == 5 - len(a.block_ids)
    sim.run()
    assert len(a.output_rows) == 12 and len(b.output_rows) == 12
    assert b.num_preemptions >= 1 and a.num_preemptions == 0


# -- abort -----------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests():
    sim = Sim(num_blocks=9, max_num_batched_tokens=64)  # 8 usable
    a = sim.add(make_request("a", 12, max_rows=8))
    b = sim.add(make_request("b", 12, max_rows=8))
    c = sim.add(make_request("c", 12, max_rows=8))
    sim.step()
    assert c in sim.sched.waiting
    free_before = sim.bm.num_free_blocks
    sim.finish(c, FinishReason.ABORT)
    assert c not in sim.sched.waiting and "c" not in sim.sched.requests
    assert sim.bm.num_free_blocks == free_before
    a_blocks, a_slot = list(a.block_ids), a.slot
    assert a_blocks
    sim.finish(a, FinishReason.ABORT)
    assert a not in sim.sched.running and "a" not in sim.sched.requests
    assert sim.bm.num_free_blocks == free_before + len(a_blocks)
    assert a_slot in sim.sched._free_slots
    sim.check_blocks()
    # Finishing again is a no-op.
    sim.sched.finish(a, FinishReason.LENGTH)
    assert a.finish_reason is FinishReason.ABORT
    assert sim.bm.num_free_blocks == free_before + len(a_blocks)
    sim.run()
    assert len(b.output_rows) == 8
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks
    assert sorted(sim.sched._free_slots) == list(range(4))


def test_abort_preempted_request_returns_its_slot():
    sim = Sim(num_blocks=9, caching=False, max_num_batched_tokens=32)
    a = sim.add(make_request("a", 8, max_rows=16))
    b = sim.add(make_request("b", 8, max_rows=16))
    sim.step()
    while not sim.history[-1].preempted:
        sim.step()
    slot = b.slot
    assert slot is not None and slot not in sim.sched._free_slots
    sim.finish(b, FinishReason.ABORT)
    assert slot in sim.sched._free_slots
    assert b not in sim.sched.waiting
    sim.run()
    assert len(a.output_rows) == 16
    assert sorted(sim.sched._free_slots) == list(range(4))


def test_request_id_reusable_after_finish():
    sim = Sim(num_blocks=32)
    sim.add(make_request("x", 4, max_rows=1))
    sim.run()
    again = sim.add(make_request("x", 4, max_rows=1))
    sim.run()
    assert again.is_finished and len(again.output_rows) == 1


# -- prefix reuse ----------------------------------------------------------------------------


def test_prefix_reuse_of_shared_full_blocks():
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    shared = list(range(100, 108))  # two full blocks
    a = sim.add(make_request("a", shared + [1, 2, 3, 4, 5, 6], max_rows=4))
    sim.step()
    assert a.num_cached_tokens == 0
    cost_a = sim.sched.num_prefill_tokens_computed
    assert cost_a == 14
    b = sim.add(make_request("b", shared + [7, 8, 9, 10, 11, 12], max_rows=4))
    out = sim.step()
    (b_chunk,) = [c for c in out.chunks if c.request is b]
    assert b.num_cached_tokens == 2 * BS
    assert b_chunk.start == 2 * BS and b_chunk.num_tokens == 14 - 2 * BS
    assert b.block_ids[:2] == a.block_ids[:2]  # physically shared
    assert b.block_ids[2] != a.block_ids[2]
    cost_b = sim.sched.num_prefill_tokens_computed - cost_a
    assert cost_b == 6 < cost_a
    assert sim.sched.num_prefix_cached_tokens == 8
    sim.run()
    assert len(b.output_rows) == 4


def test_prefix_reuse_after_first_request_finished():
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    shared = list(range(100, 112))  # three full blocks
    a = sim.add(make_request("a", shared + [1], max_rows=2))
    sim.run()
    assert a.is_finished
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks
    b = sim.add(make_request("b", shared + [2, 3], max_rows=2))
    out = sim.step()
    assert b.num_cached_tokens == 12
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 2)]
    sim.run()
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks


def test_fully_cached_prompt_still_computes_its_last_position():
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    ids = list(range(200, 212))  # exactly three full blocks
    a = sim.add(make_request("a", ids, max_rows=1))
    sim.run()
    assert a.is_finished
    b = sim.add(make_request("b", ids, max_rows=1))
    out = sim.step()
    (chunk,) = out.chunks
    assert chunk.num_tokens >= 1
    assert chunk.start + chunk.num_tokens == 12
    assert b.num_cached_tokens == 8  # the last block is recomputed
    assert len(b.output_rows) == 1
    # One position past the cached blocks: all three are reused, only the last is computed.
    c = sim.add(make_request("c", [*ids, 999], max_rows=1))
    out = sim.step()
    assert [(ch.start, ch.num_tokens) for ch in out.chunks] == [(12, 1)]
    assert c.num_cached_tokens == 12
    assert len(c.output_rows) == 1


def test_only_computed_blocks_are_reused_during_chunked_prefill():
    sim = Sim(num_blocks=64, max_num_batched_tokens=18)
    ids = list(range(700, 730))  # 30 positions, 7 full blocks
    a = sim.add(make_request("a", ids, max_rows=2))
    sim.step()  # positions 0..17: blocks 0-3 full, block 4 half computed
    assert sim.bm.num_cached_blocks() == 4
    b = sim.add(make_request("b", ids, max_rows=2))
    out = sim.step()
    assert [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(a, 18, 12), (b, 16, 6)]
    assert b.num_cached_tokens == 16  # not block 4: it was still being computed
    assert b.block_ids[:4] == a.block_ids[:4]
    assert b.block_ids[4] != a.block_ids[4]
    # a completed blocks 4-6; b's copy of block 4 is not registered a second time.
    assert sim.bm.num_cached_blocks() == 7
    assert sim.bm.match_prefix(b.block_hashes) == a.block_ids[:7]
    sim.run()
    assert len(a.output_rows) == 2 and len(b.output_rows) == 2
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks


def test_identical_request_running_concurrently_shares_blocks():
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    ids = list(range(300, 317))
    a = sim.add(make_request("a", ids, max_rows=6))
    sim.step()
    b = sim.add(make_request("b", ids, max_rows=6))
    sim.step()
    assert b.num_cached_tokens == 16
    assert b.block_ids[:4] == a.block_ids[:4]
    assert sim.bm._ref_count[a.block_ids[0]] == 2
    sim.finish(a, FinishReason.ABORT)
    assert sim.bm._ref_count[b.block_ids[0]] == 1
    sim.run()
    assert len(b.output_rows) == 6
    assert sim.bm.num_free_blocks == sim.bm.num_usable_blocks


def _clone_prompt(rows: list[tuple[int, ...]]) -> Prompt:
    """<tts> <ref_audio> PH x len(rows) <text> text... <audio> with made-up ids."""
    ids = [1, 2, *([1] * len(rows)), 3, 40, 41, 42, 43, 44, 4]
    audio = [None, None, *rows, None, None, None, None, None, None, None]
    return make_prompt(ids, audio, prefix_len=3 + len(rows))


def test_different_placeholder_row_stops_the_prefix_hit():
    rows = [fake_row(i) for i in range(10)]  # placeholders at positions 2..11
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    a = sim.add(make_request("a", _clone_prompt(rows), max_rows=2))
    sim.run()
    assert a.is_finished
    # Same ids and same rows: every full block but the one holding the last position hits.
    same = sim.add(make_request("same", _clone_prompt(rows), max_rows=1))
    sim.run()
    assert same.num_cached_tokens == 16  # 18 positions: blocks 0..3 cached
    # Row at position 5 (block 1) differs: only block 0 hits.
    changed = list(rows)
    changed[3] = fake_row(77)
    b = sim.add(make_request("b", _clone_prompt(changed), max_rows=1))
    out = sim.step()
    assert b.num_cached_tokens == BS
    assert out.chunks[0].start == BS
    sim.run()
    # Row at position 2 (block 0) differs: nothing hits, though the token ids are identical.
    changed0 = list(rows)
    changed0[0] = fake_row(78)
    assert _clone_prompt(changed0).token_ids == _clone_prompt(rows).token_ids
    c = sim.add(make_request("c", _clone_prompt(changed0), max_rows=1))
    out = sim.step()
    assert c.num_cached_tokens == 0 and out.chunks[0].start == 0


def test_prefix_caching_disabled_never_reuses():
    sim = Sim(num_blocks=64, caching=False, max_num_batched_tokens=64)
    ids = list(range(100, 120))
    sim.add(make_request("a", ids, max_rows=1))
    sim.run()
    b = sim.add(make_request("b", ids, max_rows=1))
    out = sim.step()
    assert b.num_cached_tokens == 0 and out.chunks[0].start == 0
    assert sim.sched.num_prefill_tokens_computed == 40
    assert sim.sched.num_prefix_cached_tokens == 0


# -- rejected requests -----------------------------------------------------------------------


def test_request_longer_than_max_model_len_is_rejected():
    sim = Sim(num_blocks=64, max_model_len=32)
    with pytest.raises(ConfigError):
        sim.add(make_request("long", 30, max_rows=3))
    assert not sim.sched.requests and not sim.sched.waiting
    ok = sim.add(make_request("ok", 30, max_rows=2))  # exactly max_model_len is fine
    assert ok in sim.sched.waiting


def test_request_needing_more_blocks_than_the_cache_is_rejected():
    sim = Sim(num_blocks=5)  # 4 usable blocks of 4 positions
    with pytest.raises(ConfigError):
        sim.add(make_request("big", 15, max_rows=2))  # 17 positions: 5 blocks
    assert not sim.sched.requests and not sim.sched.waiting
    ok = sim.add(make_request("fits", 14, max_rows=2))  # 16 positions: 4 blocks
    sim.run()
    assert len(ok.output_rows) == 2


def test_duplicate_request_id_is_rejected():
    sim = Sim(num_blocks=64)
    first = sim.add(make_request("dup", 4))
    with pytest.raises(ConfigError):
        sim.add(make_request("dup", 6))
    assert list(sim.sched.waiting) == [first]
    assert sim.sched.requests["dup"] is first
    sim.step()
    with pytest.raises(ConfigError):  # also while it runs
        sim.add(make_request("dup", 6))


# -- soak ------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_no_leak_after_many_random_requests(caching):
    rng = random.Random(1234)
    sim = Sim(
        num_blocks=24,
        caching=caching,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    prefixes = [list(range(k * 100, k * 100 + 12)) for k in range(3)]
    ph_rows = [fake_row(i) for i in range(6)]
    total, added, aborted = 200, 0, set()
    steps = 0
    while added < total or sim.sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if added == total:
                break
            prefix = rng.choice(prefixes)[: rng.randint(0, 12)]
            n = rng.randint(1, 40 - len(prefix)) if len(prefix) < 40 else 0
            ids = prefix + [rng.randint(5000, 6000) for _ in range(n)]
            rows = [None] * len(ids)
            if rng.random() < 0.3:  # a few placeholder positions
                for p in range(min(6, len(ids))):
                    rows[p] = rng.choice(ph_rows[:2])
            prompt = make_prompt(ids, rows)
            sim.add(make_request(f"r{added}", prompt, max_rows=rng.randint(1, 20)))
            added += 1
        if sim.sched.requests and rng.random() < 0.08:
            victim = rng.choice(list(sim.sched.requests.values()))
            aborted.add(victim.request_id)
            sim.finish(victim, FinishReason.ABORT)
        sim.step()
        steps += 1
        assert steps < 20_000
    assert len(sim.finished) == total
    assert aborted  # the run exercised aborts
    assert sim.num_preempted > 0  # ... and preemption
    if caching:
        assert sim.sched.num_prefix_cached_tokens > 0  # ... and prefix hits
    for r in sim.finished:
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert len(r.output_rows) == r.params.max_rows
    bm = sim.bm
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(c == 0 for c in bm._ref_count)
    assert sorted(sim.sched._free_slots) == list(range(4))
    assert not sim.sched.requests and not sim.sched.waiting and not sim.sched.running


def test_remembered_voice_prefix_hashes_equal_a_full_hash():
    """The block hashes of a voice prefix are remembered; a request reusing them gets exactly
    the hashes a full computation gives, and a different voice (same tokens, other rows) or a
    different text does not share them beyond what is equal."""
    from engine.block_manager import hash_prompt_blocks

    sim = Sim(num_blocks=64)
    voice = [fake_row(i) for i in range(3 * BS)]
    other = [fake_row(i + 1) for i in range(3 * BS)]

    def prompt(text_ids, rows):
        ids = [1, *range(100, 100 + len(rows)), 2]  # instruction, placeholders, <|text|>
        return make_prompt(
            [*ids, *text_ids, 3], [None, *rows, None, *[None] * (len(text_ids) + 1)], len(ids)
        )

    prompts = [
        prompt(range(500, 520), voice),
        prompt(range(600, 640), voice),  # the same voice: its prefix hashes are reused
        prompt(range(500, 520), other),  # same tokens, other reference rows
    ]
    hashes = [sim.sched._block_hashes(p) for p in prompts]
    for p, h in zip(prompts, hashes, strict=True):
        assert h == hash_prompt_blocks(p.position_keys(), BS)
    assert hashes[0][:3] == hashes[1][:3] and hashes[0][3] != hashes[1][3]
    assert not set(hashes[0]) & set(hashes[2])
