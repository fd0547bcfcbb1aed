"""Prometheus metrics of the service, in its own registry (several apps may live in one test
process). Names follow the conventions of the LLM servers people already scrape, with the
speech-specific ones added: time to first audio with a 0.32 s bucket edge, audio seconds,
real-time factor, underruns, and the engine step time against the 40 ms frame budget."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine import STEP_PHASES

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


TRANSPORTS = ("websocket", "http")  # the `transport` label: how an utterance was asked for


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "clonecast_"
        t = ["transport"]
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
        self.step = Histogram(
            p + "engine_step_seconds",
            "Duration of one engine step (budget: 0.04 s)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._rows_seen = 0
        self.rows = Counter(
            p + "engine_rows",
            "Rows sampled by the engine (one per decoding request and step; 40 ms of audio each)",
            registry=r,
        )
        phase = Counter(
            p + "engine_phase_seconds",
            "Host time inside engine steps by phase (schedule, launch, audio, gpu_wait, rows)",
            ["phase"],
            registry=r,
        )
        self._phases = [phase.labels(name) for name in STEP_PHASES]
        self._phases_seen = [0.0] * len(STEP_PHASES)
        self.audio_seconds = Counter(
            p + "audio_seconds", "Seconds of audio sent to clients", t, registry=r
        )
        self.underruns = Counter(
            p + "underruns", "Chunks ready after the audio before them had played", t, registry=r
        )
        self.requests = Counter(
            p + "request_success",
            "Ended utterances by reason: eos, length, cancelled, error",
            ["finished_reason", "transport"],
            registry=r,
        )
        self.errors = Counter(
            p + "errors", "Errors sent to clients by code", ["code", "transport"], registry=r
        )
        for transport in TRANSPORTS:  # every series exists from the start (at zero)
            for series in (self.first_audio, self.e2e, self.rtf, self.audio_seconds):
                series.labels(transport)
            self.underruns.labels(transport)
        self.engine_up = Gauge(
            p + "engine_up", "1 while the engine (its process or thread) runs, else 0", registry=r
        )
        self.running = Gauge(p + "num_requests_running", "Engine requests running", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Engine requests waiting", registry=r)
        self.kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Fraction of KV cache blocks in use", registry=r
        )
        self.kv_free = Gauge(p + "kv_cache_free_blocks", "Free KV cache blocks", registry=r)
        self.connections = Gauge(
            p + "websocket_connections", "Open WebSocket connections", registry=r
        )
        self.voice_encodes = Gauge(p + "voice_encodes", "Reference recordings encoded", registry=r)
        self.voice_cache_hits = Gauge(
            p + "voice_cache_hits", "Reference encodes served from the cache", registry=r
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

    def count_rows(self, total: int) -> None:
        """The engine's running total of rows; called by one thread only (the engine's)."""
        self.rows.inc(total - self._rows_seen)
        self._rows_seen = total

    def count_phases(self, totals) -> None:
        """The engine's running totals of host time per step phase (engine thread only)."""
        for i, (child, total) in enumerate(zip(self._phases, totals, strict=True)):
            child.inc(max(0.0, total - self._phases_seen[i]))
            self._phases_seen[i] = total

    def update_engine(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_free.set(stats.num_free_kv_blocks)
        self.kv_usage.set(1.0 - stats.num_free_kv_blocks / max(1, stats.num_kv_blocks))
        self.voice_encodes.set(stats.num_voice_encodes)
        self.voice_cache_hits.set(stats.num_voice_cache_hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
