"""The WebSocket protocol `clonecast.v1` end to end against a real server: the ready
message, speak round trips, output formats, incremental text, barge-in, concurrency and a
client that vanishes. Every utterance is capped with a small `max_duration_s`."""

from __future__ import annotations

import asyncio
import json
import struct
import time

import httpx
import numpy as np
import pytest
import torch
import torchaudio
from websockets.asyncio.client import connect

from service.audio_format import mulaw_decode

from .conftest import (
    FRAME_BYTES,
    FRAME_SAMPLES,
    assert_alive,
    b64,
    check_complete,
    collect,
    expect_error,
    frames_for,
    open_ws,
    recv_json,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
    summed,
    wait_engine_idle,
)


def test_the_server_does_not_compress_audio_frames(server):
    """Clients (browsers, the websockets library) offer permessage-deflate; the server declines:
    deflating every PCM frame costs far more CPU than it saves bytes."""

    async def go():
        async with open_ws(server.ws) as ws:  # the client offers compression by default
            assert ws.response.headers.get("Sec-WebSocket-Extensions") is None

    run(go())


def test_a_pong_echoes_its_pings_request_id(server):
    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(json.dumps({"type": "ping", "request_id": "p-7"}))
            tagged, _ = await recv_until(ws, "pong")
            await ws.send(json.dumps({"type": "ping"}))
            plain, _ = await recv_until(ws, "pong")
            return tagged, plain

    tagged, plain = run(main())
    assert tagged["request_id"] == "p-7" and isinstance(tagged["t"], float)
    assert "request_id" not in plain


def test_ready_message_describes_protocol_model_audio_and_limits(server):
    async def main():
        async with connect(server.ws, open_timeout=30) as ws:
            return await recv_json(ws)

    ready = run(main())
    assert ready["type"] == "ready"
    assert ready["protocol"] == "clonecast.v1"
    assert isinstance(ready["session_id"], str) and ready["session_id"].startswith("s_")
    model = ready["model"]
    assert model["untrained"] is True
    assert isinstance(model["name"], str) and model["name"]
    assert "random weights" in model["notice"]
    assert model["default_max_duration_s"] == 4.0  # the untrained model's cap when none is set
    assert ready["audio"] == {"sample_rate": 24000, "first_chunk_ms": 320, "chunk_ms": 1000}
    limits = ready["limits"]
    assert limits["max_text_chars"] == 5000
    assert limits["max_utterances"] == 8
    assert limits["max_message_bytes"] == 8 * 1024 * 1024
    assert limits["max_reference_seconds"] == 30
    assert limits["idle_timeout_s"] == 60
    assert limits["max_buffered_audio_bytes"] == 4 * 1024 * 1024
    assert limits["max_messages_per_s"] == 50 and limits["message_burst"] == 100


def test_speak_round_trip_chunks_and_done_stats(server):
    dur = 3.0

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("utt-1", "Hello there, this is a test.", dur=dur, seed=1))
            utts = await collect(ws, ["utt-1"])
            return utts["utt-1"]

    u = run(main())
    check_complete(u)
    assert u.started == {"type": "started", "id": "utt-1", "segments": 1}
    assert u.kinds[0] == "started"  # before any audio
    sizes = [len(f.payload) for f in u.frames]
    nonempty = [s for s in sizes if s]
    # 320 ms first, then 1 s chunks, then the remainder; the final frame may be empty
    assert sizes[0] == 15360
    assert nonempty[1:-1] == [48000] * (len(nonempty) - 2)
    assert 0 < nonempty[-1] <= 48000
    assert sizes[-1] == 0 or sizes[-1] == nonempty[-1]
    total = sum(sizes)
    assert u.done["reason"] == "length"
    assert total == frames_for(dur) * FRAME_BYTES == 144000
    # the JSON headers describe the frames: format, rate, contiguous times
    for h in u.headers:
        assert (h["format"], h["sample_rate"]) == ("pcm16", 24000)
    timed = [h for h in u.headers if h["bytes"]]
    assert (timed[0]["start_ms"], timed[0]["end_ms"]) == (0, 320)
    for a, b in zip(timed, timed[1:], strict=False):
        assert b["start_ms"] == a["end_ms"]
    assert timed[-1]["end_ms"] == round(dur * 1000)
    for h in timed:
        assert h["end_ms"] - h["start_ms"] == h["bytes"] // 48
    assert u.headers[-1]["last"] is True
    stats = u.done["stats"]
    assert stats["first_audio_ms"] > 0
    assert stats["audio_s"] == pytest.approx(total / 48000, abs=1e-3)
    assert stats["bytes"] == total
    assert stats["chunks"] == len(nonempty)
    assert stats["segments"] == 1
    assert stats["elapsed_s"] > 0
    assert stats["rtf"] == pytest.approx(stats["elapsed_s"] / stats["audio_s"], rel=0.02)
    assert isinstance(stats["underruns"], int) and stats["underruns"] >= 0


