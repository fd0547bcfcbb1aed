"""Known mutants: deliberate bugs a listener or a client would notice, each with the fast
tests that must catch it. `tests/mutants/run.py` applies them one at a time to a scratch copy
of the tree. Each edit replaces text that must occur exactly once in its file, so a mutant
whose code has moved on is reported as stale instead of silently testing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT = "tests/service/test_audio_content.py"
WS = CONTENT + "::test_websocket_audio_equals_the_engines"
HTTP = CONTENT + "::test_http_speech_equals_the_engines"
STREAM = "tests/engine/test_stream_content.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest arguments: the fast tests that must fail
    what: str  # the bug, as a user would see it


MUTANTS = (
    Mutant(
        "voice-dropped",
        "service/engine_client.py",
        "AddRequest(wire, text, reference, params)",
        "AddRequest(wire, text, None, params)",
        (f"{WS}[clone-one]", f"{HTTP}[http-clone-two-whole]"),
        "every request reaches the engine without its voice",
    ),
    Mutant(
        "silence-sent",
        "service/audio_format.py",
        "return self._with_header(pcm16)",
        "return self._with_header(bytes(len(pcm16)))",
        (f"{WS}[plain-one]", f"{HTTP}[http-plain-whole]"),
        "24 kHz PCM16 audio is replaced by silence of the same length",
    ),
    Mutant(
        "wrong-rate-in-audio-header",
        "service/session.py",
        '"sample_rate": utt.format.sample_rate,',
        '"sample_rate": 24000,',
        (f"{WS}[clone-two-16k]",),
        "the `audio` message announces 24 kHz whatever rate was asked for",
    ),
    Mutant(
        "wrong-rate-in-wav-header",
        "service/speech_api.py",
        "wav_header(fmt.sample_rate, len(audio) - 44)",
        "wav_header(24000, len(audio) - 44)",
        (f"{HTTP}[http-clone-22k-whole]",),
        "a WAV file from /v1/audio/speech says 24 kHz whatever its rate",
    ),
    Mutant(
        "frame-dropped-at-chunk-boundary",
        "engine/streaming.py",
        "        start = self.emitted\n",
        "        start = self.emitted + (self.index == 1)\n",
        (STREAM,),
        "the first frame after the 320 ms chunk is never heard",
    ),
    Mutant(
        "delay-off-by-one-codebook",
        "engine/streaming.py",
        "codes = span[_CODEBOOKS + np.arange(n), _CODEBOOKS]",
        "codes = span[np.maximum(_CODEBOOKS - 1, 0) + np.arange(n), _CODEBOOKS]",
        (STREAM,),
        "codebook c is read from row f + c - 1 instead of f + c when undelaying",
    ),
    Mutant(
        "seed-ignored",
        "service/protocol.py",
        "sampling = SamplingParams.from_dict(raw)",
        "sampling = SamplingParams.from_dict({k: v for k, v in raw.items() if k != 'seed'})",
        (f"{WS}[plain-one]",),
        "a request's seed is dropped: seeded requests are not reproducible",
    ),
    Mutant(
        "a-segment-skipped",
        "service/utterance.py",
        "            self.emit_index += 1\n",
        "            self.emit_index += 1 + (self.emit_index == 0 and len(self.segments) > 1)\n",
        (f"{WS}[plain-two]", f"{HTTP}[http-clone-two-whole]"),
        "an utterance of several segments never speaks its second one",
    ),
    Mutant(
        "resampler-restarted-per-chunk",
        "service/audio_format.py",
        "x = self._resampler.push(x)",
        "x = StreamingResampler(self.fmt.sample_rate).push(x)",
        (f"{WS}[clone-two-16k]",),
        "resampled streams lose the context across chunk cuts (clicks, lost samples)",
    ),
    Mutant(
        "cancel-ignored",
        "service/session.py",
        "        self._end(utt, State.CANCELLED)\n        self.send_json(",
        "        self.send_json(",
        ("tests/service/test_ws_protocol.py::test_cancel_stops_audio_and_frees_the_engine",),
        "cancel is acknowledged but the audio keeps coming",
    ),
    Mutant(
        "request-id-not-echoed",
        "service/session.py",
        '"request_id": request_id,',
        '"request_id": None,',
        ("tests/service/test_voices.py::test_ws_voice_create_speak_and_cache",),
        "voice.created does not say which request it answers",
    ),
    Mutant(
        "eoc-not-ending",
        "engine/delay_state.py",
        "done = ending & (new_countdown == 0)",
        "done = ending & (new_countdown < 0)",
        ("tests/engine/test_delay_state.py", "tests/engine/test_async_scheduling.py"),
        "an utterance that emitted its end code goes on to the length cap",
    ),
    Mutant(
        "prefix-hit-wrong-blocks",
        "engine/block_manager.py",
        "            blocks.append(block)\n",
        "            blocks.append(self._block_of[hashes[0]])\n",
        ("tests/engine/test_parity.py::test_prefix_cache_hit[torch]",),
        "a prefix-cache hit maps every cached block to the first one",
    ),
    Mutant(
        "message-rate-ignored",
        "service/ws.py",
        "wait = rate.take()",
        "wait = 0.0",
        (
            "tests/service/test_ws_frames.py::"
            "test_messages_over_the_rate_are_refused_with_rate_limited_then_served_again",
        ),
        "a client floods a connection with as many messages as it can send",
    ),
    Mutant(
        "flood-never-closed",
        "service/message_rate.py",
        "if wait and self.refusals.take():",
        "if False:",
        (
            "tests/service/test_message_rate.py::"
            "test_a_flood_is_closed_even_when_tokens_refill_between_its_refusals",
            "tests/service/test_ws_frames.py::"
            "test_a_client_that_floods_on_after_being_told_is_closed_with_1008",
        ),
        "a client that ignores rate_limited keeps the server answering it for ever",
    ),
    Mutant(
        "scrape-tears-step-reports",
        "service/metrics.py",
        "        with self.report_lock:\n            collected",
        "        if True:\n            collected",
        ("tests/service/test_engine_process.py::test_a_scrape_sees_a_report_of_steps_whole",),
        "a dashboard's phases of step time add up to more than the step time",
    ),
    Mutant(
        "http-deadline-never-armed",
        "service/transport_guards.py",
        "        if phase != self._timer_phase:\n",
        "        if False:\n",
        (
            "tests/service/test_slow_clients.py::"
            "test_a_head_sent_a_byte_at_a_time_gets_408_and_others_are_served",
        ),
        "a client sending its headers a byte at a time holds a connection forever",
    ),
    Mutant(
        "unflushed-append-keeps-connection",
        "service/ws.py",
        "if any(not u.waiting_for_text for u in session.utterances.values()):",
        "if session.utterances:",
        (
            "tests/service/test_ws_limits.py::"
            "test_an_append_waiting_for_more_text_does_not_keep_the_connection_open",
        ),
        "an append never flushed keeps a silent connection open forever",
    ),
    Mutant(
        "affinity-ignored",
        "service/engine_router.py",
        "if home is not None and home.ready and home.load <= least.load + slack:",
        "if False:",
        (
            "tests/service/test_multi_engine.py::"
            "test_the_router_prefers_the_voices_engine_unless_it_is_clearly_busier",
        ),
        "a voice used again lands on any engine and computes its prompt again",
    ),
    Mutant(
        "engine-never-restarted",
        "service/engine_supervisor.py",
        "        self.task = asyncio.get_running_loop().create_task(self._restart(reason))",
        "        self.task = None",
        (
            "tests/service/test_engine_supervision.py::"
            "test_kill_9_mid_stream_fails_only_what_was_in_flight_and_the_engine_comes_back",
        ),
        "after its engine dies the server stays unready until restarted by hand",
    ),
    Mutant(
        "drain-does-not-wait",
        "service/drain.py",
        "    while services.utterances and loop.time() < deadline:",
        "    while False:",
        (
            "tests/service/test_drain.py::"
            "test_sigterm_drains_running_streams_refuses_new_work_and_exits_0",
        ),
        "a deploy cuts every running utterance off at once",
    ),
    Mutant(
        "one-window-fails-the-step",
        "engine/audio_output.py",
        '                failed[request.request_id] = f"audio window failed: '
        '{type(exc).__name__}: {exc}"\n                continue',
        "                raise",
        (
            "tests/service/test_fault_isolation.py::"
            "test_a_failure_in_one_requests_part_of_a_step_ends_only_that_request",
        ),
        "one request's failure ends every stream in its engine step",
    ),
    Mutant(
        "utterance-stays-on-a-dead-engine",
        "service/utterance.py",
        "        if self.pick_engine is None or self.engine.alive or self.active_request_ids():",
        "        if True:",
        (
            "tests/service/test_engine_supervision.py::"
            "test_an_append_utterance_waiting_for_text_outlives_its_engine",
        ),
        "an append utterance idle when its engine died fails at its next text, though the "
        "engine is back",
    ),
    Mutant(
        "deferred-chunk-after-its-successor",
        "engine/audio_output.py",
        "        return any(r.request_id in waiting for r in owners)",
        "        return False",
        (
            "tests/engine/test_codec_deferral.py::"
            "test_a_last_chunk_takes_its_waiting_chunk_ahead_of_it",
        ),
        "with codec batching on, a stream's last chunk can arrive before the one waiting "
        "for a batch",
    ),
    Mutant(
        "deferred-chunk-ignores-its-client",
        "engine/audio_output.py",
        "        if any(not self._may_wait(w, now) for w, _, _ in self.deferred):",
        "        if False:",
        ("tests/engine/test_codec_deferral.py::test_a_chunk_whose_client_runs_short_goes_at_once",),
        "with codec batching on, a chunk waits for its batch while its listener runs out of audio",
    ),
    Mutant(
        "fp16-codec-untimed",
        "engine/plan.py",
        '    codec_dtype = o.get("codec_dtype", "float16" if autotune else "float32")',
        '    codec_dtype = o.get("codec_dtype", "float16")',
        (
            "tests/engine/test_plan.py::test_the_gpu_codec_is_fp16_only_where_its_algorithms_are_timed",
        ),
        "a GPU server without codec graphs runs its codec in fp16 on cuDNN's untimed picks, "
        "6-10x slower than fp32 at some batch sizes",
    ),
    Mutant(
        "codec-timing-ended-by-another-engine",
        "engine/codec/codec_graphs.py",
        "            if _tuners == 0:\n                cudnn.benchmark = _flag_before",
        "            cudnn.benchmark = _flag_before",
        (
            "tests/engine/test_codec_loader.py::"
            "test_overlapping_autotuned_captures_keep_benchmark_mode_until_the_last_leaves",
        ),
        "two engines of one process starting together: the second captures part of its fp16 "
        "codec untimed, 6-10x slower at some batch sizes",
    ),
    Mutant(
        "flat-grid-misses-blocks",
        "kernels/paged_attention.py",
        "    return lo, block - (tl.load(qsl_ptr + lo) // BLOCK_M + lo), tl.program_id(1)",
        "    return lo, block - tl.load(qsl_ptr + lo) // BLOCK_M, tl.program_id(1)",
        (
            "tests/kernels/test_paged_attention.py::"
            "test_the_flat_grid_computes_what_the_sequence_grid_does",
        ),
        "with the flat attention grid, a prompt beside other sequences is attended in part: "
        "garbage speech that runs to the length cap",
    ),
    Mutant(
        "decode-launch-skips-decode-rows",
        "kernels/paged_attention.py",
        "    if ROWS == 1 and q_len != 1:  # DECODE_ROWS",
        "    if ROWS == 1 and q_len >= 1:  # DECODE_ROWS",
        (
            "tests/kernels/test_paged_attention.py::"
            "test_decode_rows_apart_compute_what_their_own_launches_do",
        ),
        "with split_mixed_attention, every stream decoding beside a new prompt gets no "
        "attention output that step: noise in every stream whenever a request is admitted",
    ),
    Mutant(
        "split-attention-never-serves-decodes",
        "engine/attention.py",
        "*index, 1, out=out, rows=DECODE_ROWS, **knobs)",
        "*index, 1, out=out, rows=PROMPT_ROWS, **knobs)",
        ("tests/engine/test_plan.py::test_split_mixed_attention_launches_decode_rows_apart",),
        "with split_mixed_attention, the decode rows of a mixed step are never attended",
    ),
    Mutant(
        "row-blocks-read-the-first-rows",
        "kernels/skinny_gemm.py",
        "            x = x_ptr.load([block * BM, k0])",
        "            x = x_ptr.load([0, k0])",
        ("tests/kernels/test_skinny_gemm.py::test_rows_past_a_tile_go_in_blocks",),
        "with TMA tiles, every row block past the first multiplies the first block's rows: the"
        " streams of a large step speak another stream's continuation",
    ),
    Mutant(
        "fp8-tiles-unswept",
        "kernels/skinny_gemm.py",
        "    swept = _fp8_sweep_tiles(bm, n, k, tma) if element_size == 1 else None",
        "    swept = None",
        (
            "tests/kernels/test_skinny_gemm.py::test_default_tiles_are_the_h200_sweeps_best",
            "tests/kernels/test_fp8_quant.py::test_skinny_gemm_with_the_swept_fp8_tiles",
        ),
        "fp8 steps run the slower two-byte tiles: about 8 us a layer lost at 64 rows, and the"
        " decode step 3% slower at 32 (H100)",
    ),
    Mutant(
        "running-chunk-over-budget",
        "engine/scheduler.py",
        "            if n > budget:\n                n = budget\n",
        "",
        (
            "tests/engine/test_scheduler.py::"
            "test_chunked_prefill_respects_budget_and_mixes_with_decode",
        ),
        "a resumed request's whole recompute goes into one step past the token budget: a"
        " step longer than any captured graph",
    ),
    Mutant(
        "admission-never-waits",
        "engine/scheduler.py",
        "if not self.running or self._steps_since_admission >= self.admission_wait_steps:",
        "if True:",
        (
            "tests/engine/test_scheduler.py::"
            "test_admissions_while_others_decode_come_at_most_every_wait_plus_one_steps",
            "tests/engine/test_engine.py::test_admission_wait_moves_when_prompts_run_not_the_rows",
        ),
        "every prompt takes its own mixed step: 16% fewer audio-s/s at 256 streams (H100)",
    ),
    Mutant(
        "admission-holds-an-idle-engine",
        "engine/scheduler.py",
        "if not self.running or self._steps_since_admission >= self.admission_wait_steps:",
        "if self._steps_since_admission >= self.admission_wait_steps:",
        ("tests/engine/test_scheduler.py::test_admission_wait_never_holds_an_idle_engine",),
        "a lone request on an idle engine waits N steps for company that cannot come",
    ),
    Mutant(
        "admission-holds-cold-prompts",
        "engine/scheduler.py",
        "if positions >= HOLD_POSITIONS:",
        "if positions >= 1 << 30:",
        (
            "tests/engine/test_scheduler.py::"
            "test_admission_wait_holds_prompts_only_while_they_compute_few_positions",
        ),
        "clone prompts of voices not in the cache wait out the admission period and queue:"
        " 30 ms more mean first audio at 64 streams of many voices (H100)",
    ),
    Mutant(
        "float8-v-staged-as-bytes",
        "kernels/paged_attention.py",
        "        return tl.where(n_ok[:, None], v.to(DTYPE), 0.0)\n",
        "        return v.to(DTYPE)\n",
        ("tests/kernels/test_sm90_compile.py::test_a_float8_cache_is_read_without_byte_loads",),
        "a float8 KV cache's attention reads its V operand a byte at a time from shared memory",
    ),
    Mutant(
        "audio-window-a-row-late",
        "engine/audio_output.py",
        "len(request.output_rows) < stream.rows_due",
        "len(request.output_rows) <= stream.rows_due",
        ("tests/engine/test_engine_audio.py::test_chunks_stream_with_exact_sizes_and_timestamps",),
        "every chunk, the first included, leaves a step (about 8 ms at 256 streams) late",
    ),
    Mutant(
        "block-table-column-short",
        "engine/runner.py",
        "width = -(-int(seq_lens[:num].max()) // bs)",
        "width = int(seq_lens[:num].max()) // bs",
        (
            "tests/engine/test_parity.py::test_single_prefill_and_decode",
            "tests/engine/test_parity.py::test_greedy_matches_full_recompute_loop",
        ),
        "a sequence's newest KV page is read through a stale table entry: garbled speech",
    ),
)
