"""Every rejected message gets an `error` with its stable code (and the utterance id or the
upload's request_id where there is one), and the connection keeps working: each test ends
with a ping on the same socket. One server with small limits serves the whole module."""

from __future__ import annotations

import base64
import json

import pytest
from websockets.exceptions import ConnectionClosed

from .conftest import (
    FRAME_BYTES,
    assert_alive,
    check_complete,
    collect,
    exchange,
    expect_error,
    frames_for,
    open_ws,
    recv_json,
    run,
    speak,
)

MAX_MESSAGE = 4096
MAX_TEXT = 200


@pytest.fixture(scope="module")
def small(make_server):
    return make_server(max_message_bytes=MAX_MESSAGE, max_text_chars=MAX_TEXT, max_utterances=2)


@pytest.mark.parametrize(
    "frame",
    ["{not json", "", '"a string"', "[1, 2, 3]", "42", "null"],
    ids=["broken", "empty", "string", "array", "number", "null"],
)
def test_bad_json(small, frame):
    err = exchange(small, frame, code="bad_json")
    assert "id" not in err


@pytest.mark.parametrize(
    "message",
    [{"type": "dance"}, {"kind": "speak"}, {"type": 3}, {"type": "SPEAK", "id": "x", "text": "a"}],
    ids=["unknown", "missing", "not-a-string", "case"],
)
def test_unknown_type(small, message):
    exchange(small, json.dumps(message), code="unknown_type")


def test_binary_frame_without_upload(small):
    exchange(small, b"\x00\x01\x02 not announced", code="unexpected_binary")


def test_text_frame_over_max_message_bytes_keeps_the_connection(small):
    big = json.dumps({"type": "speak", "id": "big", "text": "x" * (MAX_MESSAGE + 100)})
    assert MAX_MESSAGE < len(big) < 2 * MAX_MESSAGE
    err = exchange(small, big, code="message_too_large")
    assert str(MAX_MESSAGE) in err["message"]


def test_frame_over_transport_limit_closes_with_1009(small):
    async def main():
        async with open_ws(small.ws, max_size=None) as ws:
            await ws.send("x" * (3 * MAX_MESSAGE))
            with pytest.raises(ConnectionClosed):
                while True:
                    await recv_json(ws, timeout=10)
            return ws.close_code

    assert run(main()) == 1009


def test_unknown_voice(small):
    err = exchange(small, speak("u1", voice_id="v_does_not_exist"), code="unknown_voice")
    assert err["id"] == "u1"


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_text(small, text):
    err = exchange(small, speak("e1", text), code="empty_text")
    assert err["id"] == "e1"


def test_empty_text_on_flush(small):
    frames = [
        json.dumps({"type": "append", "id": "e2", "text": "  ", "params": {"seed": 1}}),
        json.dumps({"type": "flush", "id": "e2"}),
    ]

    async def main():
        async with open_ws(small.ws) as ws:
            for frame in frames:
                await ws.send(frame)
            started = await recv_json(ws)
            err = await expect_error(ws, "empty_text")
            await assert_alive(ws)
            return started, err

    started, err = run(main())
    assert started["type"] == "started" and err["id"] == "e2"


def test_text_too_long(small):
    err = exchange(small, speak("t1", "a" * (MAX_TEXT + 1)), code="text_too_long")
    assert err["id"] == "t1"
    # exactly at the limit is accepted
    ok = "word " * (MAX_TEXT // 5)

    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("t2", ok[:MAX_TEXT], dur=1.0, seed=2))
            u = (await collect(ws, ["t2"]))["t2"]
            return u

    check_complete(run(main()))


def test_text_too_long_over_several_appends(small):
    async def main():
        async with open_ws(small.ws) as ws:
            opts = {"params": {"max_duration_s": 1.0, "seed": 3}}
            await ws.send(json.dumps({"type": "append", "id": "t3", "text": "b" * 150, **opts}))
            assert (await recv_json(ws))["type"] == "started"
            await ws.send(json.dumps({"type": "append", "id": "t3", "text": "c" * 60}))
            err = await expect_error(ws, "text_too_long")
            await ws.send(json.dumps({"type": "flush", "id": "t3"}))  # the utterance was ended
            gone = await expect_error(ws, "unknown_id")
            await assert_alive(ws)
            return err, gone

    err, gone = run(main())
    assert err["id"] == "t3" and gone["id"] == "t3"


