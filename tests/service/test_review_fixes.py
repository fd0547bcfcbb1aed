"""Regression tests for defects found in review: bad field types get their documented
errors (never a dropped socket or a hung utterance), timelines continue across segments,
and a cancelled HTTP wait never reaches the engine thread."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.service.conftest import (
    assert_alive,
    b64,
    collect,
    expect_error,
    open_ws,
    recv_until,
    reference_audio,
    run,
    speak,
    wait_engine_idle,
)


@pytest.mark.parametrize(
    "message, code",
    [
        (speak("v", voice_id=[]), "bad_request"),
        (speak("o", output={"sample_rate": 8000.0}), "bad_parameter"),
        (speak("s", params={"seed": 1.5}), "bad_parameter"),
        (speak("t", params={"top_k": 10**30}), "bad_parameter"),
        (speak("u", params={"temperature": 1e300}), "bad_parameter"),
        (speak("x", text="say <|audio|> now"), "bad_request"),
        (
            json.dumps(
                {"type": "voice.create", "audio_b64": "AAAA", "transcript": 5, "request_id": "r"}
            ),
            "bad_request",
        ),
    ],
)
def test_bad_field_types_get_their_error_and_the_socket_lives(server, message, code):
    async def go():
        async with open_ws(server.ws) as ws:
            await ws.send(message)
            await expect_error(ws, code)
            await assert_alive(ws)

    run(go())


def test_inline_voice_with_a_bad_transcript_fails_and_frees_its_id(server):
    async def go():
        async with open_ws(server.ws) as ws:
            voice = {"audio_b64": b64(reference_audio(1.5)), "transcript": 5}
            await ws.send(speak("iv", voice=voice))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "bad_request" and error["id"] == "iv"
            await ws.send(speak("iv", dur=0.5))  # the id is free again
            utts = await collect(ws, ["iv"])
            assert utts["iv"].done is not None

    run(go())


def test_timeline_continues_across_segments(make_server):
    server = make_server(max_segment_chars=20)

    async def go():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("seg", text="One two three. Four five six. Seven eight.", dur=0.6))
            utts = await collect(ws, ["seg"])
            timed = [h for h in utts["seg"].headers if h["bytes"]]
            assert utts["seg"].done["stats"]["segments"] == 3
            assert timed[0]["start_ms"] == 0
            for a, b in zip(timed, timed[1:], strict=False):
                assert b["start_ms"] == a["end_ms"]

    run(go())


@pytest.mark.parametrize(
    "body, code",
    [
        ({"input": "hi", "response_format": []}, "bad_parameter"),
        ({"input": "hi", "voice": []}, "bad_request"),
        ({"input": "hi", "sample_rate": 16000.0}, "bad_parameter"),
        ({"input": "say <|audio|> now"}, "bad_request"),
        ({"input": "hi", "max_duration_s": 0}, "bad_parameter"),
        ({"input": "hi", "seed": True}, "bad_parameter"),
    ],
)
def test_http_speech_rejects_bad_fields_with_400(server, body, code):
    r = httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_http_speech_rejects_infinite_duration(server):
    raw = b'{"input": "hi", "max_duration_s": 1e999}'
    r = httpx.post(
        server.http + "/v1/audio/speech",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_parameter"


def test_http_voice_with_a_bad_transcript_is_400(server):
    body = {"audio_b64": b64(reference_audio(1.5)), "transcript": ["no"]}
    r = httpx.post(server.http + "/v1/voices", json=body, timeout=60)
    assert r.status_code == 400


def test_a_cancelled_wait_never_starts_the_request_and_the_engine_thread_lives(make_server):
    server = make_server(engine_process=False)  # the engine thread in the server's process
    worker = server.services.worker
    from engine import SamplingParams

    # Cancel futures before the engine thread takes their command (retry until one was
    # cancelled in time: that is the path that used to kill the engine thread).
    cancelled = 0
    for i in range(200):
        future = worker.submit(
            f"cancelled-wait-{i}", "never", None, SamplingParams(max_rows=4), lambda out: None
        )
        cancelled += future.cancel()
        if cancelled:
            break
    assert cancelled, "no cancel happened before the engine thread took the command"
    wait_engine_idle(server)
    assert not any(
        r.startswith("cancelled-wait") for r in server.services.engine.scheduler.requests
    )
    r = httpx.post(
        server.http + "/v1/audio/speech",
        json={"input": "still alive", "max_duration_s": 0.4, "response_format": "pcm", "seed": 1},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.content) == 10 * 1920
