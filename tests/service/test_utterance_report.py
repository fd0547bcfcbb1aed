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
