"""Prometheus metrics of the service, in its own registry (several apps may live in one test
process). Names follow the conventions of the LLM servers people already scrape, with the
speech-specific ones added: time to first audio with a 0.32 s bucket edge, audio seconds,
real-time factor, chunk lead and underruns, and the engine step time against the 40 ms frame
budget. Base units, the unit in the name, counters end in `_total` (prometheus-client adds
it); labels are bounded (transport, kind, phase, code, reason, and key: an API key's name,
bounded by the keys configured; never an id, a text or a key). docs/observability.md lists
every series."""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from engine import DEFAULT_BUCKETS, GRAPH_FAMILIES, STEP_KINDS, STEP_PHASES

# No `_created` series beside every counter and histogram (prometheus-client's default): they
# double what each scrape carries and no panel or alert reads them.
disable_created_metrics()

FIRST_AUDIO_BUCKETS = (
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.25,
    0.32,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.08, 0.16)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Token positions a step launched: an edge at every default graph bucket, so the share of
# steps per bucket is exact.
TOKEN_BUCKETS = (*DEFAULT_BUCKETS, 2048)
CODEC_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)
# How far ahead of the playhead a chunk arrived; negative: the player ran dry (an underrun).
LEAD_BUCKETS = (-1.0, -0.25, -0.1, -0.04, 0.0, 0.04, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


TRANSPORTS = ("websocket", "http")  # the `transport` label: how an utterance was asked for
# How an utterance ended: its finish (eos, length), the client's cancel, the client gone
# before the end, or an error (errors_total says which).
OUTCOMES = ("eos", "length", "cancelled", "disconnected", "error")
# Why a WebSocket connection ended: the client closed it (a close frame with 1000 or 1001),
# the client was lost (any other close, or sending to it failed), it idled out, or it went on
# sending over its message rate after being told (closed with 1008).
CLOSE_REASONS = ("client_closed", "client_lost", "idle_timeout", "rate_limited")
# Why an utterance went to its engine (service/engine_router.py).
ROUTE_REASONS = ("affinity", "least_loaded")


class _Total:
    """A counter fed from one of the engine's running totals: increments by what the total
    grew since it was last seen; a smaller total is an older snapshot arriving late (a
    voice encode's statistics can overtake a step's), never a restart: a new engine calls
    `reset`. Fed from two threads (the events reader and the event loop), hence the lock: a
    total is never counted twice."""

    def __init__(self, counter) -> None:
        self.counter, self.seen = counter, 0
        self.lock = threading.Lock()

    def update(self, total: float) -> None:
        with self.lock:
            if total > self.seen:  # less: an older snapshot arriving late (never counted)
                self.counter.inc(total - self.seen)
                self.seen = total

    def reset(self) -> None:
        """A new engine: its totals count from 0."""
        with self.lock:
            self.seen = 0


class _Collected:
    """Metric families collected at one moment, as the collector `generate_latest` reads."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # the server process's memory, CPU, open files, start
        PlatformCollector(registry=r)
        p = "clonecast_"
        t = ["transport"]
        self.build = Info(
            p + "build", "Version, model, untrained flag, device and dtype", registry=r
        )
        # -- utterances (every transport) ---------------------------------------------------
        self.first_audio = Histogram(
            p + "time_to_first_audio_seconds",
            "Request received to first audio byte sent",
            t,
            buckets=FIRST_AUDIO_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Request received to last audio byte sent",
            t,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            p + "real_time_factor",
            "Generation time over audio duration, per utterance",
            t,
            buckets=RTF_BUCKETS,
            registry=r,
        )
        self.chunk_lead = Histogram(
            p + "chunk_lead_seconds",
            "How far ahead of the playhead each chunk after the first was sent (negative: the "
            "player had run dry); the playhead starts at the first audio and waits when dry",
            t,
            buckets=LEAD_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter(
            p + "audio_seconds", "Seconds of audio sent to clients", t, registry=r
        )
        self.underruns = Counter(
            p + "underruns", "Chunks sent after the audio before them had played", t, registry=r
        )
        self.underrun_seconds = Counter(
            p + "underrun_seconds",
            "Seconds a player would have waited, out of audio, for late chunks",
            t,
            registry=r,
        )
        self.requests = Counter(
            p + "request_success",
            "Ended utterances by outcome: eos, length, cancelled, disconnected, error",
            ["finished_reason", "transport"],
            registry=r,
        )
        self.errors = Counter(
            p + "errors", "Errors sent to clients by code", ["code", "transport"], registry=r
        )
        # by key name (the operator's, from the key file, or a plaintext key's owner label:
        # bounded by the keys configured; never a key)
        self.key_rate_limited = Counter(
            p + "key_rate_limited",
            "Utterances refused for a key over its limit: utterances (at once) or audio_seconds",
            ["key", "limit"],
            registry=r,
        )
        self.key_audio_seconds = Counter(
            p + "key_audio_seconds", "Seconds of audio sent to each API key", ["key"], registry=r
        )
        for transport in TRANSPORTS:  # every series exists from the start (at zero)
            for series in (self.first_audio, self.e2e, self.rtf, self.chunk_lead):
                series.labels(transport)
            for series in (self.audio_seconds, self.underruns, self.underrun_seconds):
                series.labels(transport)
            for outcome in OUTCOMES:
                self.requests.labels(outcome, transport)
        # -- connections --------------------------------------------------------------------
        self.connections = Gauge(
            p + "websocket_connections", "Open WebSocket connections", registry=r
        )
        self.closes = Counter(
            p + "websocket_closes",
            "Ended WebSocket connections by reason: client_closed, client_lost, idle_timeout, "
            "rate_limited",
            ["reason"],
            registry=r,
        )
        for reason in CLOSE_REASONS:
            self.closes.labels(reason)
        # -- the engine ---------------------------------------------------------------------
        # `engine`: which of the server's engines (0, 1, ...: CLONECAST_DEVICES / ENGINES)
        e = ["engine"]
        self.engine_up = Gauge(
            p + "engine_up", "1 while the engine (its process or thread) runs, else 0", e,
            registry=r,
        )  # fmt: skip
        self.engine_restarts = Counter(
            p + "engine_restarts",
            "Engines started again after the engine died (service/engine_supervisor.py)",
            e,
            registry=r,
        )
        self.routed = Counter(
            p + "engine_routed",
            "Utterances sent to each engine, by why: affinity (it holds the voice's prefix) "
            "or least_loaded",
            ["engine", "reason"],
            registry=r,
        )
        self.running = Gauge(p + "num_requests_running", "Engine requests running", e, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Engine requests waiting", e, registry=r)
        self.queue = Histogram(
            p + "queue_time_seconds",
            "A request's arrival in the engine to its first scheduled step",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            p + "engine_step_seconds",
            "Duration of one engine step by what it launched: prefill, decode, mixed, "
            "readback (budget: 0.04 s)",
            ["kind", "engine"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            p + "engine_batch_size",
            "Requests in one launched engine step",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            p + "engine_step_tokens",
            "Token positions in one launched engine step (which graph bucket it replays)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.rows = Counter(
            p + "engine_rows",
            "Rows sampled by the engine (one per decoding request and step; 40 ms of audio)",
            registry=r,
        )
        phase = Counter(
            p + "engine_phase_seconds",
            "Host time inside engine steps by phase (schedule, launch, audio, gpu_wait, rows)",
            ["phase"],
            registry=r,
        )
        self._phase_children = [phase.labels(name) for name in STEP_PHASES]
        self.prefill_tokens = Counter(
            p + "prefill_tokens",
            "Prompt positions computed by the engine (prefix-cache hits excluded)",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            p + "prefix_cache_hit_tokens",
            "Prompt positions taken from the prefix cache instead of computed",
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions", "Requests preempted for want of KV cache blocks", registry=r
        )
        self.kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Fraction of KV cache blocks in use", e, registry=r
        )
        self.kv_free = Gauge(p + "kv_cache_free_blocks", "Free KV cache blocks", e, registry=r)
        self.codec_batch = Histogram(
            p + "codec_batch_seconds",
            "A codec batch's submission to its audio read back",
            buckets=CODEC_BUCKETS,
            registry=r,
        )
        self.codec_windows = Counter(
            p + "codec_windows", "Chunk windows decoded by the codec", registry=r
        )
        self.voice_hits = Counter(
            p + "voice_cache_hits",
            "Reference recordings whose codes came from the voice cache",
            registry=r,
        )
        self.voice_misses = Counter(
            p + "voice_cache_misses",
            "Reference recordings encoded by the codec (not in the voice cache)",
            registry=r,
        )
        self.voice_cache_bytes = Gauge(
            p + "voice_cache_bytes",
            "Bytes of encoded references the engine's voice cache holds (bounded, LRU)",
            e,
            registry=r,
        )
        self.capture_memory = Gauge(
            p + "graph_capture_memory_bytes",
            "Memory taken by captured graphs",
            ["family", "kind"],
            registry=r,
        )
        self.capture_seconds = Gauge(
            p + "graph_capture_seconds", "Time spent capturing graphs", ["family"], registry=r
        )
        for family in GRAPH_FAMILIES:  # 0 until captured (never, eager or on a CPU)
            self.capture_seconds.labels(family)
            for kind in ("allocated", "reserved"):
                self.capture_memory.labels(family, kind)
        self._engines: dict[int, EngineMetrics] = {}
        self._engines_lock = threading.Lock()
        # A report of steps moves several series at once (step times, rows, phases): a scrape
        # sees all of it or none, or a dashboard's phase split of the step time (and the
        # served benchmark's window) could add up to more than the step time itself.
        self.report_lock = threading.Lock()

    def key_refused(self, name: str, limit: str) -> None:
        self.key_rate_limited.labels(name, limit).inc()

    def set_build(self, version: str, info, model_name: str) -> None:
        """The info metric, once the engine has started (`info`: its EngineInfo)."""
        self.build.info(
            {
                "version": version,
                "model": model_name,
                "untrained": str(info.is_default_model).lower(),
                "device": info.device,
                "dtype": info.dtype,
            }
        )
        for report in info.capture_reports:
            self.capture_seconds.labels(report.family).set(report.seconds)
            self.capture_memory.labels(report.family, "allocated").set(report.allocated_bytes)
            self.capture_memory.labels(report.family, "reserved").set(report.reserved_bytes)

    def engine(self, index: int) -> EngineMetrics:
        """The series of engine `index` (made once; its series exist from then on)."""
        with self._engines_lock:
            if index not in self._engines:
                self._engines[index] = EngineMetrics(self, index)
            return self._engines[index]

    def render(self) -> bytes:
        # Only the collection holds the lock (about a third of a render): the events reader
        # that reports steps also hands out audio, and waits for it.
        with self.report_lock:
            collected = _Collected(list(self.registry.collect()))
        return generate_latest(collected)


class EngineMetrics:
    """One engine's view of the server's metrics: its labelled series, and its own record of
    the running totals it reports (each engine counts from 0, and again after a restart)."""

    def __init__(self, metrics: Metrics, index: int) -> None:
        m, label = metrics, str(index)
        self.m, self.label = m, label
        self.up = m.engine_up.labels(label)
        self.restarts = m.engine_restarts.labels(label)
        self.running, self.waiting = m.running.labels(label), m.waiting.labels(label)
        self.kv_free, self.kv_usage = m.kv_free.labels(label), m.kv_usage.labels(label)
        self.voice_cache_bytes = m.voice_cache_bytes.labels(label)
        self.step = {kind: m.step.labels(kind, label) for kind in STEP_KINDS}
        self.routed = {reason: m.routed.labels(label, reason) for reason in ROUTE_REASONS}
        names = ("rows", "prefill_tokens", "prefix_hit_tokens", "preemptions")
        self.totals = {name: _Total(getattr(m, name)) for name in names}
        self.voice_hits, self.voice_misses = _Total(m.voice_hits), _Total(m.voice_misses)
        self.phases = [_Total(child) for child in m._phase_children]

    def new_engine(self) -> None:
        """The slot's engine was started again: its running totals begin at 0."""
        for total in [*self.totals.values(), self.voice_hits, self.voice_misses, *self.phases]:
            total.reset()

    def observe_steps(self, observed, stats) -> None:
        """A report of engine steps (the reader thread of this engine's events only), seen by
        a scrape as one change (`Metrics.report_lock`)."""
        m = self.m
        with m.report_lock:
            for seconds, shape in observed.steps:
                self.step[shape.kind].observe(seconds)
                if shape.requests:
                    m.batch.observe(shape.requests)
                    m.step_tokens.observe(shape.tokens)
            for seconds in observed.queue_seconds:
                m.queue.observe(seconds)
            for seconds, windows in observed.codec_batches:
                m.codec_batch.observe(seconds)
                m.codec_windows.inc(windows)
            self.totals["rows"].update(stats.num_rows_generated)
            for child, total in zip(self.phases, stats.phase_seconds_total, strict=True):
                child.update(total)
            self.update(stats)

    def update(self, stats) -> None:
        """The engine's state (gauges) and its running totals. Called from the events reader
        and the event loop (a snapshot: no lock is held across the engine)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_free.set(stats.num_free_kv_blocks)
        self.kv_usage.set(1.0 - stats.num_free_kv_blocks / max(1, stats.num_kv_blocks))
        self.totals["prefill_tokens"].update(stats.num_prefill_tokens_computed)
        self.totals["prefix_hit_tokens"].update(stats.num_prefix_cached_tokens)
        self.totals["preemptions"].update(stats.num_preemptions)
        self.voice_hits.update(stats.num_voice_cache_hits)
        self.voice_misses.update(stats.num_voice_encodes)
        self.voice_cache_bytes.set(stats.num_voice_cache_bytes)
