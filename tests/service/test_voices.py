"""Reference voices over the WebSocket (voice.create, binary voice.upload, inline `voice`) and
over HTTP (`/v1/voices`), sharing one content-addressed store; unusable recordings are
rejected with their stable codes."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from .conftest import (
    FRAME_BYTES,
    assert_alive,
    b64,
    check_complete,
    collect,
    expect_error,
    frames_for,
    open_ws,
    recv_json,
    reference_audio,
    run,
    scrape,
    speak,
)

UPLOAD_LIMIT = 400_000


@pytest.fixture(scope="module")
def vs(make_server):
    return make_server(max_upload_bytes=UPLOAD_LIMIT)


def _wav(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_ws_voice_create_speak_and_cache(vs):
    flac = reference_audio(2.0, "FLAC", f0=140.0)
    create = {"type": "voice.create", "audio_b64": b64(flac), "transcript": "A tone."}

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(json.dumps({**create, "request_id": "c-1"}))
            created = await recv_json(ws, timeout=60)
            await ws.send(speak("v", dur=1.0, seed=1, voice_id=created.get("voice_id")))
            u = (await collect(ws, ["v"]))["v"]
            await ws.send(json.dumps({**create, "request_id": "c-2"}))
            again = await recv_json(ws)
            return created, u, again

    created, u, again = run(main())
    assert created["type"] == "voice.created", created
    assert created["voice_id"].startswith("v_")
    assert created["frames"] == 50 and created["duration_s"] == 2.0
    assert created["cached"] is False and created["request_id"] == "c-1"
    check_complete(u)
    assert u.done["reason"] == "length" and len(u.payload) == frames_for(1.0) * FRAME_BYTES
    assert again["type"] == "voice.created"
    assert again["voice_id"] == created["voice_id"] and again["frames"] == 50
    assert again["cached"] is True and again["request_id"] == "c-2"
    # the voice is visible over HTTP too
    r = httpx.get(f"{vs.http}/v1/voices/{created['voice_id']}", timeout=30)
    assert r.status_code == 200 and r.json()["transcript"] == "A tone."


def test_ws_binary_voice_upload(vs):
    wav = reference_audio(1.5, "WAV", f0=180.0)

    async def main():
        async with open_ws(vs.ws) as ws:
            announce = {"type": "voice.upload", "bytes": len(wav), "request_id": "u-1"}
            await ws.send(json.dumps(announce))
            await ws.send(wav)
            created = await recv_json(ws, timeout=60)
            await ws.send(speak("b", dur=1.0, seed=2, voice_id=created.get("voice_id")))
            u = (await collect(ws, ["b"]))["b"]
            return created, u

    created, u = run(main())
    assert created["type"] == "voice.created", created
    assert created["request_id"] == "u-1" and created["cached"] is False
    assert created["frames"] == 38  # 1.5 s: 37.5 frames, rounded to whole frames
    check_complete(u)


def test_ws_inline_voice_in_speak(vs):
    wav = reference_audio(1.5, "WAV", f0=210.0)
    inline = {"audio_b64": b64(wav), "transcript": "Inline."}

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(speak("i", dur=1.0, seed=3, voice=inline))
            u = (await collect(ws, ["i"]))["i"]
            await assert_alive(ws)
            return u

    u = run(main())
    check_complete(u)
    assert u.started["segments"] == 1
    assert u.done["reason"] == "length" and len(u.payload) == frames_for(1.0) * FRAME_BYTES


def test_ws_inline_voice_that_cannot_be_decoded(vs):
    bad = {"audio_b64": b64(b"garbage, not audio " * 20)}

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(speak("ib", dur=1.0, seed=4, voice=bad))
            u = (await collect(ws, ["ib"]))["ib"]
            await ws.send(speak("ib", dur=1.0, seed=4, voice="not an object"))
            u2 = (await collect(ws, ["ib"]))["ib"]
            await ws.send(speak("ib", dur=1.0, seed=4))  # the id was released
            ok = (await collect(ws, ["ib"]))["ib"]
            return u, u2, ok

    u, u2, ok = run(main())
    assert [(e["code"], e["id"]) for e in u.errors] == [("audio_undecodable", "ib")]
    assert u.frames == [] and u.done is None
    assert [e["code"] for e in u2.errors] == ["bad_request"]
    check_complete(ok)


def _rejections() -> dict[str, tuple[bytes, str]]:
    t = np.arange(24000) / 24000
    return {
        "too-short": (reference_audio(0.3, "WAV"), "audio_too_short"),
        "silent": (_wav(np.zeros(24000), 24000), "audio_silent"),
        "clipped": (_wav(np.sign(np.sin(2 * np.pi * 200 * t)), 24000), "audio_clipped"),
        "too-long": (reference_audio(31.0, "FLAC", rate=8000), "audio_too_long"),
        "undecodable": (b"RIFF\x00\x00\x00\x00WAVEjunk" * 10, "audio_undecodable"),
    }


@pytest.mark.parametrize("name", list(_rejections()))
def test_ws_unusable_reference_recordings(vs, name):
    data, code = _rejections()[name]
    assert len(data) < UPLOAD_LIMIT

    async def main():
        async with open_ws(vs.ws) as ws:
            message = {"type": "voice.create", "audio_b64": b64(data), "request_id": name}
            await ws.send(json.dumps(message))
            err = await expect_error(ws, code, timeout=60)
            await assert_alive(ws)
            return err

    assert run(main())["request_id"] == name


@pytest.mark.parametrize("name", ["silent", "undecodable"])
def test_http_unusable_reference_recordings(vs, name):
    data, code = _rejections()[name]
    r = httpx.post(vs.http + "/v1/voices", content=data, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == code


def test_ws_upload_over_the_limit(vs):
    big = base64.b64encode(b"\x00" * (UPLOAD_LIMIT + 1000)).decode()

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(json.dumps({"type": "voice.create", "audio_b64": big}))
            await expect_error(ws, "message_too_large")
            await assert_alive(ws)

    run(main())


def test_http_voice_lifecycle(vs):
    raw = reference_audio(2.0, "WAV", f0=120.0)
    other = reference_audio(1.5, "FLAC", f0=260.0)
    encodes = scrape(vs)["clonecast_voice_cache_misses_total"]
    url = vs.http + "/v1/voices"
    r = httpx.post(url + "?transcript=Raw%20body.", content=raw, timeout=60)
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["voice_id"].startswith("v_") and first["cached"] is False
    assert first["frames"] == 50 and first["duration_s"] == 2.0
    assert first["transcript"] == "Raw body."
    r = httpx.post(url + "?transcript=Raw%20body.", content=raw, timeout=60)
    assert r.status_code == 200 and r.json()["cached"] is True
    assert r.json()["voice_id"] == first["voice_id"]
    assert scrape(vs)["clonecast_voice_cache_misses_total"] == encodes + 1
    r = httpx.post(url, json={"audio_b64": b64(other), "transcript": "Json."}, timeout=60)
    assert r.status_code == 201, r.text
    second = r.json()
    assert second["frames"] == 38 and second["voice_id"] != first["voice_id"]
    listed = httpx.get(url, timeout=30).json()["voices"]
    ids = {v["voice_id"] for v in listed}
    assert {first["voice_id"], second["voice_id"]} <= ids
    r = httpx.get(f"{url}/{second['voice_id']}", timeout=30)
    assert r.status_code == 200
    assert r.json()["voice_id"] == second["voice_id"] and r.json()["transcript"] == "Json."
    # usable from the speech endpoint and from a WebSocket
    body = {"input": "Cloned.", "voice": first["voice_id"], "response_format": "pcm"}
    r = httpx.post(
        vs.http + "/v1/audio/speech", json={**body, "max_duration_s": 1, "seed": 1}, timeout=60
    )
    assert r.status_code == 200 and len(r.content) == frames_for(1.0) * FRAME_BYTES

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(speak("h", dur=1.0, seed=5, voice_id=second["voice_id"]))
            return (await collect(ws, ["h"]))["h"]

    check_complete(run(main()))
    r = httpx.delete(f"{url}/{second['voice_id']}", timeout=30)
    assert r.status_code == 204 and r.content == b""
    r = httpx.get(f"{url}/{second['voice_id']}", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_voice"
    r = httpx.delete(f"{url}/{second['voice_id']}", timeout=30)
    assert r.status_code == 404
    assert second["voice_id"] not in {v["voice_id"] for v in httpx.get(url).json()["voices"]}


def test_same_recording_over_http_and_ws_is_one_voice(vs):
    raw = reference_audio(1.5, "WAV", f0=300.0)
    r = httpx.post(vs.http + "/v1/voices", content=raw, timeout=60)
    assert r.status_code == 201

    async def main():
        async with open_ws(vs.ws) as ws:
            await ws.send(json.dumps({"type": "voice.create", "audio_b64": b64(raw)}))
            return await recv_json(ws)

    created = run(main())
    assert created["voice_id"] == r.json()["voice_id"] and created["cached"] is True


def test_http_bad_json_voice(vs):
    for body in ({"audio_b64": "***"}, {"transcript": "no audio"}):
        r = httpx.post(vs.http + "/v1/voices", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_http_upload_too_large_is_413(vs):
    url = vs.http + "/v1/voices"
    # over the limit by the Content-Length alone
    r = httpx.post(url, content=b"\x00" * (UPLOAD_LIMIT * 2), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large"
    # just over the limit: measured after reading
    r = httpx.post(url, content=b"\x00" * (UPLOAD_LIMIT + 1), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large"
    big = base64.b64encode(b"\x00" * (UPLOAD_LIMIT + 10)).decode()
    r = httpx.post(url, json={"audio_b64": big}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large"
