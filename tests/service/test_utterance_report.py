"""One utterance's report (service/utterance_report.py): its audio counted in its transport's
series, first audio and underruns measured as the audio leaves, one log line at its end, in
plain text or JSON, reported once however many ways it ends."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from service.audio_format import OutputFormat
from service.config import ServiceSettings
from service.metrics import Metrics
from service.utterance import Stats
from service.utterance_report import UtteranceReport


def _utterance():
    return SimpleNamespace(
        stats=Stats(),
        segments=[object(), object()],
        voice_id="v_abc",
        finish_reason="eos",
        format=OutputFormat(),
    )


def _value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_audio_and_the_end_are_counted_under_the_transport(caplog):
    caplog.set_level(logging.INFO, logger="clonecast.utterances")
    metrics, utt = Metrics(), _utterance()
    report = UtteranceReport(metrics, "http", "http-1", "json")
    report.audio_sent(utt, 15360, 15360)  # 320 ms
    report.audio_sent(utt, 48000, 48000)  # 1 s
    stats = report.done(utt)
    report.stopped(utt, "cancelled")  # an end after the end: nothing more
    assert stats["audio_s"] == pytest.approx(1.32) and stats["chunks"] == 2
    t = {"transport": "http"}
    assert _value(metrics, "clonecast_audio_seconds_total", **t) == pytest.approx(1.32)
    assert _value(metrics, "clonecast_time_to_first_audio_seconds_count", **t) == 1
    assert (
        _value(metrics, "clonecast_time_to_first_audio_seconds_count", transport="websocket") == 0
    )
    assert _value(metrics, "clonecast_request_success_total", finished_reason="eos", **t) == 1
    assert _value(metrics, "clonecast_request_success_total", finished_reason="cancelled", **t) == 0
    [line] = [r.getMessage() for r in caplog.records if r.name == "clonecast.utterances"]
    fields = json.loads(line)
    assert fields["utterance"] == "http-1" and fields["voice"] == "v_abc"
    assert fields["segments"] == 2 and fields["outcome"] == "eos" and fields["code"] is None


def test_a_failed_utterance_logs_its_code_and_a_late_chunk_is_an_underrun(caplog):
    caplog.set_level(logging.INFO, logger="clonecast.utterances")
    metrics, utt = Metrics(), _utterance()
    report = UtteranceReport(metrics, "websocket", 's_1/id "with" quotes\nnext', "plain")
    report.audio_sent(utt, 15360, 15360)
    utt.stats.first_audio -= 1.0  # the next chunk comes a second after the first: late
    report.audio_sent(utt, 48000, 48000)
    report.stopped(utt, "error", "slow_consumer")
    assert utt.stats.underruns == 1
    assert _value(metrics, "clonecast_underruns_total", transport="websocket") == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "clonecast.utterances"]
    assert 'outcome="error"' in line and 'code="slow_consumer"' in line
    assert "\n" not in line and '\\"with\\"' in line and "\\n" in line  # no forged line


def test_the_log_format_setting_is_validated(monkeypatch):
    monkeypatch.setenv("CLONECAST_LOG_FORMAT", "json")
    assert ServiceSettings.from_env().log_format == "json"
    monkeypatch.setenv("CLONECAST_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="CLONECAST_LOG_FORMAT"):
        ServiceSettings.from_env()


def test_the_playhead_waits_when_dry_so_one_late_chunk_is_one_underrun(monkeypatch):
    """A player starts with the first audio and waits when it runs dry: the chunk after a
    late one is measured against the stalled playhead, not the original schedule."""
    now = [100.0]
    monkeypatch.setattr("service.utterance_report.time.monotonic", lambda: now[0])
    metrics, utt = Metrics(), _utterance()
    utt.stats.started = 99.95
    report = UtteranceReport(metrics, "websocket", "s_1/u")
    report.audio_sent(utt, 15360, 15360)  # 0.32 s at t = 0
    now[0] = 101.0  # 1 s later: the player ran dry 0.68 s ago
    report.audio_sent(utt, 48000, 48000)
    now[0] = 101.9  # the player resumed at 1.0 and has played 1.32 - 0.1 s of 1.32
    report.audio_sent(utt, 48000, 48000)
    t = {"transport": "websocket"}
    assert utt.stats.underruns == 1 and utt.stats.stalled_s == pytest.approx(0.68)
    assert _value(metrics, "clonecast_underruns_total", **t) == 1
    assert _value(metrics, "clonecast_underrun_seconds_total", **t) == pytest.approx(0.68)
    # two leads observed (the first chunk has none): -0.68 and +0.1
    assert _value(metrics, "clonecast_chunk_lead_seconds_count", **t) == 2
    # (with negative buckets prometheus-client exposes no _sum: quantiles come from buckets)
    assert _value(metrics, "clonecast_chunk_lead_seconds_bucket", le="-0.25", **t) == 1
    assert _value(metrics, "clonecast_chunk_lead_seconds_bucket", le="0.0", **t) == 1
    assert _value(metrics, "clonecast_chunk_lead_seconds_bucket", le="0.1", **t) == 2
    assert _value(metrics, "clonecast_time_to_first_audio_seconds_sum", **t) == pytest.approx(0.05)


def test_an_engine_total_counts_once_from_two_threads_and_again_after_a_restart():
    """Counters fed from the engine's running totals: a total seen twice adds nothing, an
    older snapshot arriving late (smaller) adds nothing either; a new engine's totals start
    at 0 once it is reset, and count from there."""
    from service.metrics import _Total

    metrics = Metrics()
    total = _Total(metrics.rows)
    for seen in (10, 10, 25, 25, 20):  # 20: a late snapshot, not a restart
        total.update(seen)
    assert _value(metrics, "clonecast_engine_rows_total") == 25
    total.reset()  # a new engine
    total.update(4)
    total.update(6)
    assert _value(metrics, "clonecast_engine_rows_total") == 31
