"""Several engines in one server (service/engines.py, service/engine_router.py) against the
real server with two CPU engine processes: `/ready` counts them, utterances spread over
both, utterances of one voice land on the engine that holds its prefix (and reuse it
there), and killing one engine's process ends only the streams on it while the other keeps
streaming and `/ready` stays 200; the dead engine comes back on its own. The router's
policy is tested on its own."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

from service.engine_router import EngineRouter, EngineSlot, RoutingPolicy
from tests.service.conftest import (
    b64,
    collect,
    open_ws,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
)


@dataclass
class FakeClient:
    in_flight: int = 0
    alive: bool = True


def _slots(*loads: int) -> list[EngineSlot]:
    return [
        EngineSlot(i, "cpu", client=FakeClient(load), warmed=True) for i, load in enumerate(loads)
    ]


def test_the_router_prefers_the_voices_engine_unless_it_is_clearly_busier():
    slots = _slots(0, 0)
    router = EngineRouter(slots, RoutingPolicy(affinity_slack=2))
    first, reason = router.pick("v_a")
    assert reason == "least_loaded"
    first.client.in_flight = 2  # busier by 2: still within the slack
    assert router.pick("v_a") == (first, "affinity")
    first.client.in_flight = 3  # busier by 3: the other engine takes it, and is its home now
    other, reason = router.pick("v_a")
    assert other is not first and reason == "least_loaded"
    assert router.pick("v_a") == (other, "affinity")
    other.client.alive = False  # a dead home is never chosen
    assert router.pick("v_a") == (first, "least_loaded")
    other.client.alive, first.client.in_flight = True, 1
    off = EngineRouter(slots, RoutingPolicy(affinity=False))  # affinity off: loads decide
    off.pick("v_b")
    assert off.pick("v_b") == (other, "least_loaded")


def test_equal_loads_take_turns_and_no_ready_engine_is_none():
    slots = _slots(0, 0, 0)
    router = EngineRouter(slots, RoutingPolicy())
    assert [router.pick(None)[0].index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    for slot in slots:
        slot.warmed = False
    assert router.pick(None) is None
    with pytest.raises(ValueError):
        RoutingPolicy(affinity_slack=-1)


@pytest.fixture(scope="module")
def two(make_server):
    return make_server(max_num_seqs=8, extra={"engines": 2})


def _routed(server) -> dict[tuple[str, str], float]:
    metrics = scrape(server)
    out = {}
    for engine in ("0", "1"):
        for reason in ("affinity", "least_loaded"):
            key = f'clonecast_engine_routed_total{{engine="{engine}",reason="{reason}"}}'
            out[engine, reason] = metrics[key]
    return out


def test_two_engines_are_two_processes_and_ready_counts_them(two):
    slots = two.services.engines.slots
    pids = {slot.client.pid for slot in slots}
    assert len(pids) == 2 and os.getpid() not in pids
    body = httpx.get(two.http + "/ready", timeout=10).json()
    assert body["engines"] == {"ready": 2, "total": 2}
    metrics = scrape(two)
    assert metrics['clonecast_engine_up{engine="0"}'] == metrics['clonecast_engine_up{engine="1"}']
    assert metrics['clonecast_engine_up{engine="0"}'] == 1


def test_utterances_spread_over_the_engines(two):
    before = _routed(two)
    ids = [f"spread-{i}" for i in range(4)]

    async def main():
        async with open_ws(two.ws) as ws:
            for uid in ids:
                await ws.send(speak(uid, "Spread me around.", dur=1.0))
            return await collect(ws, ids, timeout=120)

    utts = run(main())
    assert all(u.done is not None and u.payload for u in utts.values())
    after = _routed(two)
    per_engine = [after[e, "least_loaded"] - before[e, "least_loaded"] for e in ("0", "1")]
    assert per_engine == [2, 2]  # four at once, none with a voice: two each


def test_one_voices_utterances_go_to_the_engine_that_holds_its_prefix(two):
    created = httpx.post(
        two.http + "/v1/voices",
        json={"audio_b64": b64(reference_audio(3.0)), "transcript": "the affinity voice"},
        timeout=120,
    )
    voice = created.json()["voice_id"]
    slots = two.services.engines.slots
    cached_before = [s.client.stats.num_prefix_cached_tokens for s in slots]
    before = _routed(two)

    async def main():
        async with open_ws(two.ws) as ws:
            for i in range(3):  # one after another: the engines are never clearly unequal
                await ws.send(speak(f"aff-{i}", "Same voice again.", dur=0.4, voice_id=voice))
                utt = (await collect(ws, [f"aff-{i}"], timeout=120))[f"aff-{i}"]
                assert utt.done is not None, utt.errors

    run(main())
    after = _routed(two)
    grew = {k: after[k] - before[k] for k in after}
    [home] = [e for e in ("0", "1") if grew[e, "least_loaded"] == 1]  # the first one
    assert grew[home, "affinity"] == 2 and sum(grew.values()) == 3
    time.sleep(0.3)  # the engines' statistics come with their next report
    cached_after = [s.client.stats.num_prefix_cached_tokens for s in slots]
    reused = [a - b for a, b in zip(cached_after, cached_before, strict=True)]
    assert reused[int(home)] > 0 and reused[1 - int(home)] == 0


def test_killing_one_engine_ends_only_its_streams(two):
    services = two.services
    ids = [f"kill-{i}" for i in range(4)]

    async def main():
        async with open_ws(two.ws) as ws:
            for uid in ids:
                await ws.send(speak(uid, "A long stream on some engine.", dur=30))
            for uid in ids:  # all four stream before the kill
                await recv_until(ws, "audio", timeout=120, id=uid)
                assert isinstance(await ws.recv(), bytes)
            slots = services.engines.slots
            on_engine = [
                {uid for uid in ids if any(f"/{uid}/" in w for w in s.client._wire)} for s in slots
            ]
            victim = slots[1]
            os.kill(victim.client.pid, signal.SIGKILL)
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient() as http:  # the other engine still serves
                ready = await http.get(two.http + "/ready", timeout=10)
            utts = await collect(ws, ids, timeout=180)  # to a done or an error each
            return on_engine, utts, ready

    on_engine, utts, ready = run(main())
    assert len(on_engine[0]) == 2 and len(on_engine[1]) == 2
    for uid in on_engine[1]:
        assert [e["code"] for e in utts[uid].errors] == ["generation_failed"], uid
    for uid in on_engine[0]:  # streamed on to their end
        assert utts[uid].errors == [] and utts[uid].done is not None, uid
        # past the kill: more than the first chunk (the random model may end before 30 s)
        assert len(utts[uid].payload) > 2 * 8 * 1920, uid
    assert ready.status_code == 200 and ready.json()["engines"] == {"ready": 1, "total": 2}
    deadline = time.monotonic() + 180
    while services.engines.num_ready < 2:
        assert time.monotonic() < deadline, "the killed engine did not come back"
        time.sleep(0.2)
    metrics = scrape(two)
    assert metrics['clonecast_engine_restarts_total{engine="1"}'] == 1
    assert metrics['clonecast_engine_restarts_total{engine="0"}'] == 0


def test_an_engine_that_fails_every_restart_is_left_out_and_the_other_serves(two, monkeypatch):
    """Kept last: it leaves one engine of the module's server given up."""
    from service.engine_supervisor import RestartPolicy

    services = two.services
    victim = services.engines.slots[1]
    victim.supervisor.policy = RestartPolicy(max_attempts=2, first_delay_s=0.1)
    victim.supervisor.attempts = 0  # the kill test's restart was less than a minute ago
    gave_up = []
    monkeypatch.setattr(services, "on_load_failed", lambda: gave_up.append(True))
    start = services.engines.start

    def failing_for_the_victim(slot):
        if slot is victim:
            raise RuntimeError("its GPU is gone")
        return start(slot)

    monkeypatch.setattr(services.engines, "start", failing_for_the_victim)
    os.kill(victim.client.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim.failed is None:
        assert time.monotonic() < deadline, "the engine was not given up"
        time.sleep(0.1)
    assert "its GPU is gone" in victim.failed and gave_up == []  # the server goes on
    ready = httpx.get(two.http + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["engines"] == {"ready": 1, "total": 2}
    assert httpx.get(two.http + "/health", timeout=10).json()["status"] == "ok"

    async def main():
        async with open_ws(two.ws) as ws:
            await ws.send(speak("left", "One engine left.", dur=0.4))
            return (await collect(ws, ["left"], timeout=120))["left"]

    utt = run(main())
    assert utt.errors == [] and utt.done is not None and utt.payload
