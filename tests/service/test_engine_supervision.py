"""Engine supervision (service/engine_supervisor.py) against the real server: `kill -9` of
the engine process while several clients stream ends exactly the utterances in flight with
`generation_failed`, `/ready` answers 503 while a new engine starts, then serving resumes on
the same connections without a server restart, with the voices kept and the restart
counted; restarts are bounded (the server gives up and says why). The policy's arithmetic
is tested on its own; with restarts off, test_engine_process.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from service.engine_supervisor import EngineSupervisor, RestartPolicy
from tests.service.conftest import (
    collect,
    open_ws,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
    summed,
)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)
    return value


def _ready_status(server) -> int:
    return httpx.get(server.http + "/ready", timeout=10).status_code


def test_the_policy_doubles_its_wait_up_to_its_cap_and_refuses_nonsense():
    policy = RestartPolicy(max_attempts=5, first_delay_s=1.0, max_delay_s=5.0)
    assert [policy.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError):
        RestartPolicy(max_attempts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=10.0, max_delay_s=1.0)


def test_an_engine_that_served_long_enough_resets_the_count():
    class FakeServices:
        stopping = draining = False
        is_ready, progress = True, "ready"

    now = [0.0]
    policy = RestartPolicy(stable_s=60.0)
    supervisor = EngineSupervisor(FakeServices(), None, policy, lambda: now[0])
    supervisor.attempts = 4

    async def exit_at(t: float) -> int:
        now[0] = t
        supervisor.engine_exited("boom")
        seen = supervisor.attempts
        await supervisor.stop()  # the restart itself is not under test here
        return seen

    assert run(exit_at(10.0)) == 4  # served 10 s: the count goes on
    supervisor.engine_started()
    assert run(exit_at(100.0)) == 0  # served 90 s: a fresh count


def test_kill_9_mid_stream_fails_only_what_was_in_flight_and_the_engine_comes_back(
    make_server,
):
    server = make_server(max_num_seqs=8)
    services = server.services
    old_pid = services.worker.pid
    voice = httpx.post(
        server.http + "/v1/voices",
        json={"audio_b64": _b64(reference_audio(2.0)), "transcript": "kept across restarts"},
        timeout=120,
    ).json()["voice_id"]

    async def client(index: int, started: asyncio.Event, killed: asyncio.Event):
        async with open_ws(server.ws) as ws:
            await ws.send(speak(f"long-{index}", "A long sentence to keep streaming.", dur=30))
            await recv_until(ws, "audio", timeout=120, id=f"long-{index}")
            assert isinstance(await ws.recv(), bytes)  # the frame of that audio message
            started.set()
            await killed.wait()
            failed = await collect(ws, [f"long-{index}"], timeout=60)
            # the same connection, once the engine is back: a cloned voice streams again
            await _wait_ready_async(server)
            await ws.send(speak(f"after-{index}", "Back again.", dur=0.4, voice_id=voice))
            after = await collect(ws, [f"after-{index}"], timeout=120)
            return failed[f"long-{index}"], after[f"after-{index}"]

    async def main():
        events = [(asyncio.Event(), asyncio.Event()) for _ in range(3)]
        tasks = [asyncio.create_task(client(i, *ev)) for i, ev in enumerate(events)]
        for started, _ in events:
            await asyncio.wait_for(started.wait(), 120)
        os.kill(old_pid, signal.SIGKILL)
        for _, killed in events:
            killed.set()
        # while the new engine loads, /ready says so and new work is refused, not lost (the
        # server notices the death within engine_client.EXIT_POLL_S: asked from the kill on)
        deadline = time.monotonic() + 30
        while True:
            ready = await asyncio.to_thread(httpx.get, server.http + "/ready", timeout=10)
            if ready.status_code != 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        health = await asyncio.to_thread(httpx.get, server.http + "/health", timeout=10)
        return await asyncio.gather(*tasks), ready, health

    results, ready, health = run(main())
    for failed, after in results:
        assert failed.done is None and [e["code"] for e in failed.errors] == ["generation_failed"]
        assert "engine process exited" in failed.errors[0]["message"]
        assert after.errors == [] and after.done["reason"] in ("eos", "length")
        assert after.payload  # audio in the kept voice
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    assert "restarting the engine" in ready.json()["progress"]
    assert health.status_code == 200 and health.json()["status"] == "restarting"
    assert services.worker.pid not in (None, old_pid) and services.worker.alive
    assert _ready_status(server) == 200
    metrics = scrape(server)
    assert summed(metrics, "clonecast_engine_restarts_total") == 1
    assert summed(metrics, "clonecast_engine_up") == 1


def test_a_request_while_the_engine_restarts_is_refused_with_not_ready(make_server):
    server = make_server()
    services = server.services
    supervisor = services.engines.slots[0].supervisor
    supervisor.policy = RestartPolicy(max_attempts=1, first_delay_s=3.0)
    os.kill(services.worker.pid, signal.SIGKILL)
    _wait_for(lambda: supervisor.restarting, 20, "no restart began")
    r = httpx.post(
        server.http + "/v1/audio/speech",
        json={"input": "too early", "max_duration_s": 0.4, "response_format": "pcm"},
        timeout=30,
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert "restarting" in r.json()["error"]["message"]

    async def ws_refused():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("early", dur=0.4))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    message = run(ws_refused())  # the connection itself is taken: it outlives the restart
    assert message["type"] == "error" and message["code"] == "not_ready", message
    _wait_for(lambda: _ready_status(server) == 200, 180, "the engine did not come back")


def test_restarts_are_bounded_and_the_server_says_why_it_gave_up(make_server, monkeypatch):
    server = make_server()
    services = server.services
    services.engines.slots[0].supervisor.policy = RestartPolicy(max_attempts=2, first_delay_s=0.1)
    gave_up = []
    services.on_load_failed = lambda: gave_up.append(services.load_error)

    def broken_start(slot):
        raise RuntimeError("no GPU left")

    monkeypatch.setattr(services.engines, "start", broken_start)
    os.kill(services.worker.pid, signal.SIGKILL)
    _wait_for(lambda: gave_up, 30, "the supervisor did not give up")
    assert "2 restarts in a row" in gave_up[0] and "no GPU left" in gave_up[0]
    r = httpx.get(server.http + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "failed"
    assert _ready_status(server) == 503
    assert summed(scrape(server), "clonecast_engine_restarts_total") == 0


async def _wait_ready_async(server, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while (await http.get(server.http + "/ready", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not come back"
            await asyncio.sleep(0.2)


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def test_an_append_utterance_waiting_for_text_outlives_its_engine(make_server):
    """Its text so far all spoken, nothing of it runs when the engine dies: more text while the
    new engine starts ends it with not_ready (retryable); once one is ready, more text is
    spoken there, and the utterance ends as usual."""
    server = make_server()
    services = server.services
    supervisor = services.engines.slots[0].supervisor
    supervisor.policy = RestartPolicy(max_attempts=1, first_delay_s=3.0)
    params = {"max_duration_s": 0.4, "seed": 4}

    async def main():
        async with open_ws(server.ws) as ws:
            for uid in ("early", "later"):
                opening = {"type": "append", "id": uid, "text": "First. ", "params": params}
                await ws.send(json.dumps(opening))
                await recv_until(ws, "audio", timeout=120, id=uid)
            await asyncio.to_thread(
                _wait_for,
                lambda: (
                    len(services.utterances) == 2
                    and not any(u.active_request_ids() for u in services.utterances)
                ),
                60,
                "the first sentences were not spoken",
            )
            os.kill(services.worker.pid, signal.SIGKILL)
            await asyncio.to_thread(_wait_for, lambda: supervisor.restarting, 20, "no restart")
            await ws.send(json.dumps({"type": "append", "id": "early", "text": "Too soon. "}))
            refused = await recv_until(ws, "error", timeout=30, id="early")
            await _wait_ready_async(server)
            await ws.send(json.dumps({"type": "append", "id": "later", "text": "Back. "}))
            await ws.send(json.dumps({"type": "flush", "id": "later"}))
            done = await recv_until(ws, "done", timeout=120, id="later")
            return refused, done

    (refused, _), (done, before_done) = run(main())
    assert refused["code"] == "not_ready" and "no engine is ready" in refused["message"]
    segments = [m["index"] for m in before_done if isinstance(m, dict) and m["type"] == "segment"]
    assert segments == [1]  # the second sentence, spoken by the new engine
    assert done["reason"] in ("eos", "length")
    assert _ready_status(server) == 200
