"""Voices that last (service/voices.py, service/voice_db_sqlite.py): created on purpose they
are kept until deleted and persist in SQLite across restarts (codes, name, transcript,
creation time); inline voices stay in memory; a full store refuses rather than evicts; names
are unique and usable wherever a voice_id is; a directory of voices is registered at start."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from engine import VoiceReference
from service.voice_db_sqlite import SqliteVoiceDatabase
from service.voices import VoiceError, VoiceStore, check_name

from .conftest import b64, collect, open_ws, recv_until, reference_audio, run, speak

REF = VoiceReference(tuple((i % 1024, 1, 2, 3, 4, 5, 6, 1023) for i in range(30)), "Said.")
OTHER = VoiceReference(((7,) * 8,) * 5, None)


def test_kept_voices_persist_and_inline_ones_do_not(tmp_path):
    path = tmp_path / "voices.sqlite3"
    store = VoiceStore(10, SqliteVoiceDatabase(path))
    kept = store.put("v_a", REF, name="alice")
    store.put("v_b", OTHER, keep=False)
    store.db.close()
    again = VoiceStore(10, SqliteVoiceDatabase(path))
    [loaded] = again.list()
    assert loaded == kept and loaded.reference.codes == REF.codes and loaded.name == "alice"
    assert again.get("alice") == loaded and again.get("v_b") is None
    assert again.delete("alice") and again.get("v_a") is None
    again.db.close()
    assert VoiceStore(10, SqliteVoiceDatabase(path)).list() == []


def test_a_full_store_refuses_kept_voices_and_evicts_only_inline_ones():
    store = VoiceStore(2)
    store.put("v_1", REF)
    store.put("v_2", OTHER)
    with pytest.raises(VoiceError) as refused:
        store.put("v_3", REF)
    assert refused.value.code == "voice_store_full"
    for i in range(4):  # inline voices: the two most recent stay beside the kept ones
        store.put(f"v_i{i}", OTHER, keep=False)
    assert [v.voice_id for v in store.list()] == ["v_1", "v_2", "v_i2", "v_i3"]
    store.put("v_1", REF)  # already kept: no new room needed
    with pytest.raises(VoiceError, match="2 voices are stored"):
        store.put("v_i3", OTHER)  # an inline voice created on purpose: needs room, none left
    assert store.get("v_i3").kept is False


def test_names_are_unique_and_checked():
    store = VoiceStore(5)
    store.put("v_1", REF, name="bob")
    with pytest.raises(VoiceError, match="another voice's") as conflict:
        store.put("v_2", OTHER, name="bob")
    assert conflict.value.code == "name_conflict"
    with pytest.raises(VoiceError, match="named 'bob'"):
        store.put("v_1", REF, name="robert")
    assert store.put("v_1", REF, name="bob").name == "bob"
    for bad in ("", "v_x", "default", "a b", "x" * 65, 3):
        with pytest.raises(VoiceError):
            check_name(bad)


def test_a_named_voice_survives_a_restart_of_the_server(make_server, tmp_path):
    store = tmp_path / "voices.sqlite3"
    first = make_server(extra={"voice_store": store})
    url = first.http + "/v1/voices"
    r = httpx.post(url, json={"audio_b64": b64(reference_audio(2.0)), "name": "carol"}, timeout=60)
    assert r.status_code == 201 and r.json()["name"] == "carol"
    voice_id = r.json()["voice_id"]
    body = {"input": "Kept.", "response_format": "pcm", "max_duration_s": 0.6, "seed": 5}
    before = httpx.post(first.http + "/v1/audio/speech", json={**body, "voice": "carol"})
    taken = httpx.post(url, json={"audio_b64": b64(reference_audio(1.5, f0=200)), "name": "carol"})
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "name_conflict"
    first.stop()
    second = make_server(extra={"voice_store": store})
    shown = httpx.get(second.http + "/v1/voices/carol", timeout=30).json()
    assert shown["voice_id"] == voice_id and shown["frames"] == 50
    after = httpx.post(second.http + "/v1/audio/speech", json={**body, "voice": "carol"})
    assert after.status_code == before.status_code == 200
    assert after.content == before.content  # the same codes: the same speech
    assert httpx.delete(second.http + "/v1/voices/carol", timeout=30).status_code == 204
    assert httpx.get(second.http + "/v1/voices/carol", timeout=30).status_code == 404


def test_a_directory_of_voices_is_registered_at_start(make_server, tmp_path):
    folder = tmp_path / "voices"
    folder.mkdir()
    (folder / "dave.wav").write_bytes(reference_audio(2.0, f0=140.0))
    (folder / "dave.txt").write_text("What Dave says.\n")
    (folder / "notes.md").write_text("not a voice")
    server = make_server(extra={"voices_dir": folder})
    shown = httpx.get(server.http + "/v1/voices/dave", timeout=30).json()
    assert shown["name"] == "dave" and shown["transcript"] == "What Dave says."
    body = {"input": "Hi.", "voice": "dave", "response_format": "pcm", "max_duration_s": 0.4}
    assert httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60).status_code == 200
    shutil.rmtree(folder)


def test_a_voice_named_over_the_socket_speaks_by_name_and_inline_voices_are_not_kept(server):
    async def main():
        async with open_ws(server.ws) as ws:
            create = {
                "type": "voice.create",
                "request_id": "n1",
                "name": "erin",
                "audio_b64": b64(reference_audio(2.0, f0=175.0)),
            }
            await ws.send(json.dumps(create))
            created, _ = await recv_until(ws, "voice.created")
            await ws.send(speak("s", "By name.", dur=0.4, voice_id="erin"))
            inline = {"audio_b64": b64(reference_audio(1.5, f0=230.0))}
            await ws.send(speak("t", "Inline.", dur=0.4, voice=inline))
            return created, await collect(ws, ["s", "t"])

    created, got = run(main())
    assert created["name"] == "erin" and created["request_id"] == "n1"
    assert got["s"].done is not None and got["t"].done is not None
    kept = {v.voice_id: v.kept for v in server.services.voices.list()}
    assert kept[created["voice_id"]] is True
    assert sum(not k for k in kept.values()) >= 1  # the inline voice: in memory only


def test_a_multipart_upload_registers_a_voice(server):
    """What a browser's FormData or `curl -F` sends: the audio in a `file` part."""
    audio = reference_audio(2.0, f0=155.0)
    files = {"file": ("ref.wav", audio, "audio/wav")}
    data = {"transcript": "From a form.", "name": "frank"}
    r = httpx.post(server.http + "/v1/voices", files=files, data=data, timeout=60)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["name"] == "frank" and created["transcript"] == "From a form."
    assert created["frames"] == 50
    # the same recording as JSON gives the same voice
    same = httpx.post(
        server.http + "/v1/voices", json={"audio_b64": b64(audio), "transcript": "From a form."}
    )
    assert same.status_code == 200 and same.json()["voice_id"] == created["voice_id"]
    missing = httpx.post(server.http + "/v1/voices", data={"name": "x"}, files={"other": b"1"})
    assert missing.status_code == 400 and "'file' part" in missing.json()["error"]["message"]


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_each_key_sees_and_deletes_only_its_own_voices(make_server, tmp_path):
    """Keys A and B, an admin key, and a preloaded voice everyone shares."""
    folder = tmp_path / "shared-voices"
    folder.mkdir()
    (folder / "house.wav").write_bytes(reference_audio(2.0, f0=130.0))
    server = make_server(
        api_keys=("ka", "kb"), extra={"admin_keys": ("kadmin",), "voices_dir": folder}
    )
    url = server.http + "/v1/voices"
    audio = b64(reference_audio(2.0, f0=165.0))
    mine = httpx.post(url, json={"audio_b64": audio, "name": "mine"}, headers=_as("ka")).json()
    # B cannot see, use or delete A's voice, by id or by name
    for key in (mine["voice_id"], "mine"):
        assert httpx.get(f"{url}/{key}", headers=_as("kb")).status_code == 404
        assert httpx.delete(f"{url}/{key}", headers=_as("kb")).status_code == 404
    body = {"input": "Hi.", "voice": "mine", "response_format": "pcm", "max_duration_s": 0.4}
    refused = httpx.post(server.http + "/v1/audio/speech", json=body, headers=_as("kb"))
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_voice"
    spoken = httpx.post(server.http + "/v1/audio/speech", json=body, headers=_as("ka"))
    assert spoken.status_code == 200
    # B's own voice of the same recording and name is another voice
    theirs = httpx.post(url, json={"audio_b64": audio, "name": "mine"}, headers=_as("kb"))
    assert theirs.status_code == 201 and theirs.json()["voice_id"] != mine["voice_id"]

    def listed(key):
        return {v["voice_id"] for v in httpx.get(url, headers=_as(key)).json()["voices"]}

    house = httpx.get(f"{url}/house", headers=_as("ka")).json()["voice_id"]
    assert listed("ka") == {mine["voice_id"], house}
    assert listed("kb") == {theirs.json()["voice_id"], house}
    assert listed("kadmin") == {mine["voice_id"], theirs.json()["voice_id"], house}
    # the shared voice: usable by every key, deleted by an admin only
    assert httpx.delete(f"{url}/house", headers=_as("ka")).status_code == 404
    assert httpx.delete(f"{url}/{mine['voice_id']}", headers=_as("kadmin")).status_code == 204
    assert httpx.get(f"{url}/mine", headers=_as("ka")).status_code == 404
    assert httpx.delete(f"{url}/house", headers=_as("kadmin")).status_code == 204


