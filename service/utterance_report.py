"""What an utterance reports, whatever its transport: its audio as it goes out (first audio,
chunk lead, underruns, audio seconds: the Prometheus series with their `transport` label) and
one log line when it ends (ids, transport, the API key's name, voice, segments, first audio,
audio seconds, real-time factor, outcome or error code; never its text nor a key). Its audio
also counts against its key's per-minute limit (service/key_limits.py). Plain text or JSON, by
CLONECAST_LOG_FORMAT.

Lead and underruns are measured against a player that starts with the first audio and, when
it runs dry, waits for the next chunk (its playhead stalls): a chunk's lead is the audio sent
before it minus what that player has played. One late chunk is one underrun, not one for
every chunk after it."""

from __future__ import annotations

import json
import logging
import time

from service.key_limits import UNLIMITED, KeyLease

log = logging.getLogger("clonecast.utterances")


class UtteranceReport:
    def __init__(
        self,
        metrics,
        transport: str,
        name: str,
        log_format: str = "plain",
        key: str | None = None,
        lease: KeyLease = UNLIMITED,
    ):
        """`name`: how the log names it (the session and utterance ids, or the HTTP id);
        `key`: the caller's key name; `lease`: its hold on that key's limits."""
        self.metrics, self.transport, self.name = metrics, transport, name
        self.log_format = log_format
        self.key, self.lease = key, lease
        self.ended = False

    def audio_sent(self, utt, audio_bytes: int, wire_bytes: int) -> None:
        """`audio_bytes` of audio (a WAV header excluded) just left for the client."""
        if not audio_bytes:
            return
        now, stats, m, t = time.monotonic(), utt.stats, self.metrics, self.transport
        if stats.first_audio is None:
            stats.first_audio = now
            m.first_audio.labels(t).observe(now - stats.started)
        else:
            lead = stats.audio_s - (now - stats.first_audio - stats.stalled_s)
            m.chunk_lead.labels(t).observe(lead)
            if lead < 0:
                stats.underruns += 1
                stats.stalled_s -= lead
                m.underruns.labels(t).inc()
                m.underrun_seconds.labels(t).inc(-lead)
        seconds = audio_bytes / utt.format.bytes_per_sample / utt.format.sample_rate
        stats.audio_s += seconds
        stats.chunks += 1
        stats.bytes += wire_bytes
        m.audio_seconds.labels(t).inc(seconds)
        if self.key is not None:
            m.key_audio_seconds.labels(self.key).inc(seconds)
        self.lease.add_audio(seconds)

    def done(self, utt) -> dict:
        """The utterance was heard to its end: its `done` stats."""
        stats = utt.stats.as_dict(len(utt.segments))
        self.metrics.e2e.labels(self.transport).observe(stats["elapsed_s"])
        if stats["rtf"] is not None:
            self.metrics.rtf.labels(self.transport).observe(stats["rtf"])
        self._end(utt, utt.finish_reason, None, stats)
        return stats

    def stopped(self, utt, outcome: str, code: str | None = None) -> None:
        """Cancelled by the client ("cancelled"), its client gone ("disconnected") or failed
        ("error", with the error's code)."""
        self._end(utt, outcome, code, utt.stats.as_dict(len(utt.segments)))

    def _end(self, utt, outcome: str, code: str | None, stats: dict) -> None:
        if self.ended:
            return
        self.ended = True
        self.metrics.requests.labels(outcome, self.transport).inc()
        fields = {
            "utterance": self.name,
            "transport": self.transport,
            "key": self.key,
            "voice": utt.voice_id,
            "segments": stats["segments"],
            "first_audio_ms": stats["first_audio_ms"],
            "audio_s": stats["audio_s"],
            "rtf": stats["rtf"],
            "outcome": outcome,
            "code": code,
        }
        if self.log_format == "json":
            log.info(json.dumps(fields))
        else:  # values JSON-quoted: a client's id cannot forge a line or a field
            log.info(" ".join(f"{k}={json.dumps(v)}" for k, v in fields.items() if v is not None))
