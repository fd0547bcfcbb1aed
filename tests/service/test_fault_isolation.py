"""One bad request never harms the others, against the real server (its engine in a thread
of the test's process, so faults can be planted in it): a codec failure for one request, a
failure in one request's part of an engine step, a voice-store write that fails (a full
disk) each end only that request, with a clear error, while the streams beside it finish.
A whole step that fails ends that step's requests and serving goes on; a run of failed
steps means a broken device: the engine exits and is started again."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest

from engine.streaming import AudioStream
from tests.service.conftest import (
    b64,
    collect,
    frames_for,
    open_ws,
    reference_audio,
    run,
    scrape,
    speak,
    summed,
)

IDS = ("ok-1", "poison", "ok-2")


@pytest.fixture(scope="module")
def threaded(make_server):
    return make_server(engine_process=False)


def _stream_three(server, dur: float = 1.0) -> dict:
    async def main():
        async with open_ws(server.ws) as ws:
            for uid in IDS:
                await ws.send(speak(uid, f"Utterance {uid} speaks.", dur=dur))
            return await collect(ws, IDS, timeout=120)

    return run(main())


def _assert_only_poison_failed(utts: dict, dur: float, detail: str) -> None:
    poison = utts["poison"]
    assert poison.done is None and [e["code"] for e in poison.errors] == ["generation_failed"]
    assert detail in poison.errors[0]["message"], poison.errors
    for uid in ("ok-1", "ok-2"):
        utt = utts[uid]
        assert utt.errors == [] and utt.done["reason"] == "length", (uid, utt.errors)
        assert len(utt.payload) == frames_for(dur) * 1920  # every frame of its audio


def test_a_codec_failure_for_one_request_ends_only_that_request(threaded, monkeypatch):
    chunks = threaded.services.engine.audio.chunks
    launch = chunks._launch_batch

    def failing_for_poison(batch):
        if any("/poison/" in w.request_id for w in batch):
            raise RuntimeError("planted codec fault")
        return launch(batch)

    monkeypatch.setattr(chunks, "_launch_batch", failing_for_poison)
    _assert_only_poison_failed(_stream_three(threaded), 1.0, "planted codec fault")


def test_a_failure_in_one_requests_part_of_a_step_ends_only_that_request(threaded, monkeypatch):
    next_window = AudioStream.next_window

    def failing_for_poison(self, rows, finished):
        if "/poison/" in self.request_id and len(rows) > 24:  # mid-stream, after first audio
            raise ValueError("planted step fault")
        return next_window(self, rows, finished)

    monkeypatch.setattr(AudioStream, "next_window", failing_for_poison)
    utts = _stream_three(threaded)
    _assert_only_poison_failed(utts, 1.0, "planted step fault")
    assert utts["poison"].payload  # it had streamed before its fault


def test_failed_steps_fail_their_requests_and_a_run_of_them_restarts_the_engine(
    threaded, monkeypatch
):
    """A step that raises (batched work: which request caused it cannot be known) ends the
    requests of that step; three in a row end the engine thread, which is started again."""
    services = threaded.services
    runner = services.engine.runner
    launch = runner.launch
    failures = [0]

    def failing(sched):
        if failures[0] < 3:
            failures[0] += 1
            raise RuntimeError("planted device fault")
        return launch(sched)

    old_worker = services.worker
    monkeypatch.setattr(runner, "launch", failing)

    async def main():
        failed = []
        async with open_ws(threaded.ws) as ws:
            for uid in ("hit-1", "hit-2", "hit-3"):  # one failed step each, in a row
                await ws.send(speak(uid, "Hit by the fault.", dur=1.0))
                failed.append((await collect(ws, [uid], timeout=60))[uid])
            deadline = asyncio.get_running_loop().time() + 120
            while services.worker is old_worker or not services.is_ready:
                assert asyncio.get_running_loop().time() < deadline, "no restart"
                await asyncio.sleep(0.1)
            await ws.send(speak("after", "Served again.", dur=0.4))
            return failed, (await collect(ws, ["after"], timeout=120))["after"]

    failed, after = run(main())
    for hit in failed:
        assert [e["code"] for e in hit.errors] == ["generation_failed"]
        assert "planted device fault" in hit.errors[0]["message"]
    assert services.worker is not old_worker and services.worker.alive
    assert after.errors == [] and len(after.payload) == frames_for(0.4) * 1920
    assert summed(scrape(threaded), "clonecast_engine_restarts_total") >= 1


def test_a_voice_store_that_cannot_be_written_refuses_that_voice_only(make_server, tmp_path):
    server = make_server(extra={"voice_store": tmp_path / "voices.sqlite3"})
    db = server.services.voices.db._db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("beside", "A stream beside the failing write.", dur=1.0))
            async with httpx.AsyncClient() as http:
                refused = await http.post(
                    server.http + "/v1/voices",
                    json={"audio_b64": b64(reference_audio(15.0)), "transcript": "a long one"},
                    timeout=120,
                )
            return refused, (await collect(ws, ["beside"], timeout=120))["beside"]

    refused, beside = run(main())
    assert refused.status_code == 507, refused.text
    assert refused.json()["error"]["code"] == "voice_store_error"
    assert "full" in refused.json()["error"]["message"]
    assert beside.errors == [] and len(beside.payload) == frames_for(1.0) * 1920
    assert httpx.get(server.http + "/v1/voices", timeout=10).json()["voices"] == []
    db.execute("PRAGMA max_page_count = 1073741823")  # space again: the same upload works
    again = httpx.post(
        server.http + "/v1/voices",
        json={"audio_b64": b64(reference_audio(15.0)), "transcript": "a long one"},
        timeout=120,
    )
    assert again.status_code == 201, again.text
    with pytest.raises(sqlite3.Error):  # the planted limit was real: sqlite refuses too
        db.execute(f"PRAGMA max_page_count = {pages}")
        db.execute("INSERT INTO voices VALUES ('x', NULL, NULL, NULL, 1, zeroblob(90000), 0)")
