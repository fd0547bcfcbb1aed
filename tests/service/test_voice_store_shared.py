"""Two voice stores on one PostgreSQL database, as two servers have them (service/voices.py
over service/voice_db_postgres.py): what one creates the other finds at once, by voice_id and
by name; what one deletes the other refuses once its answer is `recheck_s` old; a name taken
through one is a `name_conflict` through the other; `max_voices` counts the database's voices;
an unreadable database leaves the voices a server holds speaking. Then the same with two
real servers on one database, over the WebSocket and HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine import VoiceReference
from service.app import Services
from service.auth import Caller
from service.config import ServiceSettings
from service.voice_db import StoreReadError
from service.voice_db_postgres import PostgresVoiceDatabase
from service.voices import RECHECK_S, VoiceError, VoiceStore
from tests.postgres_server import PASSWORD
from tests.serve_process import start_serve, stop_serve

from .conftest import b64, collect, expect_error, open_ws, recv_until, reference_audio, run, speak

REF = VoiceReference(tuple((i % 1024, 1, 2, 3, 4, 5, 6, 1023) for i in range(30)), "Said.")
OTHER = VoiceReference(((7,) * 8,) * 5, None)
ALICE, BOB = Caller("k_alice", name="alice"), Caller("k_bob", name="bob")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def two(postgres):
    """Stores A and B on one database, with one clock to move."""
    url, clock, stores = postgres.new_database(), Clock(), []
    for _ in range(2):
        stores.append(VoiceStore(3, PostgresVoiceDatabase(url), recheck_s=1.0, clock=clock))
    yield *stores, clock
    for store in stores:
        store.db.close()


def test_a_voice_created_through_one_is_found_through_the_other_at_once(two):
    a, b, _ = two
    assert b.get("carol") is None  # B has looked before: nothing remembered of that
    created = a.put("v_1", REF, name="carol", owner="k_alice")
    for key in ("carol", "v_1"):
        found = b.get(key, ALICE)
        assert found == created and found.reference == REF and found.kept
        assert b.get(key, BOB) is None  # still Alice's own
    assert [v.voice_id for v in b.list(ALICE)] == ["v_1"] and b.list(BOB) == []
    a.put("v_2", OTHER, owner="k_alice")
    assert b.get("v_2", ALICE).name is None
    a.put("v_2", OTHER, name="dora", owner="k_alice")  # named later, through A
    assert b.get("v_2", ALICE).name is None  # B's answer of a moment ago stands...
    assert b.get("dora", ALICE).voice_id == "v_2"  # ...and the name is asked anew


def test_a_voice_deleted_through_one_is_refused_by_the_other_within_recheck_s(two):
    a, b, clock = two
    a.put("v_1", REF, name="erin")
    assert b.get("erin") is not None and b.get("v_1") is not None
    assert a.delete("erin") and a.get("erin") is None
    clock.now += 0.5
    assert b.get("erin") is not None  # within recheck_s: B's answer stands (the bound)
    clock.now += 0.6
    assert b.get("erin") is None and b.get("v_1") is None
    assert not b.delete("v_1") and b.list() == []


def test_a_name_taken_through_one_is_a_name_conflict_through_the_other(two):
    a, b, _ = two
    b.put("v_9", OTHER)  # B holds a voice of its own before A names another
    a.put("v_1", REF, name="fay")
    with pytest.raises(VoiceError) as conflict:
        b.put("v_2", OTHER, name="fay")
    assert conflict.value.code == "name_conflict"
    with pytest.raises(VoiceError) as renamed:
        b.put("v_9", OTHER, name="fay")
    assert renamed.value.code == "name_conflict"
    assert b.get("fay").voice_id == "v_1" and b.get("v_2") is None
    assert b.put("v_2", OTHER, name="fay", owner="k_bob").name == "fay"  # Bob's own "fay"


def test_max_voices_counts_the_voices_of_every_server(two):
    a, b, _ = two
    for i in range(3):
        a.put(f"v_{i}", REF)
    with pytest.raises(VoiceError) as full:
        b.put("v_x", OTHER)
    assert full.value.code == "voice_store_full"
    b.put("v_inline", OTHER, keep=False)  # inline voices: memory only, not counted
    assert b.delete("v_0")
    assert b.put("v_x", OTHER).kept and a.get("v_x") is not None


def test_an_unreadable_database_leaves_the_held_voices_speaking(two, monkeypatch, caplog):
    a, b, clock = two
    a.put("v_1", REF, name="gus")
    assert b.get("gus") is not None

    def unreachable(*args):
        raise StoreReadError("the voice store postgresql://db/voices could not be read: gone")

    monkeypatch.setattr(b.db, "matching", unreachable)
    monkeypatch.setattr(b.db, "count", unreachable)
    clock.now += 5
    assert b.get("gus").voice_id == "v_1" and b.get("v_1") is not None
    assert b.get("v_unknown") is None
    with pytest.raises(VoiceError) as refused:
        b.put("v_2", OTHER)
    assert refused.value.code == "voice_store_error"
    assert sum("could not be read" in r.getMessage() for r in caplog.records) == 1


def _speak_through(server, key: str, uid: str) -> dict:
    """One short utterance in `key`'s voice over the WebSocket: its Utt (done or error)."""

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak(uid, "Shared.", dur=0.4, seed=3, voice_id=key))
            return (await collect(ws, [uid]))[uid]

    return run(main())