def test_speak_one_second_is_exactly_25_frames(server):
    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("a", dur=1.0, seed=2))
            utts = await collect(ws, ["a"])
            return utts["a"]

    u = run(main())
    check_complete(u)
    assert u.done["reason"] == "length"
    assert len(u.payload) == frames_for(1.0) * FRAME_BYTES == 48000
    assert u.done["stats"]["audio_s"] == pytest.approx(1.0, abs=1e-3)


# (output spec, bytes per sample, rate, payload prefix that is not audio)
FORMATS = {
    "f32": ({"format": "f32"}, 4, 24000),
    "mulaw-8k": ({"format": "mulaw"}, 1, 8000),
    "mulaw-16k": ({"format": "mulaw", "sample_rate": 16000}, 1, 16000),
    "pcm16-16k": ({"format": "pcm16", "sample_rate": 16000}, 2, 16000),
    "pcm16-48k": ({"format": "pcm16", "sample_rate": 48000}, 2, 48000),
    "f32-22050": ({"format": "f32", "sample_rate": 22050}, 4, 22050),
    "wav": ({"format": "wav"}, 2, 24000),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_output_formats_have_consistent_sample_counts(server, name):
    output, width, rate = FORMATS[name]
    dur = 1.0

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("f", dur=dur, seed=3, output=output))
            utts = await collect(ws, ["f"])
            return utts["f"]

    u = run(main())
    check_complete(u, first_bytes=None)
    assert u.done["reason"] == "length"
    for h in u.headers:
        assert h["format"] == output["format"]
        assert h["sample_rate"] == rate
    data = u.payload
    if output["format"] == "wav":
        first = u.frames[0].payload
        assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt "
        riff, fmt_size, tag, channels, hdr_rate, byte_rate, align, bits = struct.unpack(
            "<I4x4xIHHIIHH", first[4:36]
        )
        assert riff == 0xFFFFFFFF  # streamed: unknown size
        assert (fmt_size, tag, channels, hdr_rate, byte_rate, align, bits) == (
            16,
            1,
            1,
            24000,
            48000,
            2,
            16,
        )
        assert first[36:40] == b"data" and struct.unpack("<I", first[40:44])[0] == 0xFFFFFFFF
        assert len(first) == 44 + 15360
        data = data[44:]
    assert len(data) % width == 0
    samples = len(data) // width
    expected = frames_for(dur) * FRAME_SAMPLES * rate / 24000
    assert abs(samples - expected) <= 2, (samples, expected)
    if output["format"] == "f32":
        x = np.frombuffer(data, "<f4")
        assert np.all(np.isfinite(x)) and np.max(np.abs(x)) <= 1.0
        if rate == 24000:
            assert len(u.frames[0].payload) == 2 * 15360
    if output["format"] == "mulaw":
        assert mulaw_decode(np.frombuffer(data, np.uint8)).dtype == np.int16
    stats = u.done["stats"]
    assert stats["bytes"] == len(u.payload)
    # audio_s counts audio only: a WAV header is not 0.9 ms of sound
    assert stats["audio_s"] == pytest.approx(samples / rate, abs=6e-4)


def test_resampling_is_continuous_across_chunks(server):
    """The same seed at 24 kHz and at 16 kHz: the streamed 16 kHz output equals resampling
    the whole 24 kHz utterance at once (no clicks at chunk boundaries)."""

    async def main():
        async with open_ws(server.ws) as ws:
            out = {}
            for uid, output in (("r24", {}), ("r16", {"sample_rate": 16000}), ("again", {})):
                await ws.send(speak(uid, dur=2.0, seed=11, output=output))
                out[uid] = (await collect(ws, [uid]))[uid]
            return out

    out = run(main())
    for u in out.values():
        check_complete(u, first_bytes=None)
    pcm24 = np.frombuffer(out["r24"].payload, "<i2")
    assert out["again"].payload == out["r24"].payload, "a seed must give the same audio"
    pcm16k = np.frombuffer(out["r16"].payload, "<i2").astype(np.int32)
    whole = torchaudio.functional.resample(
        torch.from_numpy(pcm24.astype(np.float32) / 32768.0), 24000, 16000
    ).numpy()
    ref = np.clip(np.round(whole * 32768.0), -32768, 32767).astype(np.int32)
    assert len(pcm16k) == len(ref)
    assert np.max(np.abs(pcm16k - ref)) <= 2


