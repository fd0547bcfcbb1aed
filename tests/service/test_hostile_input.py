"""Input found by fuzzing the real server (a hostile or broken client): each gets its documented
error code, leaves no utterance or engine request behind, and costs the server no more than
a well-formed message. WebSocket and HTTP alike; one server with small limits."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import httpx
import pytest

from .conftest import (
    assert_alive,
    b64,
    exchange,
    expect_error,
    open_ws,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
    summed,
    wait_engine_idle,
)

SURROGATE = "\\ud800"  # a JSON escape that decodes to a lone UTF-16 surrogate
MAX_MESSAGE = 1024 * 1024  # nested-JSON frames of 200 KB fit: parsed, not refused by size
MAX_UPLOAD = 1024 * 1024


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(max_utterances=2, max_message_bytes=MAX_MESSAGE, max_upload_bytes=MAX_UPLOAD)


@pytest.mark.parametrize(
    "frame",
    [
        '{"type":"speak","id":"a","text":"hi ' + SURROGATE + ' there."}',
        '{"type":"speak","id":"' + SURROGATE + '","text":"hi."}',
        '{"type":"append","id":"b","text":"hi ' + SURROGATE + '. "}',
        '{"type":"voice.create","audio_b64":"AAAA","transcript":"\\udc00"}',
        "[" * 100_000 + "]" * 100_000,
        '{"type":"ping","x":' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"type":"speak","id":"a","text":"hi.","request_id":NaN}',
        '{"type":"speak","id":"a","text":"hi.","params":{"seed":Infinity}}',
    ],
    ids=["text", "id", "append", "transcript", "nested", "nested-in-ping", "nan", "infinity"],
)
def test_text_json_cannot_hold_is_bad_json(srv, frame):
    exchange(srv, frame, code="bad_json")


def test_rejected_text_leaves_no_utterance_behind(srv):
    """Refused speaks (more than max_utterances of them) never fill the connection, and the
    same id works afterwards; an append whose sentence the engine refuses ends its utterance
    with bad_request (as the same text in a speak), and more text for it is refused, not
    spoken by a new utterance; a speak may take its id."""

    async def main():
        async with open_ws(srv.ws) as ws:
            for _ in range(3):
                await ws.send('{"type":"speak","id":"a","text":"hi ' + SURROGATE + '."}')
                await expect_error(ws, "bad_json")
            for uid in ("c", "d", "e"):
                await ws.send(json.dumps({"type": "append", "id": uid, "text": "hi <|audio|>. "}))
                started, _ = await recv_until(ws, "started", id=uid)
                err = await expect_error(ws, "bad_request")
                assert err["id"] == uid
            late = {"type": "append", "id": "c", "text": "more. ", "request_id": "late"}
            await ws.send(json.dumps(late))
            err = await expect_error(ws, "unknown_id")
            assert "id" not in err and err["request_id"] == "late" and "(failed)" in err["message"]
            await ws.send(speak("c", dur=0.2))
            done, _ = await recv_until(ws, "done", timeout=120, id="c")
            await ws.send(speak("a", dur=0.2))
            done, _ = await recv_until(ws, "done", timeout=120, id="a")
            assert done["id"] == "a"

    run(main())
    wait_engine_idle(srv)


def test_the_engines_row_cap_is_not_a_protocol_parameter(srv):
    message = {"type": "speak", "id": "r", "text": "Hi.", "params": {"max_rows": 1}}
    err = exchange(srv, json.dumps(message), code="bad_parameter")
    assert "max_duration_s" in err["message"]


def test_upload_size_must_be_an_integer_not_a_boolean(srv):
    exchange(srv, json.dumps({"type": "voice.upload", "bytes": True}), code="bad_request")


def test_overlong_transcript_is_refused_before_any_work(srv):
    audio = b64(reference_audio(1.0))
    message = {"type": "voice.create", "audio_b64": audio, "transcript": "word " * 2000}
    err = exchange(srv, json.dumps(message), code="text_too_long")
    assert "4096" in err["message"]
    r = httpx.post(
        srv.http + "/v1/voices",
        json={"audio_b64": audio, "transcript": "word " * 2000},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "text_too_long", r.text


def test_a_sample_rate_too_costly_to_resample_is_refused_at_once(srv):
    """7,907 Hz (prime) would need a 190-million-tap resampling filter: gigabytes and
    seconds for a 0.6 s file. It is refused as audio_invalid in well under a second."""
    message = {"type": "voice.create", "audio_b64": b64(reference_audio(0.8, rate=7907))}
    start = time.monotonic()
    err = exchange(srv, json.dumps(message), code="audio_invalid")
    assert "7907 Hz" in err["message"] and time.monotonic() - start < 5
    message["audio_b64"] = b64(reference_audio(0.8, rate=44100))  # 147:80: fine

    async def ok():
        async with open_ws(srv.ws) as ws:
            await ws.send(json.dumps(message))
            created, _ = await recv_until(ws, "voice.created", timeout=60)
            assert created["voice_id"]

    run(ok())


@pytest.mark.parametrize(
    "path, content",
    [
        ("/v1/audio/speech", '{"input":"hi ' + SURROGATE + '."}'),
        ("/v1/audio/speech", "[" * 100_000 + "]" * 100_000),
        ("/v1/audio/speech", '{"input":"hi.","seed":NaN}'),
        ("/v1/voices", '{"audio_b64":"AAAA","transcript":"\\udc00"}'),
        ("/v1/voices", "[" * 100_000 + "]" * 100_000),
    ],
    ids=["speech-surrogate", "speech-nested", "speech-nan", "voice-surrogate", "voice-nested"],
)
def test_http_json_it_cannot_hold_is_bad_json(srv, path, content):
    r = httpx.post(
        srv.http + path, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/voices"])
def test_http_bodies_over_the_limit_are_refused_chunked_or_not(srv, path):
    """A chunked body announces no length: it is counted as it arrives and refused once over
    the limit (max_message_bytes for speech, the upload limit for voices), not read whole."""
    limit = MAX_MESSAGE if path.endswith("speech") else MAX_UPLOAD * 4 // 3 + 4096

    def chunks():
        sent = 0
        while sent <= 2 * limit:
            yield b"x" * 65536
            sent += 65536

    r = httpx.post(srv.http + path, content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large", r.text


def test_non_streamed_speech_stops_when_its_client_goes(srv):
    """The whole file is built before it is sent; a client that leaves meanwhile aborts the
    generation at once instead of letting it run to the end of every segment."""
    body = json.dumps({"input": "A long sentence to speak. " * 60, "max_duration_s": 60})
    url = urllib.parse.urlparse(srv.http)
    rows_before = scrape(srv)["clonecast_engine_rows_total"]
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(
            (
                "POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        deadline = time.monotonic() + 30
        while summed(scrape(srv), "clonecast_num_requests_running") == 0:
            assert time.monotonic() < deadline, "the speech request never started"
            time.sleep(0.05)
    wait_engine_idle(srv, timeout=60)
    # what it generated, not how long that took (hosts differ): 61-79 rows seen, 1,575
    # (12 s on the CPU) without the check for a departed client
    rows = scrape(srv)["clonecast_engine_rows_total"] - rows_before
    assert rows < 1500 / 4, rows


def test_a_late_append_after_cancel_is_refused_not_spoken(srv):
    """Barge-in: text still arriving for a cancelled utterance must not open a new one under
    the same id and speak it; a speak may reuse the id."""

    async def main():
        async with open_ws(srv.ws) as ws:
            opts = {"params": {"max_duration_s": 0.4, "seed": 2}}
            await ws.send(json.dumps({"type": "append", "id": "a", "text": "Hello. Mo", **opts}))
            await recv_until(ws, "started", id="a")
            await ws.send(json.dumps({"type": "cancel", "id": "a"}))
            _, before = await recv_until(ws, "cancelled", id="a")
            late = {"type": "append", "id": "a", "text": "re text. ", "request_id": "late"}
            await ws.send(json.dumps(late))
            err = await expect_error(ws, "unknown_id")
            assert "id" not in err and err["request_id"] == "late"
            assert await assert_alive(ws) == []  # nothing for "a" after its cancel
            await ws.send(speak("a", dur=0.2))
            done, _ = await recv_until(ws, "done", timeout=120, id="a")
            assert done["id"] == "a"

    run(main())


def test_a_transcript_the_prompt_cannot_hold_is_refused_at_creation(srv):
    """Structural tokens in a transcript would make the voice fail every later speak: refused
    when the voice is created (WebSocket, HTTP, and an inline voice of a speak)."""
    audio = b64(reference_audio(1.0))
    message = {"type": "voice.create", "audio_b64": audio, "transcript": "<|audio|> hi"}
    err = exchange(srv, json.dumps(message), code="bad_request")
    assert "structural" in err["message"]
    r = httpx.post(
        srv.http + "/v1/voices", json={"audio_b64": audio, "transcript": "<|audio|>"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    inline = {"audio_b64": audio, "transcript": "<|audio|>"}

    async def main():
        async with open_ws(srv.ws) as ws:
            await ws.send(speak("i", dur=0.2, voice=inline))
            await recv_until(ws, "started", id="i")
            err = await expect_error(ws, "bad_request")
            assert err["id"] == "i"

    run(main())


def test_http_routing_errors_are_json(srv):
    for method, path, status, code in [
        ("GET", "/v1/voices/a/b", 404, "not_found"),
        ("GET", "/nowhere", 404, "not_found"),
        ("PUT", "/v1/voices", 405, "method_not_allowed"),
        ("GET", "/v1/audio/speech", 405, "method_not_allowed"),
    ]:
        r = httpx.request(method, srv.http + path, timeout=30)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["code"] == code


def test_mistyped_output_and_stream_are_refused(srv):
    message = {"type": "speak", "id": "o", "text": "Hi.", "output": [["format", "wav"]]}
    err = exchange(srv, json.dumps(message), code="bad_parameter")
    assert "output must be an object" in err["message"]
    r = httpx.post(srv.http + "/v1/audio/speech", json={"input": "Hi.", "stream": "false"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text


def test_an_append_after_its_utterance_ended_is_refused_not_spoken(srv):
    """An `append` under the id of an utterance that has finished (like one cancelled) is
    refused: late text never opens a new utterance under it; a speak may reuse the id."""

    async def main():
        async with open_ws(srv.ws) as ws:
            params = {"max_duration_s": 0.2}
            opening = {"type": "append", "id": "f", "text": "Hi.", "params": params}
            await ws.send(json.dumps(opening))
            await ws.send(json.dumps({"type": "flush", "id": "f"}))
            await recv_until(ws, "done", timeout=120, id="f")
            late = {"type": "append", "id": "f", "text": "And more. ", "request_id": "late"}
            await ws.send(json.dumps(late))
            err = await expect_error(ws, "unknown_id")
            assert "id" not in err and err["request_id"] == "late" and "(done)" in err["message"]
            assert await assert_alive(ws) == []  # nothing started under "f"

    run(main())


def test_a_transcript_query_that_is_not_utf8_is_refused_not_replaced(srv):
    audio = reference_audio(1.0, f0=170.0)
    url = srv.http + "/v1/voices?transcript="
    r = httpx.post(url + "caf%E9", content=audio, timeout=60)  # Latin-1, not UTF-8
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_request" and "UTF-8" in r.json()["error"]["message"]
    ok = httpx.post(url + "caf%C3%A9+au+lait", content=audio, timeout=60)
    assert ok.status_code == 201, ok.text
    assert ok.json()["transcript"] == "café au lait"


def test_encodes_queued_by_a_client_that_left_are_dropped(srv):
    """Voice encodes a connection asked for and did not wait for are not run for no one: the
    engine encodes at most the two it had begun (plus any done before the close was seen)."""
    worker = srv.services.worker
    wait_engine_idle(srv)
    before = worker.stats.num_voice_encodes
    refs = [reference_audio(12.0, f0=90.0 + 7 * i) for i in range(10)]  # each a long encode

    async def main():
        async with open_ws(srv.ws) as ws:
            for i, ref in enumerate(refs):
                message = {"type": "voice.create", "audio_b64": b64(ref), "request_id": f"r{i}"}
                await ws.send(json.dumps(message))

    run(main())  # closed right after sending
    settled, last, deadline = time.monotonic(), -1, time.monotonic() + 120
    while time.monotonic() - settled < 3.0:  # until the count has not moved for 3 s
        assert time.monotonic() < deadline, "the encode count never settled"
        count = worker.stats.num_voice_encodes
        if count != last:
            settled, last = time.monotonic(), count
        time.sleep(0.1)
    assert last - before < len(refs), f"all {len(refs)} encodes ran for a client that left"

    async def still_served():  # the encoder serves the clients that stay
        async with open_ws(srv.ws) as ws:
            await ws.send(json.dumps({"type": "voice.create", "audio_b64": b64(refs[-1])}))
            created, _ = await recv_until(ws, "voice.created", timeout=120)
            return created

    assert run(still_served())["voice_id"].startswith("v_")
