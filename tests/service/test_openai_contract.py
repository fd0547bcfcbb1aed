"""The OpenAI `audio.speech` contract, driven by the official `openai` package, unmodified,
pointed at a real server with `base_url`: the served model listed, speech in every format
(decoded back and checked for its duration), streaming with `with_streaming_response`, SSE
events, OpenAI's voice object, and bad input raised as the package's own exceptions, each
naming the field."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from .conftest import b64, reference_audio


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    [served] = client.models.list().data
    assert served.object == "model" and served.owned_by == "clonecast"
    return served.id


def _speak(client, model, **extra):
    body = {"max_duration_s": 1.0, "seed": 3, **extra.pop("extra_body", {})}
    return client.audio.speech.create(
        model=model, voice="default", input="Hello from the OpenAI client.", extra_body=body,
        **extra,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_every_container_decodes_to_the_asked_duration(client, model, fmt):
    """1 s asked: 25 frames of 40 ms. The lossy codecs may pad their frames (MP3 adds its
    encoder delay), so within 0.1 s."""
    audio = _speak(client, model, response_format=fmt).content
    x, rate = sf.read(io.BytesIO(audio), dtype="float32")
    assert rate == 24000
    tolerance = 0 if fmt in ("wav", "flac") else int(0.1 * rate)
    assert abs(len(x) - 24000) <= tolerance, (fmt, len(x))
    assert np.abs(x).max() > 0.001  # not silence


def test_pcm_is_raw_24k_pcm16_and_flac_holds_the_same_samples(client, model):
    pcm = _speak(client, model, response_format="pcm").content
    assert len(pcm) == 48000
    flac = _speak(client, model, response_format="flac").content
    x, _ = sf.read(io.BytesIO(flac), dtype="int16")
    assert np.array_equal(x, np.frombuffer(pcm, "<i2"))  # same seed, lossless


def test_streaming_response_carries_the_audio_as_it_is_made(client, model):
    """`with_streaming_response` and OpenAI's stream_format "audio": the body is sent as it
    is made (chunked, no length known up front) and, concatenated, is a decodable Opus file
    of the asked length."""
    pieces = []
    with client.audio.speech.with_streaming_response.create(
        model=model,
        voice="default",
        input="Streamed through the OpenAI client.",
        response_format="opus",
        stream_format="audio",
        extra_body={"max_duration_s": 2.0, "seed": 4},
    ) as response:
        assert response.headers["content-type"] == "audio/ogg"
        assert response.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in response.headers
        for piece in response.iter_bytes(1024):
            pieces.append(piece)
    x, rate = sf.read(io.BytesIO(b"".join(pieces)), dtype="float32")
    assert rate == 24000 and abs(len(x) - 48000) <= 2400


def test_sse_events_are_openais(server, model):
    """stream_format "sse": `speech.audio.delta` events (base64 of the response format's
    bytes) then one `speech.audio.done`; the deltas joined are the PCM of the same request
    (seeded: unseeded sampling may end either one early, at the end-of-speech token)."""
    body = {
        "model": model, "input": "Events.", "response_format": "pcm", "max_duration_s": 1,
        "seed": 5,
    }  # fmt: skip
    with httpx.stream(
        "POST", server.http + "/v1/audio/speech", json={**body, "stream_format": "sse"},
        timeout=60,
    ) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    deltas = [e for e in events[:-1] if e["type"] == "speech.audio.delta"]
    assert len(deltas) == len(events) - 1 >= 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    whole = httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60).content
    assert len(audio) == 48000 and audio == whole


def test_openais_voice_object_names_a_created_voice(server, client, model):
    voice = httpx.post(
        server.http + "/v1/voices", json={"audio_b64": b64(reference_audio(2.0))}, timeout=60
    ).json()["voice_id"]
    cloned = _speak(client, model, response_format="pcm", extra_body={"voice": {"id": voice}})
    plain = _speak(client, model, response_format="pcm")
    assert len(cloned.content) == len(plain.content) == 48000
    assert cloned.content != plain.content  # the reference changed the speech


@pytest.mark.parametrize(
    ("kwargs", "code", "named"),
    [
        ({"instructions": "Speak cheerfully."}, "bad_parameter", "instructions"),
        ({"extra_body": {"repetition_penalty": 1.1}}, "unknown_field", "repetition_penalty"),
        ({"response_format": "aac"}, "bad_parameter", "aac"),
        ({"speed": 1.5}, "bad_parameter", "speed"),
        ({"stream_format": "chunks"}, "bad_parameter", "stream_format"),
    ],
    ids=["instructions", "unknown-field", "aac", "speed", "stream-format"],
)
def test_refusals_are_the_clients_exceptions_and_name_the_field(client, model, kwargs, code, named):
    with pytest.raises(openai.BadRequestError) as caught:
        _speak(client, model, **kwargs)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["code"] == code and named in error["message"]


def test_another_model_is_refused_naming_the_served_one(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="tts-1", voice="default", input="Hello.")
    assert caught.value.body["code"] == "unknown_model"
    assert model in caught.value.body["message"] and "tts-1" in caught.value.body["message"]