def test_incremental_append_flush(server):
    async def main():
        async with open_ws(server.ws) as ws:
            opts = {"params": {"max_duration_s": 1.0, "seed": 4}}
            await ws.send(
                json.dumps({"type": "append", "id": "inc", "text": "The first sentence. ", **opts})
            )
            started = await recv_json(ws)
            assert started == {"type": "started", "id": "inc", "segments": 0}
            # the complete first sentence speaks before any flush
            first_audio, before = await recv_until(ws, "audio", id="inc")
            caption = {"type": "segment", "id": "inc", "index": 0, "start_ms": 0}
            assert before == [{**caption, "text": "The first sentence."}]  # only its caption
            assert first_audio["seq"] == 0
            first_frame = await ws.recv()
            await ws.send(json.dumps({"type": "append", "id": "inc", "text": "And the second one"}))
            await ws.send(json.dumps({"type": "flush", "id": "inc"}))
            late = {"type": "append", "id": "inc", "text": "Too late.", "request_id": "inc"}
            await ws.send(json.dumps(late))
            utts = await collect(ws, ["inc"], stop_on_error=False)
            return first_audio, first_frame, utts["inc"]

    first_audio, first_frame, u = run(main())
    assert first_audio["bytes"] == 15360 and len(first_frame) > 15360
    assert u.kinds.index("flushed") < u.kinds.index("done")
    assert u.other == [{"type": "flushed", "id": "inc"}]
    assert [e["code"] for e in u.errors] == ["unknown_id"]
    assert "id" not in u.errors[0] and u.errors[0]["request_id"] == "inc"  # "inc" goes on
    # the frames after the first continue its numbering
    assert [f.seq for f in u.frames] == list(range(1, len(u.frames) + 1))
    assert u.frames[-1].last and not any(f.last for f in u.frames[:-1])
    total = first_audio["bytes"] + len(u.payload)
    stats = u.done["stats"]
    assert stats["segments"] == 2
    assert u.done["reason"] == "length"
    assert total == 2 * frames_for(1.0) * FRAME_BYTES  # each segment runs to its own cap
    assert stats["bytes"] == total
    assert stats["audio_s"] == pytest.approx(total / 48000, abs=1e-3)


def test_cancel_stops_audio_and_frees_the_engine(server):
    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("long", "A much longer utterance.", dur=6.0, seed=5))
            await recv_until(ws, "audio", id="long")
            frame = await ws.recv()
            assert isinstance(frame, bytes)
            await ws.send(json.dumps({"type": "cancel", "id": "long"}))
            _, before_ack = await recv_until(ws, "cancelled", id="long")
            # only complete audio pairs may precede the ack; nothing for "long" after it
            after = []
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                try:
                    after.append(await asyncio.wait_for(ws.recv(), end - time.monotonic()))
                except TimeoutError:
                    break
            after += await assert_alive(ws)
            await ws.send(json.dumps({"type": "cancel", "id": "long"}))
            gone = await expect_error(ws, "unknown_id")
            await ws.send(speak("next", dur=1.0, seed=6))
            nxt = (await collect(ws, ["next"]))["next"]
            return before_ack, after, gone, nxt

    before_ack, after, gone, nxt = run(main())
    assert all(isinstance(m, bytes) or m["type"] == "audio" for m in before_ack)
    assert after == [], f"audio or messages after the cancel ack: {after}"
    assert gone["id"] == "long"
    check_complete(nxt)
    assert len(nxt.payload) == 48000
    m = wait_engine_idle(server, timeout=10)
    assert summed(m, "clonecast_num_requests_running") == 0


def test_three_concurrent_utterances_on_one_socket(server):
    ids = ["c1", "c2", "c3"]

    async def main():
        async with open_ws(server.ws) as ws:
            for i, uid in enumerate(ids):
                await ws.send(speak(uid, f"Sentence number {i}.", dur=1.0 + i, seed=30 + i))
            utts = await collect(ws, ids)
            return utts

    utts = run(main())
    for i, uid in enumerate(ids):
        u = utts[uid]
        check_complete(u)
        assert all(f.utterance_id == uid for f in u.frames)
        assert u.done["reason"] == "length"
        assert len(u.payload) == frames_for(1.0 + i) * FRAME_BYTES
        assert u.done["stats"]["bytes"] == len(u.payload)
    wait_engine_idle(server, timeout=10)


