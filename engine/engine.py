"""The engine: the public, synchronous entry point that ties tokenizer, scheduler, block
manager and runner together.

`step()` reads as its intent: schedule, run, process outputs. No asyncio, no HTTP, no metrics
library: the service layer drives `step()` from its own thread and turns the returned events
into streams and metrics.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import make_backend
from engine.audio_output import AudioOutput, RequestOutput
from engine.block_manager import BlockManager
from engine.checkpoint_writer import UNTRAINED_NOTICE, default_model_dir
from engine.codec.audio_io import AudioLimits
from engine.codec.codec import Codec
from engine.config import ConfigError, EngineConfig, SamplingParams, VoiceReference
from engine.loader import load_model, read_config, refuse_hugging_faces_kernels, resolve_checkpoint
from engine.plan import ExecutionPlan, resolve_dtype
from engine.plan import resolve as resolve_plan
from engine.prompt import AudioRow, TextChecker, build_prompt
from engine.request import FinishReason, Request, RequestStatus
from engine.runner import ModelRunner, PendingStep, auto_num_kv_blocks
from engine.scheduler import Scheduler
from engine.stats import READBACK, EngineStats, Observations, StepCounters, StepShape
from engine.tokenizer import HiggsTokenizer

log = logging.getLogger("clonecast.engine")
_FINISHED = RequestStatus.FINISHED


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    rows: list[AudioRow]
    finish_reason: str
    pcm: bytes = b""  # the streamed audio chunks concatenated (empty without audio)


class Engine:
    """Higgs Audio v3 generation for many requests at once.

    >>> engine = Engine.from_pretrained()          # the embedded (untrained) default model
    >>> engine.add_request("r1", "Hello there.", params=SamplingParams(seed=1))
    >>> while engine.has_unfinished():
    ...     for event in engine.step(): ...
    """

    def __init__(
        self,
        checkpoint: Path,
        config: EngineConfig,
        *,
        is_default: bool = False,
        codec: Path | None = None,
    ):
        self.config = config
        self.checkpoint = checkpoint
        self.is_default_model = is_default
        device = torch.device(config.device)
        _, model_config = read_config(checkpoint)
        if config.max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        self.plan = resolve_plan(config, model_config, device)
        log.info("execution plan: %s", self.plan.describe())
        self.tokenizer = HiggsTokenizer(checkpoint)
        self.device, self.dtype = device, resolve_dtype(config.dtype, device)
        dtype = self.dtype
        backend = make_backend(self.plan)
        self.model, self.codec_keys = load_model(
            checkpoint, backend, device, dtype, self.plan, config.quantization
        )
        num_blocks = config.num_kv_blocks or auto_num_kv_blocks(config, self.model, device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks, self.plan.admission_wait_steps)
        self.runner = ModelRunner(self.model, config, self.plan, num_blocks)
        self.codec = _load_codec(codec or checkpoint, config, self.plan, device, codec is not None)
        # graphs before any request: backbone and sampler (the runner's), then the codec's
        self.capture_reports = self.runner.capture_graphs()
        if self.codec is not None:
            report = self.codec.capture_graphs(config.stream)
            self.capture_reports += [report] if report is not None else []
        self.audio_limits = AudioLimits()
        self.audio = AudioOutput(
            self.codec.chunks if self.codec else None,
            config.stream,
            self.plan.codec_defer_steps,
            self.plan.codec_defer_batch,
        )
        self._counters = StepCounters()
        self._observed = Observations()
        self._shape = READBACK  # what the step now running launched
        self._in_flight: PendingStep | None = None
        if is_default:
            log.warning(UNTRAINED_NOTICE)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        config: EngineConfig | None = None,
        *,
        codec: str | os.PathLike | None = None,
        cache_dir: Path | None = None,
    ) -> Engine:
        """From a checkpoint directory or hub id; None means the embedded default model.
        `codec`: a standalone Higgs audio tokenizer (default: the checkpoint's bundled codec)."""
        refuse_hugging_faces_kernels()
        config = config or EngineConfig()
        codec_path = resolve_checkpoint(codec) if codec is not None else None
        if model is None:
            return cls(default_model_dir(cache_dir), config, is_default=True, codec=codec_path)
        return cls(resolve_checkpoint(model), config, codec=codec_path)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        text: str,
        *,
        reference: VoiceReference | None = None,
        params: SamplingParams | None = None,
        audio: bool | None = None,
    ) -> None:
        """Queues a request. Raises ConfigError for a bad input (nothing is queued then).
        `audio` (default: whenever the engine has a codec) streams audio chunks in the events."""
        params = params or SamplingParams()
        if audio is None:
            audio = self.codec is not None
        if audio and self.codec is None:
            raise ConfigError("this engine has no codec: load one, or pass audio=False for codes")
        if request_id in self.audio.held:
            raise ConfigError(
                f"request id {request_id!r} is already in use (its last chunk is decoding)"
            )
        prompt = build_prompt(self.tokenizer, self.tokenizer.special, text, reference)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8)) >> 1
        self.scheduler.add(Request(request_id, prompt, params, seed))
        if audio:
            self.audio.open(request_id)

    def check_text(self, text: str, reference: VoiceReference | None = None) -> None:
        """Raises ConfigError if `text` cannot be spoken (empty, structural tokens, too long
        for `max_model_len`); lets callers reject input before queueing anything."""
        TextChecker(self.tokenizer, self.config.max_model_len)(text, reference)

    def encode_reference(
        self,
        audio: bytes | None = None,
        text: str | None = None,
        *,
        waveform=None,
        sample_rate: int | None = None,
    ) -> VoiceReference:
        """A voice from reference audio: an audio file's bytes, or a waveform `[channels, N]`
        with its sample rate. Encoded references are cached by content; thread-safe.
        Raises ConfigError (a ReferenceAudioError with a stable `code`) for unusable audio."""
        if self.codec is None:
            raise ConfigError("this engine has no codec to encode reference audio")
        if (audio is None) == (waveform is None):
            raise ConfigError("pass either audio bytes or a waveform with its sample rate")
        if audio is not None:
            frames, _ = self.codec.encode_file(audio, self.audio_limits)
        else:
            if not sample_rate:
                raise ConfigError("a waveform needs its sample_rate")
            frames, _ = self.codec.encode_waveform(waveform, sample_rate, self.audio_limits)
        return VoiceReference(frames, text or None)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its KV blocks and slot; False if it is not known."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            # finished, its last chunk still decoding: nothing more is reported for it
            return self.audio.release(request_id)
        self._finish(request, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        self._drop_ended_in_flight()
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or bool(self.audio.in_flight)
        )

    def _drop_ended_in_flight(self) -> None:
        """Forgets the step in flight once every request in it has ended (nothing to read)."""
        pending = self._in_flight
        if pending is not None and all(r.is_finished for r in pending.requests):
            self._in_flight = None

    def rows(self, request_id: str) -> list[AudioRow]:
        """Rows generated so far by a request whose finish has not been reported."""
        request = self.scheduler.requests.get(request_id) or self.audio.held.get(request_id)
        if request is None:
            raise KeyError(request_id)
        return list(request.output_rows)

    # -- the step ----------------------------------------------------------------------------

    def step(
        self, emit: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """Schedules and launches one step, then reads the rows of the step launched before
        it (with `async_scheduling`; otherwise of this step) and returns their events. The GPU
        runs step N while the host reads step N-1 and prepares step N+1: a request's finish is
        seen one step late, and a finishing request may compute one row that is dropped.

        `emit`, if given, is called with the events that are ready before this step waits for
        the GPU (after its launch): the audio read back from the codec and, when KV blocks ran
        short and the previous rows were read first, those rows' events. They leave up to one
        step earlier and are not in the returned list; events keep their order either way. If
        `emit` raises, the step still reads its rows (the engine stays consistent) and the
        exception propagates, with those rows' events lost to the caller."""
        start, self._shape = time.perf_counter(), READBACK
        try:
            return self._step(emit)
        finally:
            self._observed.steps.append((time.perf_counter() - start, self._shape))

    def _step(self, emit) -> list[RequestOutput]:
        timing = self._counters.timing
        with timing():
            outputs = self._read_first_if_short_of_blocks()
            launched = self._schedule_and_launch()
            pending = self._next_to_read(launched)
            # Audio submitted by earlier steps has run beside the GPU work since: read it
            # now, then this step's rows (which submit the windows they complete).
            with timing("audio"):
                outputs += self.audio.collect(self._finish)
                outputs, emit_error = _emit_early(emit, outputs)
            if pending is not None:
                outputs += self._read(pending)  # times its own phases (gpu_wait, rows)
            if emit_error is not None:
                raise emit_error
            if self._in_flight is None and launched is None:  # nothing on the GPU: hold no
                with timing("audio"):  # audio back
                    outputs += self.audio.collect(self._finish)
            return outputs

    def _read_first_if_short_of_blocks(self) -> list[RequestOutput]:
        """Rows in flight may end requests and free their blocks: read them first rather
        than preempt a live request for want of blocks that are about to be freed."""
        if self._in_flight is None or not self.scheduler.short_of_blocks():
            return []
        pending, self._in_flight = self._in_flight, None
        return self._read(pending)

    def _schedule_and_launch(self) -> PendingStep | None:
        with self._counters.timing("schedule"):
            sched = self.scheduler.schedule()
        with self._counters.timing("launch"):
            self._counters.preemptions += len(sched.preempted)
            self._shape = _shape(sched)
            if not sched.chunks:
                return None
            now = time.monotonic()
            for chunk in sched.admitted:  # a running request has its slot and first step
                request = chunk.request
                if not self.runner.has_request(request):  # new (not back from preemption)
                    self.runner.add_request(request)
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    self._observed.queue_seconds.append(now - request.arrival_time)
            launched = self.runner.launch(sched)
            self.scheduler.on_launched(sched)
            self._counters.steps += 1
            return launched

    def _next_to_read(self, launched: PendingStep | None) -> PendingStep | None:
        """The step whose rows this step reads: the one launched before it with
        `async_scheduling` (this one stays in flight), else this one."""
        if not self.plan.async_scheduling:
            return launched
        pending, self._in_flight = self._in_flight, launched
        return pending

    def _read(self, pending: PendingStep) -> list[RequestOutput]:
        """`_complete`, but if reading fails the step's requests end with an error (the
        exception propagates) so that the engine stays usable for the others."""
        try:
            return self._complete(pending)
        except Exception:
            for request in pending.requests:
                if not request.is_finished:
                    self.scheduler.on_rows_lost(request)
                    self._finish(request, FinishReason.ERROR)
            raise

    def _complete(self, pending: PendingStep) -> list[RequestOutput]:
        """Reads a launched step's rows (waits for them) and turns them into events."""
        with self._counters.timing("gpu_wait"):
            sampled = pending.result()
        with self._counters.timing("rows"):
            self.scheduler.on_rows_read(sampled.requests)
            updates = self._append_rows(sampled)
            decoding, failed = self.audio.submit(updates)
            outputs = []
            if failed:
                outputs = [
                    self._failed(r, failed[r.request_id])
                    for r, _, _ in updates
                    if r.request_id in failed
                ]
            if not self.config.row_events:
                updates = [u for u in updates if u[2] is not None]  # finishes only
            outputs += [
                self._output(request, row, reason, request.request_id in decoding)
                for request, row, reason in updates
                if request.request_id not in failed
            ]
        return outputs

    def _failed(self, request: Request, error: str) -> RequestOutput:
        """A request whose own part of the step failed: it ends alone with an error."""
        self._finish(request, FinishReason.ERROR)
        return RequestOutput(
            request.request_id, [], True, FinishReason.ERROR.value, request.output_rows, None, error
        )

    def _append_rows(self, sampled) -> list[tuple[Request, AudioRow, FinishReason | None]]:
        updates = []
        now = time.monotonic()
        codes, dones = sampled.codes.tolist(), sampled.done.tolist()
        for request, row_list, done in zip(sampled.requests, codes, dones, strict=True):
            if request.status is _FINISHED:  # `request.is_finished`, without a call a row
                continue  # ended (finished, aborted) while this row was in flight: dropped
            row = tuple(row_list)
            request.output_rows.append(row)
            if request.first_row_time is None:
                request.first_row_time = now
            reason = None
            if done:
                reason = FinishReason.EOS
            elif len(request.output_rows) >= request.params.max_rows:
                reason = FinishReason.LENGTH
            updates.append((request, row, reason))
        self._counters.rows += len(updates)
        return updates

    def _output(self, request: Request, row: AudioRow, reason, decoding: bool) -> RequestOutput:
        """The event of one new row. A request that ends with its last chunk still decoding
        is finished now (its blocks and slot are freed) and reported when the chunk is read."""
        if reason is None:
            return RequestOutput(request.request_id, [row])
        self._finish(request, reason)
        if decoding:
            self.audio.hold(request)
            return RequestOutput(request.request_id, [row])
        return RequestOutput(request.request_id, [row], True, reason.value, request.output_rows)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self.runner.remove_request(request)
        self.audio.close(request.request_id)

    # -- conveniences ------------------------------------------------------------------------

    def generate(
        self,
        texts: Sequence[str],
        *,
        references: Sequence[VoiceReference | None] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        audio: bool | None = None,
    ) -> list[GenerationResult]:
        """Runs every text to completion (batched) and returns rows in input order."""
        refs = list(references) if references is not None else [None] * len(texts)
        plist = list(params) if isinstance(params, Sequence) else [params] * len(texts)
        if len(refs) != len(texts) or len(plist) != len(texts):
            raise ConfigError("texts, references and params must have the same length")
        ids = [f"generate-{id(self)}-{self._counters.steps}-{i}" for i in range(len(texts))]
        added: list[str] = []
        try:
            for rid, text, ref, p in zip(ids, texts, refs, plist, strict=True):
                self.add_request(rid, text, reference=ref, params=p, audio=audio)
                added.append(rid)
        except ConfigError:
            for rid in added:  # all or nothing
                self.abort(rid)
            raise
        results: dict[str, GenerationResult] = {}
        pcm: dict[str, list[bytes]] = {rid: [] for rid in ids}
        while len(results) < len(ids):
            for out in self.step():
                if out.request_id not in pcm:
                    continue
                if out.audio is not None:
                    pcm[out.request_id].append(out.audio.pcm)
                if out.finished:
                    results[out.request_id] = GenerationResult(
                        out.request_id,
                        list(out.rows or []),
                        str(out.finish_reason),
                        b"".join(pcm[out.request_id]),
                    )
        self._drop_ended_in_flight()
        return [results[rid] for rid in ids]

    def take_observations(self) -> Observations:
        """The observations since the last call (the thread that steps the engine only)."""
        taken, self._observed = self._observed, Observations()
        taken.codec_batches = self.audio.take_batch_latencies()
        return taken

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_kv_blocks=self.blocks.num_free_blocks,
            num_kv_blocks=self.blocks.num_usable_blocks,
            num_prefill_tokens_computed=self.scheduler.num_prefill_tokens_computed,
            num_prefix_cached_tokens=self.scheduler.num_prefix_cached_tokens,
            num_preemptions=self._counters.preemptions,
            num_voice_encodes=self.codec.encoder.num_encodes if self.codec else 0,
            num_voice_cache_hits=self.codec.voices.stats.hits if self.codec else 0,
            num_voice_cache_bytes=self.codec.voices.stats.bytes if self.codec else 0,
            num_steps=self._counters.steps,
            num_rows_generated=self._counters.rows,
            step_seconds_total=self._counters.seconds,
            phase_seconds_total=tuple(self._counters.phases),
        )


def _emit_early(emit, outputs: list[RequestOutput]) -> tuple[list, Exception | None]:
    """Hands `outputs` to `emit` (if any): (what the step still returns, emit's exception).
    A raising `emit` is a caller's bug; the step still reads its rows before re-raising."""
    if emit is None or not outputs:
        return outputs, None
    try:
        emit(outputs)
    except Exception as exc:
        return [], exc
    return [], None


def _shape(sched) -> StepShape:
    """prefill, decode or mixed (READBACK when nothing is launched): by the scheduler's count
    of decode chunks (`SchedulerOutput.num_decodes`)."""
    if not sched.chunks:
        return READBACK
    decodes = sched.num_decodes
    kind = "decode" if decodes == len(sched.chunks) else "mixed" if decodes else "prefill"
    return StepShape(kind, len(sched.chunks), sched.num_tokens)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_codec(
    path: Path, config: EngineConfig, plan: ExecutionPlan, device: torch.device, required: bool
):
    try:
        return Codec.load(path, device, config.voice_cache_bytes, plan)
    except ConfigError as exc:
        if required:
            raise
        log.warning("no codec loaded (%s): requests produce codes only", exc)
        return None