BAD_PARAMS = {
    "temperature-negative": {"params": {"temperature": -1}},
    "top_p-zero": {"params": {"top_p": 0}},
    "top_p-above-one": {"params": {"top_p": 1.5}},
    "top_k-negative": {"params": {"top_k": -1}},
    "repetition_penalty": {"params": {"repetition_penalty": 1.1}},
    "frequency_penalty": {"params": {"frequency_penalty": 0.5}},
    "logit_bias": {"params": {"logit_bias": {}}},
    "unknown-param": {"params": {"creativity": 11}},
    "max_duration-zero": {"params": {"max_duration_s": 0}},
    "max_duration-too-long": {"params": {"max_duration_s": 100}},
    "params-not-object": {"params": [1, 2]},
    "format": {"output": {"format": "mp3"}},
    "sample_rate": {"output": {"sample_rate": 12345}},
    "output-field": {"output": {"format": "pcm16", "channels": 2}},
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_parameter(small, name):
    message = {"type": "speak", "id": "p1", "text": "Hello.", **BAD_PARAMS[name]}
    if "params" in BAD_PARAMS[name] and isinstance(message["params"], dict):
        message["params"].setdefault("max_duration_s", 1.0)
    err = exchange(small, json.dumps(message), code="bad_parameter")
    assert err["id"] == "p1"


@pytest.mark.parametrize(
    "message",
    [
        {"type": "speak", "text": "Hello."},
        {"type": "speak", "id": 7, "text": "Hello."},
        {"type": "speak", "id": "", "text": "Hello."},
        {"type": "speak", "id": "x" * 256, "text": "Hello."},
        {"type": "speak", "id": "n1", "text": 5},
        {"type": "append", "id": "n2"},
        {"type": "voice.upload", "transcript": "no size"},
        {"type": "voice.create", "transcript": "no audio"},
    ],
    ids=["no-id", "int-id", "empty-id", "long-id", "text-int", "append-no-text", "upload", "b64"],
)
def test_missing_or_mistyped_fields(small, message):
    exchange(small, json.dumps(message), code="bad_request")


def test_duplicate_id_while_running_then_reusable_after_done(small):
    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("d", dur=2.0, seed=4))
            await ws.send(speak("d", "Another text.", dur=1.0, seed=5, request_id="d"))
            utts = await collect(ws, ["d"], stop_on_error=False)
            await assert_alive(ws)
            await ws.send(speak("d", dur=1.0, seed=5))  # finished: the id is free again
            again = (await collect(ws, ["d"]))["d"]
            return utts["d"], again

    first, again = run(main())
    # the error names the rejected message (request_id), not the running utterance (no id)
    assert [(e["code"], e.get("id"), e["request_id"]) for e in first.errors] == [
        ("duplicate_id", None, "d")
    ]
    assert first.kinds.count("started") == 1
    first.errors = []
    check_complete(first)
    assert len(first.payload) == frames_for(2.0) * FRAME_BYTES
    check_complete(again)


@pytest.mark.parametrize("kind", ["cancel", "flush"])
def test_cancel_or_flush_unknown_id(small, kind):
    err = exchange(small, json.dumps({"type": kind, "id": "never"}), code="unknown_id")
    assert err["id"] == "never"


def test_flush_of_a_speak_is_unknown_id(small):
    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("s", dur=1.0, seed=6))
            await ws.send(json.dumps({"type": "flush", "id": "s", "request_id": "s"}))
            u = (await collect(ws, ["s"], stop_on_error=False))["s"]
            return u

    u = run(main())
    assert [(e["code"], e.get("id")) for e in u.errors] == [("unknown_id", None)]
    u.errors = []
    check_complete(u)


def test_too_many_utterances(small):
    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("m1", dur=2.0, seed=7))
            await ws.send(speak("m2", dur=2.0, seed=8))
            await ws.send(speak("m3", dur=1.0, seed=9))
            utts = await collect(ws, ["m1", "m2", "m3"])
            await assert_alive(ws)
            return utts

    utts = run(main())
    assert [e["code"] for e in utts["m3"].errors] == ["too_many_utterances"]
    assert utts["m3"].started is None and utts["m3"].frames == []
    for uid in ("m1", "m2"):
        check_complete(utts[uid])


def test_corrupt_reference_audio(small):
    garbage = base64.b64encode(b"this is not audio at all " * 40).decode()
    message = {"type": "voice.create", "audio_b64": garbage, "request_id": "req-7"}
    err = exchange(small, json.dumps(message), code="audio_undecodable")
    assert err["request_id"] == "req-7"


