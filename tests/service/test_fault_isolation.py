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
        # next_window runs only when a chunk is due, so this fires at the second chunk (or
        # the last): mid-stream, after first audio
        if "/poison/" in self.request_id and len(rows) > 24:
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


def test_a_broken_engine_is_noticed_while_commands_keep_coming():
    """Three failed steps in a row end the engine thread; the command loop leaves (the
    engine process then exits for its supervisor) even when it is never idle: a steady flow
    of requests would otherwise wait forever on an engine that no longer steps."""
    import queue
    import threading

    from engine import SamplingParams
    from service.engine_channel import AddRequest
    from service.engine_host import MAX_FAILED_STEPS, EngineHost

    class Events(list):
        put = list.append

    class BrokenEngine:  # steps always fail, as on a device whose context is lost
        stats = None
        steps = 0

        def has_unfinished(self):
            return True

        def step(self, emit=None):
            self.steps += 1
            raise RuntimeError("device lost")

        def add_request(self, *args, **kwargs):
            pass

        def abort(self, request_id):
            return True

        def take_observations(self):
            raise AssertionError("a failed step reports nothing")

    engine = BrokenEngine()
    host = EngineHost(engine, Events())
    host._thread.start()
    commands: queue.SimpleQueue = queue.SimpleQueue()
    flowing = threading.Event()

    def feed():  # a request every 10 ms: the loop never waits the idle poll out
        n = 0
        while not flowing.is_set():
            commands.put(AddRequest(f"r{n}", "hi", None, SamplingParams(max_rows=4)))
            n += 1
            flowing.wait(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    done = []
    server = threading.Thread(target=lambda: done.append(host.serve(commands)), daemon=True)
    server.start()
    server.join(timeout=20)
    flowing.set()
    assert done == [True], "the command loop kept serving a dead engine thread"
    assert host.broken and engine.steps == MAX_FAILED_STEPS
    host.stop()


def test_an_engine_that_finishes_starting_after_a_stop_is_stopped_at_once(model_cache):
    """A restart (or the first load) still loading when the server stops: once loaded, the
    engine is stopped rather than left holding its device with nobody to stop it."""
    import multiprocessing

    from service.app import Services
    from service.config import ServiceSettings
    from service.engine_client import EngineExited

    before = {p.pid for p in multiprocessing.active_children()}  # other tests' servers
    services = Services(ServiceSettings(device="cpu", cache_dir=model_cache))
    slot = services.engines.slots[0]
    original = services.engines.make_spec

    def spec_then_stop(device):  # the stop arrives while the engine loads
        services.stopping = True
        return original(device)

    services.engines.make_spec = spec_then_stop
    with pytest.raises(EngineExited, match="stopped while the engine started"):
        services.engines.start(slot)
    assert slot.client is None
    assert {p.pid for p in multiprocessing.active_children()} <= before
