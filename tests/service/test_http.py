"""The HTTP API over a real socket: health, readiness, Prometheus metrics and the
OpenAI-style `POST /v1/audio/speech` (whole and streamed bodies, formats, errors)."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from .conftest import (
    FRAME_BYTES,
    FRAME_SAMPLES,
    collect,
    frames_for,
    open_ws,
    recv_until,
    run,
    scrape,
    speak,
    summed,
    wait_engine_idle,
)

PCM_1S = frames_for(1.0) * FRAME_BYTES  # 48,000 bytes: 25 frames of PCM16 at 24 kHz


def _speech(server, **body):
    body = {"input": "Hello from the HTTP API.", "max_duration_s": 1, "seed": 1, **body}
    return httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60)


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    return err


def test_health(server):
    r = httpx.get(server.http + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_ready_reports_the_untrained_model(server):
    r = httpx.get(server.http + "/ready", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ready"
    assert body["model"]["untrained"] is True
    assert "random weights" in body["model"]["notice"]


def test_ready_shows_the_execution_plan(server):
    """How the engine runs on its device, resolved at start: on the CPU the torch path."""
    plan = httpx.get(server.http + "/ready", timeout=30).json()["plan"]
    assert plan["attention_backend"] == "torch" and plan["fused_ops"] is False
    assert plan["cuda_graphs"] is False and plan["codec_graph_max_batch"] == 0
    assert plan["graph_buckets"][0] == 1 and plan["async_scheduling"] is True


GAUGES = [
    "clonecast_num_requests_running",
    "clonecast_num_requests_waiting",
    "clonecast_kv_cache_usage_perc",
    "clonecast_kv_cache_free_blocks",
    "clonecast_websocket_connections",
    "clonecast_engine_up",
]


def test_metrics_exposition(server):
    r = httpx.get(server.http + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for transport in ("websocket", "http"):  # 0.32 s is a bucket edge: SLO ratios are exact
        edge = f'clonecast_time_to_first_audio_seconds_bucket{{le="0.32",transport="{transport}"}}'
        assert edge in text
    for kind in ("prefill", "decode", "mixed", "readback"):  # 40 ms: a frame's budget
        assert f'clonecast_engine_step_seconds_bucket{{engine="0",kind="{kind}",le="0.04"}}' in text
    for name in GAUGES:
        assert f"# TYPE {name} gauge" in text
    for name in ("clonecast_graph_capture_memory_bytes", "clonecast_graph_capture_seconds"):
        assert f"# TYPE {name} gauge" in text
    for name in (
        "clonecast_e2e_request_latency_seconds",
        "clonecast_real_time_factor",
        "clonecast_time_to_first_audio_seconds",
        "clonecast_chunk_lead_seconds",
        "clonecast_queue_time_seconds",
        "clonecast_engine_step_seconds",
        "clonecast_engine_batch_size",
        "clonecast_codec_batch_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
    for name in (
        "clonecast_audio_seconds",
        "clonecast_underruns",
        "clonecast_underrun_seconds",
        "clonecast_request_success",
        "clonecast_errors",
        "clonecast_websocket_closes",
        "clonecast_prefill_tokens",
        "clonecast_prefix_cache_hit_tokens",
        "clonecast_preemptions",
        "clonecast_voice_cache_hits",
        "clonecast_voice_cache_misses",
        "clonecast_codec_windows",
        "clonecast_engine_rows",
    ):
        assert f"# TYPE {name}_total counter" in text
    m = scrape(server)
    total = server.services.worker.stats.num_kv_blocks
    assert summed(m, "clonecast_kv_cache_free_blocks") == total
    assert summed(m, "clonecast_kv_cache_usage_perc") == 0
    assert summed(m, "clonecast_num_requests_running") == 0


def test_metrics_count_a_websocket_utterance(server):
    before = scrape(server)

    async def main():
        async with open_ws(server.ws) as ws:
            mid = scrape(server)
            await ws.send(speak("m", dur=1.0, seed=2))
            u = (await collect(ws, ["m"]))["m"]
            return mid, u

    mid, u = run(main())
    after = scrape(server)
    assert mid["clonecast_websocket_connections"] == before["clonecast_websocket_connections"] + 1
    ws = '{transport="websocket"}'
    first = "clonecast_time_to_first_audio_seconds_count" + ws
    assert after[first] == before[first] + 1
    e2e = "clonecast_e2e_request_latency_seconds_count" + ws
    assert after[e2e] == before[e2e] + 1
    audio = "clonecast_audio_seconds_total" + ws
    assert after[audio] == pytest.approx(before[audio] + u.done["stats"]["audio_s"], abs=1e-3)
    key = 'clonecast_request_success_total{finished_reason="length",transport="websocket"}'
    assert after[key] == before.get(key, 0) + 1
    steps = "clonecast_engine_step_seconds_count"
    assert summed(after, steps) > summed(before, steps)
    # 1 s of audio: 25 frames + the 8-row ramp, every row counted once
    assert after["clonecast_engine_rows_total"] - before["clonecast_engine_rows_total"] >= 25
    # the host time inside steps, by phase, grows with them and stays within the steps' time
    grown = {}
    for phase in ("schedule", "launch", "audio", "gpu_wait", "rows"):
        key = f'clonecast_engine_phase_seconds_total{{phase="{phase}"}}'
        grown[phase] = after[key] - before.get(key, 0.0)
        assert grown[phase] >= 0
    assert grown["launch"] > 0 and grown["rows"] > 0
    step_sum = "clonecast_engine_step_seconds_sum"
    in_steps = summed(after, step_sum) - summed(before, step_sum)
    assert sum(grown.values()) <= in_steps * 1.01 + 1e-3


def test_speech_wav_is_a_complete_file(server):
    r = _speech(server)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    body = r.content
    assert len(body) == 44 + PCM_1S
    riff, data_size = struct.unpack("<I", body[4:8])[0], struct.unpack("<I", body[40:44])[0]
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt " and body[36:40] == b"data"
    assert (riff, data_size) == (36 + PCM_1S, PCM_1S)
    x, rate = sf.read(io.BytesIO(body), dtype="int16")
    assert rate == 24000 and len(x) == frames_for(1.0) * FRAME_SAMPLES


def test_speech_is_the_same_audio_as_the_websocket(server):
    r = _speech(server, response_format="pcm", seed=9, input="Same words.")

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("same", "Same words.", dur=1.0, seed=9))
            return (await collect(ws, ["same"]))["same"]

    assert r.content == run(main()).payload


def test_speech_streamed_pcm(server):
    body = {
        "input": "Streaming over HTTP.",
        "response_format": "pcm",
        "stream": True,
        "max_duration_s": 3,
        "seed": 3,
    }
    with httpx.stream("POST", server.http + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "audio/pcm"
        assert r.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in r.headers
        parts = [p for p in r.iter_raw() if p]
    data = b"".join(parts)
    assert len(data) == frames_for(3.0) * FRAME_BYTES
    assert len(parts) >= 2  # sent as generated, not in one piece


def test_speech_streamed_wav_has_streaming_header(server):
    with httpx.stream(
        "POST",
        server.http + "/v1/audio/speech",
        json={"input": "Hi.", "stream": True, "max_duration_s": 1, "seed": 4},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        data = r.read()
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert len(data) == 44 + PCM_1S


@pytest.mark.parametrize(
    "fmt, extra, media, size",
    [
        ("mulaw", {}, "audio/basic", frames_for(1.0) * 320),
        ("mulaw", {"sample_rate": 16000}, "audio/basic", frames_for(1.0) * 640),
        ("f32", {}, "audio/x-f32le", frames_for(1.0) * FRAME_SAMPLES * 4),
        ("pcm16", {"sample_rate": 48000}, "audio/pcm", frames_for(1.0) * FRAME_BYTES * 2),
    ],
    ids=["mulaw-8k", "mulaw-16k", "f32", "pcm-48k"],
)
def test_speech_formats(server, fmt, extra, media, size):
    r = _speech(server, response_format=fmt, **extra)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == media
    assert abs(len(r.content) - size) <= 2 * (size // (frames_for(1.0) * FRAME_SAMPLES) or 1)
    if fmt == "f32":
        x = np.frombuffer(r.content, "<f4")
        assert np.all(np.isfinite(x)) and np.max(np.abs(x)) <= 1.0


def test_speech_bad_json(server):
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(
            server.http + "/v1/audio/speech",
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        _error(r, 400, "bad_json")


@pytest.mark.parametrize("body", [{"input": ""}, {"input": "   "}])
def test_speech_empty_input(server, body):
    r = httpx.post(server.http + "/v1/audio/speech", json=body, timeout=30)
    _error(r, 400, "empty_text")


@pytest.mark.parametrize("body", [{}, {"input": 5}, {"input": ["a"]}])
def test_speech_missing_or_mistyped_input(server, body):
    r = httpx.post(server.http + "/v1/audio/speech", json=body, timeout=30)
    _error(r, 400, "bad_request")


def test_speech_text_too_long(server):
    _error(_speech(server, input="a" * 5001), 400, "text_too_long")


def test_speech_unknown_voice(server):
    _error(_speech(server, voice="v_0123456789abcdef0123"), 404, "unknown_voice")


@pytest.mark.parametrize(
    "body",
    [
        {"speed": 2.0},
        {"speed": 0.5},
        {"response_format": "aac"},
        {"response_format": "opus", "sample_rate": 22050},
        {"sample_rate": 11025},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
    ],
    ids=["speed-2", "speed-0.5", "aac", "opus-rate", "rate", "temperature", "top_p", "top_k"],
)
def test_speech_bad_parameter(server, body):
    _error(_speech(server, **body), 400, "bad_parameter")


def test_speech_default_voice_name_and_speed_one(server):
    r = _speech(server, voice="default", speed=1.0, response_format="pcm")
    assert r.status_code == 200 and len(r.content) == PCM_1S


def test_streamed_speech_client_that_goes_away_frees_the_engine(server):
    body = {"input": "A long stream.", "response_format": "pcm", "stream": True}
    with httpx.stream(
        "POST",
        server.http + "/v1/audio/speech",
        json={**body, "max_duration_s": 30, "seed": 5},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # kept referenced: dropping it would close the stream
        assert next(chunks)
        assert summed(scrape(server), "clonecast_num_requests_running") == 1
    wait_engine_idle(server, timeout=10)


def test_the_javascript_sdk_is_served_and_nothing_else_of_web(server):
    """/clonecast.js is the SDK file itself (the demo page loads this one copy), typed as
    JavaScript and revalidated; Node's packages, the tests and the npm manifest are not
    served; unknown paths stay JSON 404s."""
    root = Path(__file__).resolve().parents[2]
    r = httpx.get(server.http + "/clonecast.js", timeout=30)
    assert r.status_code == 200 and r.content == (root / "web" / "clonecast.js").read_bytes()
    assert r.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
    assert (
        r.headers["cache-control"] == "no-cache"
        and r.headers["x-content-type-options"] == "nosniff"
    )
    for hidden in ("/package.json", "/node_modules/ws/package.json", "/test/sdk.test.mjs"):
        r = httpx.get(server.http + hidden, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", hidden


def test_metrics_count_http_speech_too(server):
    """HTTP speech requests reach the same series as WebSocket utterances, under their own
    transport label: first audio, end to end, audio seconds, outcome."""
    before = scrape(server)
    r = _speech(server, response_format="pcm", seed=5, input="Counted over HTTP.")
    assert r.status_code == 200
    after = scrape(server)
    http = '{transport="http"}'
    for name in ("time_to_first_audio_seconds_count", "e2e_request_latency_seconds_count"):
        key = f"clonecast_{name}{http}"
        assert after[key] == before[key] + 1, name
    audio = f"clonecast_audio_seconds_total{http}"
    assert after[audio] == pytest.approx(before[audio] + len(r.content) / 48000, abs=1e-3)
    key = 'clonecast_request_success_total{finished_reason="length",transport="http"}'
    assert after[key] == before.get(key, 0) + 1
    ws = 'clonecast_time_to_first_audio_seconds_count{transport="websocket"}'
    assert after[ws] == before[ws]  # nothing counted twice


def test_one_log_line_per_utterance_without_its_text(server, caplog):
    """Each ended utterance logs one line (ids, transport, voice, segments, first audio, audio
    seconds, real-time factor, outcome); never the text it spoke."""
    import json as json_module
    import logging

    caplog.set_level(logging.INFO, logger="clonecast.utterances")

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("logged", "A secret sentence.", dur=0.4, seed=2))
            await collect(ws, ["logged"])
            await ws.send(speak("gone", "Another one.", dur=20, seed=3))
            await recv_until(ws, "audio", id="gone")
            await ws.send(json_module.dumps({"type": "cancel", "id": "gone"}))
            await recv_until(ws, "cancelled", id="gone")

    run(main())
    assert _speech(server, response_format="pcm", seed=1, input="Secret too.").status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "clonecast.utterances"]
    assert len(lines) == 3, lines
    done, cancelled, http = lines
    assert 'transport="websocket"' in done and 'outcome="length"' in done
    assert '/logged"' in done and "first_audio_ms=" in done and "audio_s=0.4" in done
    assert 'outcome="cancelled"' in cancelled and '/gone"' in cancelled
    assert 'transport="http"' in http and 'outcome="length"' in http
    assert not any("ecret" in line or "Another" in line for line in lines)


def test_speech_whose_engine_died_before_it_started_is_503_not_ready(server, monkeypatch):
    """The engine picked for the request is dead by the time its utterance starts and none
    is ready: 503 not_ready (retry later), as when no engine was ready at all."""
    from types import SimpleNamespace

    # a dead client still checks text (in this process); it can no longer submit
    dead = SimpleNamespace(alive=False, check_text=server.services.worker.check_text)
    picks = iter([dead])
    monkeypatch.setattr(server.services.engines, "pick", lambda voice: next(picks, None))
    body = {"input": "Too late.", "response_format": "pcm", "max_duration_s": 0.4, "seed": 1}
    r = httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert "no engine is ready" in r.json()["error"]["message"]