def test_a_browser_token_sees_the_voices_of_the_key_that_asked_for_it(make_server):
    server = make_server(api_keys=("ka", "kb"))
    audio = b64(reference_audio(2.0, f0=185.0))
    httpx.post(
        server.http + "/v1/voices", json={"audio_b64": audio, "name": "gail"}, headers=_as("ka")
    )
    tokens = {
        key: httpx.post(server.http + "/v1/tokens", json={}, headers=_as(key)).json()["token"]
        for key in ("ka", "kb")
    }

    async def speak_as(token):
        async with open_ws(f"{server.ws}?token={token}") as ws:
            await ws.send(speak("g", "Token.", dur=0.4, voice_id="gail"))
            while True:
                frame = await ws.recv()
                if isinstance(frame, str) and json.loads(frame)["type"] in ("done", "error"):
                    return json.loads(frame)

    assert run(speak_as(tokens["ka"]))["type"] == "done"
    refused = run(speak_as(tokens["kb"]))
    assert refused["type"] == "error" and refused["code"] == "unknown_voice"


def test_a_store_of_the_first_layout_is_carried_over(tmp_path):
    """The first layout had no owners: its voices become everyone's, nothing is lost."""
    import sqlite3

    import numpy as np

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE voices (voice_id TEXT PRIMARY KEY, name TEXT UNIQUE, transcript TEXT, "
        "frames INTEGER NOT NULL, codes BLOB NOT NULL, created_at REAL NOT NULL)"
    )
    codes = np.asarray(REF.codes, dtype="<i2")
    db.execute(
        "INSERT INTO voices VALUES ('v_old', 'olga', 'Said.', 30, ?, 5.0)", (codes.tobytes(),)
    )
    db.commit()
    db.close()
    [voice] = VoiceStore(10, SqliteVoiceDatabase(path)).list()
    assert (voice.voice_id, voice.name, voice.owner, voice.created_at) == (
        "v_old",
        "olga",
        None,
        5.0,
    )
    assert voice.reference == REF
