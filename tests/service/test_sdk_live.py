"""The SDK (async and sync) and `clonecast say` against the real server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from clonecast_client import AsyncClient, Client, ClonecastError
from tests.service.conftest import reference_audio, run

ROOT = Path(__file__).resolve().parents[2]


def test_async_client_voice_speak_cancel_and_wav(server, tmp_path):
    async def go():
        client = await AsyncClient.connect(server.ws)
        async with client:
            assert client.model_untrained is True
            voice = await client.create_voice(reference_audio(2.0), "a reference")
            utt = client.speak(
                "Hello from the SDK.", voice_id=voice, params={"seed": 1, "max_duration_s": 1.2}
            )
            chunks = [c async for c in utt]
            assert chunks[0].seq == 0 and len(chunks[0].data) == 15360
            assert sum(len(c.data) for c in chunks) == 30 * 1920 and chunks[-1].last
            assert utt.done["reason"] == "length" and utt.done["stats"]["chunks"] == 2
            long = client.speak(
                "A long one to cut short.", params={"seed": 2, "max_duration_s": 20}
            )
            first = await long.__anext__()
            assert first.data
            await long.cancel()
            assert [c async for c in long] == []
            path = tmp_path / "sdk.wav"
            await client.speak("Into a file.", params={"seed": 3, "max_duration_s": 0.6}).write_wav(
                path
            )
            with wave.open(str(path)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (24000, 1, 15 * 960)
            with pytest.raises(ClonecastError) as err:
                await client.speak("x", voice_id="v_missing").collect()
            assert err.value.code == "unknown_voice"

    run(go())


def test_a_refused_ping_fails_alone_and_the_others_get_their_pongs(server):
    """Over the connection's burst (100 messages at once): the pings refused with
    rate_limited raise it, each accepted one returns its own round trip, and the connection
    goes on (the refusals are matched by request_id, not by order)."""

    async def go():
        async with await AsyncClient.connect(server.ws) as client:
            results = await asyncio.gather(
                *(client.ping() for _ in range(110)), return_exceptions=True
            )
            refused = [r for r in results if isinstance(r, BaseException)]
            assert 1 <= len(refused) <= 10, results
            assert all(isinstance(r, ClonecastError) and r.code == "rate_limited" for r in refused)
            assert not client.errors  # each refusal went to its ping, none left unmatched
            await asyncio.sleep(0.5)  # the bucket refills
            assert 0 < await client.ping() < 5

    run(go())


def test_sync_client_streams_concurrently_and_incrementally(server):
    with Client.connect(server.ws) as client:
        a = client.speak("First.", params={"seed": 4, "max_duration_s": 0.5})
        b = client.speak("Second.", params={"seed": 5, "max_duration_s": 0.5})
        assert len(a.collect()) == 13 * 1920 and len(b.collect()) == 13 * 1920
        stream = client.open_stream(params={"seed": 6, "max_duration_s": 0.4})
        stream.append("One sentence. ")
        stream.append("And another")
        stream.flush()
        audio = stream.collect()
        assert len(audio) == 2 * 10 * 1920 and stream.done["stats"]["segments"] == 2


def test_say_cli_writes_a_wav(server, tmp_path):
    ref = tmp_path / "ref.wav"
    ref.write_bytes(reference_audio(2.0))
    out = tmp_path / "say.wav"
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "say",
        "--url",
        server.ws,
        "--reference",
        str(ref),
        "--transcript",
        "a reference",
        "--text",
        "Hello from the command line.",
        "--seed",
        "7",
        "--max-duration",
        "0.8",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as w:
        assert w.getnframes() == 20 * 960
    assert "\r" not in result.stderr  # not a terminal: no progress line rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.wav", "say.wav"]  # no partial
    unknown = [
        sys.executable,
        "-m",
        "service.cli",
        "say",
        "--url",
        server.ws,
        "--voice-id",
        "v_nope",
        "--text",
        "x",
        "--out",
        str(tmp_path / "x.wav"),
    ]
    bad = subprocess.run(unknown, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "unknown_voice" in bad.stderr


def test_a_failed_say_leaves_no_file(server, tmp_path):
    """The text is refused after the file was opened (its speak fails): nothing is left."""
    out = tmp_path / "failed.wav"
    cmd = [
        sys.executable, "-m", "service.cli", "say", "--url", server.ws,
        "--text", "say <|audio|> now", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "error: bad_request" in result.stderr
    assert list(tmp_path.iterdir()) == []
