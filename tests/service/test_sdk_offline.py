"""The client SDK without a clonecast server: the reader's demultiplexing on an in-memory
connection, and the sync client and `clonecast say` against a scripted websockets server."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import wave
from pathlib import Path

import pytest
from websockets.asyncio.server import serve

from clonecast_client import AsyncClient, Client, ClonecastError
from clonecast_client.say import add_say_parser, say
from clonecast_client.wire import pack_audio

ROOT = Path(__file__).resolve().parents[2]
READY = {
    "type": "ready",
    "protocol": "clonecast.v1",
    "session_id": "s_test",
    "model": {"name": "tiny", "untrained": True, "notice": "random weights"},
    "audio": {"sample_rate": 24000, "first_chunk_ms": 320, "chunk_ms": 1000},
    "limits": {"max_message_bytes": 1 << 20},
}
_EOF = object()


class FakeConnection:
    """The websockets connection surface the SDK uses, fed by the test."""

    def __init__(self, reply=None):
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.reply = reply  # called with each sent text message, may feed answers
        self.close_code: int | None = None
        self.close_reason = ""

    def feed(self, *messages) -> None:
        for m in messages:
            self.incoming.put_nowait(json.dumps(m) if isinstance(m, dict) else m)

    def server_close(self, code: int, reason: str = "") -> None:
        self.close_code, self.close_reason = code, reason
        self.incoming.put_nowait(_EOF)

    def sent_json(self) -> list[dict]:
        return [json.loads(m) for m in self.sent if isinstance(m, str)]

    async def recv(self):
        return await self.incoming.get()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.incoming.get()
        if item is _EOF:
            raise StopAsyncIteration
        return item

    async def send(self, message) -> None:
        self.sent.append(message)
        if self.reply is not None and isinstance(message, str):
            self.reply(self, json.loads(message))

    async def close(self) -> None:
        if self.close_code is None:
            self.server_close(1000)


def audio(uid: str, seq: int, payload: bytes, last: bool = False) -> list:
    meta = {"type": "audio", "id": uid, "seq": seq, "bytes": len(payload), "last": last}
    meta.update(start_ms=seq * 100, end_ms=seq * 100 + 100, format="pcm16", sample_rate=24000)
    return [meta, pack_audio(uid, seq, last, payload)]


def done(uid: str, **stats) -> dict:
    return {"type": "done", "id": uid, "reason": "eos", "stats": stats}


async def start(reply=None) -> tuple[AsyncClient, FakeConnection]:
    conn = FakeConnection(reply)
    conn.feed(READY)
    return await AsyncClient.from_connection(conn), conn


def test_importing_the_sdk_loads_no_torch_or_starlette():
    code = (
        "import sys, clonecast_client, clonecast_client.say\n"
        "print(sorted(m for m in ('torch', 'numpy', 'starlette') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_audio_is_routed_to_its_utterance_in_order_and_done_ends_with_stats():
    async def main():
        client, conn = await start()
        assert client.session_id == "s_test" and client.model_untrained
        a = client.speak("Hello.", voice_id="v_1", params={"seed": 3})
        b = client.speak("World.")
        conn.feed({"type": "started", "id": "u1", "segments": 1})
        conn.feed(*audio("u1", 0, b"a0"), *audio("u2", 0, b"b0"), *audio("u1", 1, b"a1"))
        conn.feed(*audio("u2", 1, b"b1", last=True), done("u2", chunks=2))
        conn.feed(*audio("u1", 2, b"a2", last=True), done("u1", chunks=3, audio_s=0.3))
        chunks_a, chunks_b = await asyncio.gather(
            asyncio.wait_for(_chunks(a), 5), asyncio.wait_for(_chunks(b), 5)
        )
        assert [(c.seq, c.data, c.last) for c in chunks_a] == [
            (0, b"a0", False),
            (1, b"a1", False),
            (2, b"a2", True),
        ]
        assert [c.data for c in chunks_b] == [b"b0", b"b1"]
        assert (chunks_a[1].start_ms, chunks_a[1].end_ms) == (100, 200)
        assert a.started == {"type": "started", "id": "u1", "segments": 1}
        assert a.done["reason"] == "eos" and a.done["stats"]["chunks"] == 3
        speak = conn.sent_json()
        assert speak[0] == {
            "type": "speak",
            "id": "u1",
            "text": "Hello.",
            "voice_id": "v_1",
            "params": {"seed": 3},
        }
        assert speak[1]["id"] == "u2" and "voice_id" not in speak[1]
        await client.close()

    asyncio.run(main())


async def _chunks(utt):
    return [c async for c in utt]


def test_utterance_error_raises_with_its_code_and_spares_the_others():
    async def main():
        client, conn = await start()
        bad, good = client.speak("x", id="bad"), client.speak("y", id="good")
        conn.feed({"type": "error", "code": "unknown_voice", "message": "no v_9", "id": "bad"})
        conn.feed(*audio("good", 0, b"g", last=True), done("good"))
        with pytest.raises(ClonecastError) as err:
            await asyncio.wait_for(bad.collect(), 5)
        assert (err.value.code, err.value.message) == ("unknown_voice", "no v_9")
        assert await asyncio.wait_for(good.collect(), 5) == b"g"
        await client.close()

    asyncio.run(main())


def test_cancel_waits_for_the_ack_and_ends_iteration():
    def reply(conn, message):
        if message["type"] == "cancel":
            conn.feed(*audio(message["id"], 1, b"late"), {"type": "cancelled", "id": "u1"})

    async def main():
        client, conn = await start(reply)
        utt = client.speak("A long text.")
        conn.feed(*audio("u1", 0, b"first"))
        assert (await asyncio.wait_for(anext(utt), 5)).data == b"first"
        await asyncio.wait_for(utt.cancel(), 5)
        assert [m["type"] for m in conn.sent_json()] == ["speak", "cancel"]
        assert await utt.collect() == b""
        await client.close()

    asyncio.run(main())


def test_cancel_racing_the_end_of_the_utterance_is_not_an_error():
    def reply(conn, message):
        if message["type"] == "cancel":  # the server had just finished it
            error = {"type": "error", "code": "unknown_id", "message": "gone", "id": "u1"}
            conn.feed(error, done("u1"))

    async def main():
        client, conn = await start(reply)
        utt = client.speak("x")
        await asyncio.wait_for(utt.cancel(), 5)
        assert utt.error is None and await utt.collect() == b""
        client.speak("y", id="u2")
        with pytest.raises(ClonecastError, match="duplicate_id"):
            client.speak("z", id="u2")
        await client.close()

    asyncio.run(main())


def test_server_cancelled_ends_iteration():
    async def main():
        client, conn = await start()
        utt = client.speak("x")
        conn.feed(*audio("u1", 0, b"a"), {"type": "cancelled", "id": "u1"})
        assert await asyncio.wait_for(utt.collect(), 5) == b"a"
        assert utt.done is None
        await client.close()

    asyncio.run(main())


def test_voice_created_resolves_the_right_request():
    async def main():
        client, conn = await start()
        first = asyncio.create_task(client.create_voice(b"RIFF1", "one"))
        second = asyncio.create_task(client.create_voice(b"RIFF2", binary=False))
        await asyncio.sleep(0)
        upload, create = conn.sent_json()
        assert upload == {
            "type": "voice.upload",
            "bytes": 5,
            "transcript": "one",
            "request_id": "r1",
        }
        assert conn.sent[1] == b"RIFF1"  # the binary frame follows its announcement
        assert create == {"type": "voice.create", "audio_b64": "UklGRjI=", "request_id": "r2"}
        conn.feed({"type": "voice.created", "voice_id": "v_two", "request_id": "r2"})
        conn.feed({"type": "voice.created", "voice_id": "v_one", "request_id": "r1"})
        assert await asyncio.wait_for(asyncio.gather(first, second), 5) == ["v_one", "v_two"]
        bad = asyncio.create_task(client.create_voice(b"x"))
        await asyncio.sleep(0)
        conn.feed({"type": "error", "code": "audio_too_short", "message": "m", "request_id": "r3"})
        with pytest.raises(ClonecastError, match="audio_too_short"):
            await asyncio.wait_for(bad, 5)
        await client.close()

    asyncio.run(main())


def test_pings_are_matched_by_request_id_and_in_order_from_a_server_that_does_not_echo():
    async def main():
        client, conn = await start()
        first, second, third = (asyncio.create_task(client.ping()) for _ in range(3))
        await asyncio.sleep(0)
        ids = [m["request_id"] for m in conn.sent_json()]
        assert [m["type"] for m in conn.sent_json()] == ["ping"] * 3 and len(set(ids)) == 3
        conn.feed({"type": "error", "code": "rate_limited", "message": "m", "request_id": ids[1]})
        conn.feed({"type": "pong", "t": 0.0, "request_id": ids[2]})
        with pytest.raises(ClonecastError, match="rate_limited"):
            await asyncio.wait_for(second, 5)
        assert await asyncio.wait_for(third, 5) >= 0 and not first.done()
        conn.feed({"type": "pong", "t": 0.0})  # no request_id (an older server): the oldest
        assert await asyncio.wait_for(first, 5) >= 0
        assert not client.errors  # the refusal went to its ping
        await client.close()

    asyncio.run(main())


def test_stream_sends_its_voice_once_and_flush_waits_for_flushed():
    def reply(conn, message):
        if message["type"] == "flush":
            conn.feed({"type": "flushed", "id": message["id"]}, *audio("s", 0, b"z", True))
            conn.feed(done("s"))

    async def main():
        client, conn = await start(reply)
        utt = client.open_stream("s", voice_id="v_1", output={"format": "pcm16"})
        await utt.append("Hello ")
        await utt.append("there.")
        await asyncio.wait_for(utt.flush(), 5)
        assert conn.sent_json()[:2] == [
            {
                "type": "append",
                "id": "s",
                "text": "Hello ",
                "voice_id": "v_1",
                "output": {"format": "pcm16"},
            },
            {"type": "append", "id": "s", "text": "there."},
        ]
        assert await asyncio.wait_for(utt.collect(), 5) == b"z"
        with pytest.raises(ValueError, match="flushed"):
            await utt.append("more")
        await client.close()

    asyncio.run(main())


def test_a_closed_connection_fails_running_utterances_with_the_reason():
    async def main():
        client, conn = await start()
        utt = client.speak("x")
        conn.feed({"type": "error", "code": "over_capacity", "message": "server full"})
        conn.server_close(4429)
        with pytest.raises(ClonecastError) as err:
            await asyncio.wait_for(utt.collect(), 5)
        assert err.value.code == "over_capacity" and "server full" in err.value.message
        with pytest.raises(ClonecastError, match="over_capacity"):
            client.speak("y")

    asyncio.run(main())


def test_connect_raises_the_servers_refusal():
    async def main():
        conn = FakeConnection()
        conn.feed({"type": "error", "code": "unauthorized", "message": "missing API key"})
        with pytest.raises(ClonecastError) as err:
            await AsyncClient.from_connection(conn)
        assert err.value.code == "unauthorized"

    asyncio.run(main())


def test_write_wav_writes_pcm16_mono(tmp_path):
    async def main():
        client, conn = await start()
        utt = client.speak("x")
        conn.feed(*audio("u1", 0, b"\x01\x00" * 10), *audio("u1", 1, b"\x02\x00" * 5, True))
        conn.feed(done("u1"))
        await asyncio.wait_for(utt.write_wav(tmp_path / "a.wav"), 5)
        with pytest.raises(ValueError, match="pcm16"):
            await client.speak("y", output={"format": "f32"}).write_wav(tmp_path / "b.wav")
        await client.close()

    asyncio.run(main())
    with wave.open(str(tmp_path / "a.wav")) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.getnframes() == 15


@pytest.fixture
def scripted_server():
    """A websockets server speaking just enough clonecast.v1; yields its URL and the
    Authorization headers it saw."""
    seen: list[str | None] = []

    async def handler(ws):
        seen.append(ws.request.headers.get("Authorization"))
        await ws.send(json.dumps(READY))
        async for raw in ws:
            message = json.loads(raw)
            if message["type"] == "voice.upload":
                payload = await ws.recv()
                created = {"voice_id": f"v_{len(payload)}", "request_id": message["request_id"]}
                await ws.send(json.dumps({"type": "voice.created", **created}))
            elif message["type"] == "ping":
                pong = {"type": "pong", "t": 0.0, "request_id": message["request_id"]}
                await ws.send(json.dumps(pong))
            elif message["type"] == "speak" and message.get("voice_id") == "v_bad":
                error = {"type": "error", "code": "unknown_voice", "message": "no such voice"}
                await ws.send(json.dumps({**error, "id": message["id"]}))
            elif message["type"] == "speak":
                for seq, last in ((0, False), (1, True)):
                    for frame in audio(message["id"], seq, b"\x00\x01" * 2400, last):
                        await ws.send(frame if isinstance(frame, bytes) else json.dumps(frame))
                await ws.send(json.dumps(done(message["id"], chunks=2)))

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def run():
        async with serve(handler, "127.0.0.1", 0) as server:
            holder["port"] = server.sockets[0].getsockname()[1]
            holder["stop"] = asyncio.Event()
            started.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"ws://127.0.0.1:{holder['port']}/v1/stream", seen
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(10)
    loop.close()


def test_sync_client_over_a_real_socket(scripted_server):
    url, seen = scripted_server
    with Client.connect(url, "k3y") as client:
        assert client.session_id == "s_test"
        voice = client.create_voice(b"1234", "words")
        utt = client.speak("Hi.", voice_id=voice)
        assert [c.seq for c in utt] == [0, 1] and utt.done["stats"]["chunks"] == 2
        assert len(client.speak("Again.").collect()) == 2 * 4800
        assert 0 < client.ping() < 5
        with pytest.raises(ClonecastError, match="unknown_voice"):
            client.speak("x", voice_id="v_bad").collect()
    assert seen == ["Bearer k3y"]


def _say_args(*argv):
    parser = argparse.ArgumentParser()
    add_say_parser(parser.add_subparsers())
    return parser.parse_args(["say", *argv])


def test_say_writes_the_wav_and_reports(scripted_server, tmp_path, capsys):
    url, _ = scripted_server
    ref = tmp_path / "ref.wav"
    ref.write_bytes(b"abc")
    out = tmp_path / "o" / "say.wav"
    args = _say_args("--url", url, "--text", "Hi.", "--reference", str(ref), "--out", str(out))
    assert say(args) == 0
    err = capsys.readouterr().err
    assert "voice: v_3" in err and "first audio" in err and "done: eos" in err
    with wave.open(str(out)) as wav:
        assert wav.getnframes() == 4800


def test_say_reports_server_and_connection_errors(scripted_server, tmp_path, capsys):
    url, _ = scripted_server
    out = str(tmp_path / "x.wav")
    assert say(_say_args("--url", url, "--text", "x", "--voice-id", "v_bad", "--out", out)) == 1
    assert "error: unknown_voice: no such voice" in capsys.readouterr().err
    dead = "ws://127.0.0.1:9/v1/stream"
    assert say(_say_args("--url", dead, "--text", "x", "--out", out)) == 1
    assert "error: connection_failed: cannot connect to ws://127.0.0.1:9" in capsys.readouterr().err