def test_invalid_base64(small):
    message = {"type": "voice.create", "audio_b64": "@@not base64!!", "request_id": "req-8"}
    exchange(small, json.dumps(message), code="bad_request")


def test_voice_upload_size_mismatch(small):
    async def main():
        async with open_ws(small.ws) as ws:
            announce = {"type": "voice.upload", "bytes": 1000, "request_id": "up-1"}
            await ws.send(json.dumps(announce))
            await ws.send(b"\x01" * 999)
            err = await expect_error(ws, "bad_request")
            await ws.send(b"\x01" * 1000)  # the announcement was used up
            late = await expect_error(ws, "unexpected_binary")
            await assert_alive(ws)
            return err, late

    err, _ = run(main())
    assert err["request_id"] == "up-1"
    assert "1000" in err["message"] and "999" in err["message"]


def test_voice_upload_over_the_upload_limit(small):
    limit = small.services.settings.limits.max_upload_bytes
    message = {"type": "voice.upload", "bytes": limit + 1, "request_id": "up-2"}
    exchange(small, json.dumps(message), code="message_too_large")


@pytest.mark.parametrize("where", ["encode", "finish"])
def test_a_server_failure_while_streaming_ends_that_utterance_with_internal(
    small, monkeypatch, where
):
    """A bug while turning engine output into audio (here: the 16 kHz encoder raises, on a
    chunk or at the end) ends its utterance with `internal` at once instead of leaving the
    client waiting; the other utterance on the socket completes."""
    from service.audio_format import StreamEncoder

    original = getattr(StreamEncoder, where)

    def failing(self, *args):
        if self.fmt.sample_rate == 16000:
            raise RuntimeError("injected encoder failure")
        return original(self, *args)

    monkeypatch.setattr(StreamEncoder, where, failing)
    resampled = {"format": "pcm16", "sample_rate": 16000}

    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("broken", dur=1.0, seed=3, output=resampled))
            await ws.send(speak("fine", dur=1.0, seed=4))
            utts = await collect(ws, ["broken", "fine"], timeout=30)
            await assert_alive(ws)
            return utts

    utts = run(main())
    assert [e["code"] for e in utts["broken"].errors] == ["internal"]
    assert utts["broken"].done is None
    check_complete(utts["fine"])


def test_an_unknown_type_answers_with_its_request_id(small):
    """Refused before it was read, the message is still answered by its request_id (not by
    its `id`: an error with an id ends that utterance, and this one started nothing)."""
    message = {"type": "dance", "request_id": "r-7", "id": "u-7"}
    err = exchange(small, json.dumps(message), code="unknown_type")
    assert err["request_id"] == "r-7" and "id" not in err


def test_empty_reference_audio_is_audio_empty_as_over_http(small):
    """An empty upload is `audio_empty` whichever way it is sent (HTTP says so too)."""
    err = exchange(
        small, json.dumps({"type": "voice.create", "request_id": "e1", "audio_b64": ""}),
        code="audio_empty",
    )  # fmt: skip
    assert err["request_id"] == "e1"
    exchange(small, json.dumps({"type": "voice.upload", "bytes": 0}), code="audio_empty")
    inline = {"type": "speak", "id": "i", "text": "Hi.", "voice": {"audio_b64": ""}}

    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(json.dumps(inline))
            return [await recv_json(ws), await recv_json(ws)]

    started, error = run(main())  # the voice is read once the utterance has started
    assert started["type"] == "started" and error["code"] == "audio_empty" and error["id"] == "i"


def test_an_inline_voice_refused_after_started_keeps_the_request_id(small):
    """The voice is encoded after `started`: its refusal still carries the message's ids."""
    noise = base64.b64encode(b"RIFF this is not a recording at all").decode()
    message = {
        "type": "speak",
        "id": "v",
        "request_id": "r-9",
        "text": "Hi.",
        "voice": {"audio_b64": noise},
    }

    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(json.dumps(message))
            started = await recv_json(ws)
            error = await recv_json(ws)
            return started, error

    started, error = run(main())
    assert started["type"] == "started"
    assert error["type"] == "error" and error["id"] == "v" and error["request_id"] == "r-9"


def test_voice_id_default_means_no_reference_as_over_http(small):
    async def main():
        async with open_ws(small.ws) as ws:
            await ws.send(speak("d", "Plain.", dur=0.4, voice_id="default"))
            return await collect(ws, ["d"])

    check_complete(run(main())["d"])
