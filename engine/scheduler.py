"""Continuous batching: which requests run this step, and how many positions each computes.

Owns the waiting queue, the running list, slots and admission control. Each step mixes decode
rows of running requests with chunks of prefill under one token budget; when KV blocks run out
the newest running request is preempted (its blocks freed, recomputed later from its prompt
and generated rows); new requests wait in the queue until blocks and a slot are free: never
crash, never drop. Imports no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, hash_prompt_blocks
from engine.config import ConfigError, EngineConfig
from engine.request import FinishReason, Request, RequestStatus

_PREFIX_HASH_ENTRIES = 256  # voice prefixes whose block hashes are remembered
# The admission wait holds waiting requests only while their prompts compute fewer positions
# than this together. Such prompts ride along nearly free, so one mixed step for several
# saves each the switch out of the decode graph: on the H200 (fp8), 64 decodes take 3.67 ms
# alone, 4.62 ms beside 9 prompt positions, 4.90 ms beside 60. A clone prompt computed whole
# (about 250 positions, no prefix hit; 7.55 ms beside 64 decodes) gains little from company
# and, held, queues behind the step's token budget: with the cold voice pool at 64 streams a
# 3-step wait gave 136 / 182 ms mean / P95 first audio against 106 / 119 ms without (H100,
# docs/perf-log/2026-12-07-session-29.md), so it is admitted at once.
HOLD_POSITIONS = 64


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (= request.num_computed before the step)
    num_tokens: int
    # Whether this chunk reaches the request's last input, so a row is sampled.
    samples: bool


@dataclass
class SchedulerOutput:
    # the running requests' chunks first, then those of requests admitted this step
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_running: int = 0  # chunks of requests that were running before the step
    # Counted as the chunks are made (a loop over them per step costs as much again):
    num_tokens: int = 0  # positions computed, every chunk's
    # chunks that feed one sampled row (one position past the prompt); a request recomputed
    # after preemption prefills again
    num_decodes: int = 0

    @property
    def admitted(self) -> list[ScheduledChunk]:
        """The chunks of requests admitted this step (new, or back after preemption)."""
        return self.chunks[self.num_running :]


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, admission_wait_steps: int = 0
    ):
        """`admission_wait_steps` (the plan's): while requests run, new ones are admitted at
        most once every that many steps plus one, so prompts arriving close together share a
        mixed step; an idle engine admits at once, and so does a busy one once the waiting
        prompts compute `HOLD_POSITIONS` or more."""
        self.config = config
        self.blocks = block_manager
        self.admission_wait_steps = admission_wait_steps
        self._steps_since_admission = admission_wait_steps  # the first request goes at once
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_prefill_tokens_computed = 0
        self.num_prefix_cached_tokens = 0
        self._prefix_hashes: dict[tuple, list[bytes]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if len(request.prompt) == 0:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        if request.request_id in self.requests:
            raise ConfigError(f"request id {request.request_id!r} is already in use")
        longest = len(request.prompt) + request.params.max_rows
        if longest > self.config.max_model_len:
            raise ConfigError(
                f"prompt ({len(request.prompt)} positions) + max_rows ({request.params.max_rows})"
                f" exceeds max_model_len ({self.config.max_model_len}); shorten the text or "
                "reference, or lower max_rows"
            )
        if self.blocks.blocks_needed(longest) > self.blocks.num_usable_blocks:
            raise ConfigError(
                f"one request may need {self.blocks.blocks_needed(longest)} KV blocks but the "
                f"cache has {self.blocks.num_usable_blocks}; raise num_kv_blocks"
            )
        request.block_hashes = self._block_hashes(request.prompt)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (finished or aborted) and releases its blocks and slot."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_blocks(request)
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _block_hashes(self, prompt) -> list[bytes]:
        """Content hashes of the prompt's full blocks. The blocks inside the voice prefix
        (instruction, transcript, reference rows) are the same for every request with that
        voice: their chain is remembered for the most recent voices."""
        bs = self.blocks.block_size
        n = prompt.prefix_len // bs * bs
        keys = prompt.position_keys()
        key = (prompt.token_ids[:n], prompt.audio_rows[:n])
        head = self._prefix_hashes.pop(key, None)
        if head is None:
            head = hash_prompt_blocks(keys[:n], bs)
        self._prefix_hashes[key] = head  # most recently used last
        if len(self._prefix_hashes) > _PREFIX_HASH_ENTRIES:
            self._prefix_hashes.pop(next(iter(self._prefix_hashes)))
        return head + hash_prompt_blocks(keys[n:], bs, head[-1] if head else None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------

    def short_of_blocks(self) -> bool:
        """Whether the running requests' next chunks need more KV blocks than are free (a
        dry run of `_schedule_running`): then `schedule()` would preempt."""
        budget, need = self.config.max_num_batched_tokens, 0
        most = len(self.running) + budget // self.blocks.block_size + 1
        if self.blocks.num_free_blocks >= most:
            return False  # cheap bound: each chunk needs at most n / block_size + 1 blocks
        for request in self.running:
            if budget <= 0:
                break
            n = self._running_chunk(request, budget)
            need += max(0, self._blocks_short(request, n))
            budget -= n
        return need > self.blocks.num_free_blocks

    @staticmethod
    def _running_chunk(request: Request, budget: int) -> int:
        """Positions a running request computes next (0: skip it; its last row is in
        flight and it finishes when that row is read). `_schedule_running` spells this and
        `_blocks_short` out; tests/engine/test_scheduler.py holds this dry run to foresee
        exactly the steps that the schedule preempts."""
        rows = len(request.output_rows) + request.num_inflight
        if rows >= request.params.max_rows:
            return 0
        pending = request.prompt_len + rows - request.num_computed
        return max(0, min(pending, budget))

    def _blocks_short(self, request: Request, n: int) -> int:
        """Blocks the request lacks to compute `n` more positions."""
        return self.blocks.blocks_needed(request.num_computed + n) - len(request.block_ids)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        out.num_running = len(out.chunks)
        if not out.preempted and not self._holds_waiting():
            budget = self._schedule_waiting(out, budget)
        out.num_tokens = self.config.max_num_batched_tokens - budget
        admitted = len(out.chunks) > out.num_running
        self._steps_since_admission = 0 if admitted else self._steps_since_admission + 1
        return out

    def _holds_waiting(self) -> bool:
        """Whether the admission wait keeps the waiting requests out this step."""
        if not self.running or self._steps_since_admission >= self.admission_wait_steps:
            return False
        positions = 0
        for request in self.waiting:  # stops within HOLD_POSITIONS requests: each computes >= 1
            start = len(self._prefix_hit(request)) * self.blocks.block_size
            positions += request.num_positions - start
            if positions >= HOLD_POSITIONS:
                return False
        return True

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs for every running request every step (256 at full load): `_running_chunk` and
        # `_blocks_short` spelled out, with no call per request but the chunk's construction.
        running, chunks, blocks = self.running, out.chunks, self.blocks
        bs = blocks.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            rows = len(request.output_rows) + request.num_inflight
            if rows >= request.params.max_rows:  # its last row is in flight: skip it
                i += 1
                continue
            start = request.num_computed
            last = request.prompt_len + rows  # it samples when a chunk reaches this position
            n = last - start
            if n <= 0:
                i += 1
                continue
            if n > budget:
                n = budget
            need = -(-(start + n) // bs) - len(request.block_ids)
            if need > 0:
                while need > blocks.num_free_blocks:
                    victim = running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request:
                        return budget
                request.block_ids += blocks.allocate(need)
            chunks.append(ScheduledChunk(request, start, n, start + n == last))
            out.num_decodes += n == 1 and start >= request.prompt_len
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.slot is None and (
                not self._free_slots or len(self.running) >= self.config.max_num_seqs
            ):
                return budget
            cached = self._prefix_hit(request)
            start = len(cached) * self.blocks.block_size
            n = min(request.num_positions - start, budget)
            num_new = self.blocks.blocks_needed(start + n) - len(cached)
            if not self.blocks.can_take(cached, num_new):
                return budget  # admission control: wait until blocks free up
            self.waiting.popleft()
            self.blocks.share(cached)
            request.block_ids = cached + self.blocks.allocate(num_new)
            request.num_computed = start
            request.num_cached_tokens = start
            self.num_prefix_cached_tokens += start
            if request.slot is None:
                request.slot = self._free_slots.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, start, n, start + n == request.num_positions))
            out.num_decodes += n == 1 and start >= request.prompt_len
            budget -= n
        return budget

    def _prefix_hit(self, request: Request) -> list[int]:
        cached = self.blocks.match_prefix(request.block_hashes)
        # The last prompt position must be computed: its hidden state samples the first row.
        max_blocks = (request.num_positions - 1) // self.blocks.block_size
        return cached[:max_blocks]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)  # keeps its slot and sampling state

    def _release_blocks(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []

    # -- after the step ----------------------------------------------------------------------

    def on_launched(self, sched: SchedulerOutput) -> None:
        """A step was launched: each chunk's computed count and prompt blocks advance, and the
        row each sampling chunk will produce counts as in flight until `on_rows_read`."""
        for chunk in sched.chunks:
            request = chunk.request
            request.num_computed = chunk.start + chunk.num_tokens
            if chunk.start < request.prompt_len:  # a decode chunk completes no prompt block
                self._publish_prompt_blocks(chunk)
            request.num_inflight += chunk.samples

    @staticmethod
    def on_rows_read(requests: list[Request]) -> None:
        """A launched step's rows were read back: they are no longer in flight."""
        for request in requests:
            request.num_inflight -= 1

    @staticmethod
    def on_rows_lost(request: Request) -> None:
        """A launched step's rows could not be read (the request is ended with an error)."""
        request.num_inflight = 0

    def _publish_prompt_blocks(self, chunk: ScheduledChunk) -> None:
        """Counts a computed prompt chunk and publishes the prompt blocks it completed."""
        request = chunk.request
        prompt_len = request.prompt_len
        prefill = max(0, min(request.num_computed, prompt_len) - chunk.start)
        self.num_prefill_tokens_computed += prefill
        bs = self.blocks.block_size
        done_blocks = min(request.num_computed, prompt_len) // bs
        for i in range(chunk.start // bs, done_blocks):
            self.blocks.register(request.block_ids[i], request.block_hashes[i])