def test_a_voice_created_through_one_server_is_spoken_and_deleted_through_another(
    make_server, postgres
):
    url = postgres.new_database()
    a, b = (make_server(extra={"voice_store": url}) for _ in range(2))

    async def create():
        async with open_ws(a.ws) as ws:
            audio = b64(reference_audio(2.0, f0=170.0))
            await ws.send(json.dumps({"type": "voice.create", "name": "hana", "audio_b64": audio}))
            return (await recv_until(ws, "voice.created"))[0]

    created = run(create())
    by_name, by_id = _speak_through(b, "hana", "s1"), _speak_through(b, created["voice_id"], "s2")
    assert by_name.done is not None and by_id.done is not None, (by_name.errors, by_id.errors)
    assert by_name.payload == by_id.payload == _speak_through(a, "hana", "s3").payload
    listed = httpx.get(b.http + "/v1/voices", timeout=30).json()["voices"]
    assert [v["name"] for v in listed] == ["hana"]

    assert httpx.delete(a.http + "/v1/voices/hana", timeout=30).status_code == 204
    deadline = time.monotonic() + RECHECK_S + 5  # B may trust its last answer RECHECK_S
    while (refused := _speak_through(b, "hana", "s4")).done is not None:
        assert time.monotonic() < deadline, "B still speaks a voice deleted through A"
    assert [e["code"] for e in refused.errors] == ["unknown_voice"]
    assert httpx.get(b.http + "/v1/voices/" + created["voice_id"], timeout=30).status_code == 404


def test_a_name_taken_through_one_server_is_a_name_conflict_through_another(make_server, postgres):
    url = postgres.new_database()
    a, b = (make_server(extra={"voice_store": url}) for _ in range(2))
    body = {"audio_b64": b64(reference_audio(2.0, f0=150.0)), "name": "ivy"}
    assert httpx.post(a.http + "/v1/voices", json=body, timeout=60).status_code == 201
    other = {"audio_b64": b64(reference_audio(1.5, f0=210.0)), "name": "ivy"}
    taken = httpx.post(b.http + "/v1/voices", json=other, timeout=60)
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "name_conflict"

    async def over_the_socket():
        async with open_ws(b.ws) as ws:
            await ws.send(json.dumps({"type": "voice.create", "request_id": "r", **other}))
            return await expect_error(ws, "name_conflict")

    assert run(over_the_socket())["request_id"] == "r"
    [shown] = httpx.get(b.http + "/v1/voices", timeout=30).json()["voices"]
    assert shown["name"] == "ivy" and shown["frames"] == 50  # A's 2 s recording, not B's


def test_a_server_whose_shared_store_cannot_be_reached_says_where_without_the_password(
    postgres, caplog
):
    url = f"postgresql://clonecast:{PASSWORD}@127.0.0.1:{postgres.port}/no_such_db"
    services = Services(ServiceSettings(device="cpu", voice_store=url))
    run(services.load())  # what the server does first: the store opens before any engine
    said = f"postgresql://127.0.0.1:{postgres.port}/no_such_db cannot be opened"
    assert said in services.load_error and "\n" not in services.load_error
    [line] = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert said in line and PASSWORD not in line and PASSWORD not in caplog.text


def test_clonecast_serve_on_a_shared_store_never_logs_its_password(postgres, tmp_path):
    """At trace level, through a voice's whole life and a shutdown."""
    url = postgres.new_database()
    server, http, log = start_serve(tmp_path, "--log-level", "trace", CLONECAST_VOICE_STORE=url)
    try:
        body = {"audio_b64": b64(reference_audio(2.0, f0=160.0)), "name": "jude"}
        assert httpx.post(http + "/v1/voices", json=body, timeout=60).status_code == 201
        speech = {"input": "Hi.", "voice": "jude", "max_duration_s": 0.3, "response_format": "pcm"}
        assert httpx.post(http + "/v1/audio/speech", json=speech, timeout=60).status_code == 200
        assert httpx.delete(http + "/v1/voices/jude", timeout=30).status_code == 204
    finally:
        stop_serve(server)
    text = log.read_text()
    assert "clonecast ready" in text and PASSWORD not in text