def test_vanished_client_frees_its_engine_requests(server):
    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("gone", "Nobody will hear this.", dur=20.0, seed=8))
            await ws.send(speak("gone2", "Nor this.", dur=20.0, seed=9))
            await recv_until(ws, "audio", id="gone")
            assert summed(scrape(server), "clonecast_num_requests_running") >= 1
            ws.transport.abort()  # no close frame: the TCP connection just drops

    run(main())
    m = wait_engine_idle(server, timeout=10)
    deadline = time.monotonic() + 10
    while m["clonecast_websocket_connections"] != 0:
        assert time.monotonic() < deadline, "the vanished connection is still counted"
        time.sleep(0.1)
        m = scrape(server)


def test_long_text_is_split_into_segments_spoken_in_order(server):
    first = "This first sentence is long enough " + "and keeps going " * 10 + "to its end."
    second = "The second sentence is just as long " + "and goes on " * 12 + "until it stops."
    text = f"{first} {second}"
    assert len(text) > 300 and len(first) < 300 and len(second) < 300

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("seg", text, dur=1.0, seed=13))
            return (await collect(ws, ["seg"]))["seg"]

    u = run(main())
    check_complete(u)
    assert u.started["segments"] == 2
    assert u.done["stats"]["segments"] == 2
    assert u.done["reason"] == "length"
    assert len(u.payload) == 2 * frames_for(1.0) * FRAME_BYTES
    # both segments start with their own 320 ms chunk, in one continuous numbering
    assert [len(f.payload) for f in u.frames if f.payload][:4] == [15360, 32640, 15360, 32640]


def test_cancel_is_not_held_up_by_a_voice_encode(server):
    """Barge-in must stop an utterance now: a `cancel` sent right after a `voice.create` is
    acknowledged without waiting for the (seconds long) reference encode to finish."""
    reference = reference_audio(25.0, "WAV", f0=97.0)  # unique: not in any cache

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("bg", "Background talk.", dur=10.0, seed=13))
            await recv_until(ws, "audio", id="bg")
            create = {"type": "voice.create", "audio_b64": b64(reference), "request_id": "big"}
            await ws.send(json.dumps(create))
            await ws.send(json.dumps({"type": "cancel", "id": "bg"}))
            order = []
            while len(order) < 2:
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, str):
                    kind = json.loads(message)["type"]
                    if kind in ("cancelled", "voice.created", "error"):
                        order.append(kind)
            return order

    assert run(main()) == ["cancelled", "voice.created"]


def test_segment_messages_announce_each_sentence_before_its_audio(make_server):
    """An utterance of several segments: a `segment` message (index, text, where its audio
    starts in the utterance's timeline) goes out before each segment's first audio frame."""
    server = make_server(max_segment_chars=24)
    texts = ["Good morning to you all.", "The weather is fine.", "Bye."]

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("captions", " ".join(texts), dur=1.2, seed=8))
            order = []

            async def hook(message):
                order.append((message["type"], message.get("index"), message.get("start_ms")))

            u = (await collect(ws, ["captions"], hook=hook))["captions"]
            return u, order

    u, order = run(main())
    check_complete(u)
    assert [(s["index"], s["text"]) for s in u.segments] == list(enumerate(texts))
    frames_each = frames_for(1.2)  # every segment runs to its length cap
    assert [s["start_ms"] for s in u.segments] == [i * frames_each * 40 for i in range(3)]
    for seg in u.segments:  # right before the audio message that starts at its start_ms
        at = order.index(("segment", seg["index"], seg["start_ms"]))
        assert order[at + 1] == ("audio", None, seg["start_ms"])


def test_the_untrained_model_stops_at_its_default_cap_unless_asked_for_more(server):
    """A speak without max_duration_s ends at the untrained model's 4 s (100 frames, reason
    length), not at the 81.6 s cap; an explicit duration still wins, over the socket and over
    HTTP alike. (Seeded: the random model samples its end code by chance, ending about one
    unseeded 4 s utterance in 25 early.)"""

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(
                json.dumps({"type": "speak", "id": "d", "text": "Short.", "params": {"seed": 2}})
            )
            await ws.send(speak("e", "Short.", dur=1.0))
            return await collect(ws, ["d", "e"])

    got = run(main())
    assert got["d"].done["reason"] == "length" and got["d"].done["stats"]["audio_s"] == 4.0
    assert got["e"].done["stats"]["audio_s"] == 1.0
    r = httpx.post(
        server.http + "/v1/audio/speech",
        json={"input": "Short.", "response_format": "pcm", "seed": 2},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.content) == 4 * 48000
