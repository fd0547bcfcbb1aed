"""The voice databases (service/voice_db*.py): the embedded SQLite file and a real PostgreSQL
started on loopback keep the same rows the same way (codes as little-endian int16 bytes, the
schema created if missing, (owner, name) unique), and PostgreSQL's failures are named without
the URL's password."""

from __future__ import annotations

import sqlite3

import numpy as np
import psycopg
import pytest

from engine import ConfigError, VoiceReference
from service.voice_db import NameTaken, StoreWriteError, VoiceRow, open_voice_database
from service.voice_db_postgres import PostgresVoiceDatabase
from tests.postgres_server import PASSWORD

REF = VoiceReference(tuple((i % 1024, 1, 2, 3, 4, 5, 6, 1023) for i in range(30)), "Said.")
OTHER = VoiceReference(((7,) * 8,) * 5, None)


@pytest.fixture(params=["sqlite", "postgresql"])
def opened(request, tmp_path):
    """(the setting, a function opening it again, a function reading one raw codes blob)."""
    if request.param == "sqlite":
        setting = tmp_path / "voices.sqlite3"

        def raw(voice_id):
            with sqlite3.connect(setting) as conn:
                query = "SELECT codes FROM voices WHERE voice_id = ?"
                return conn.execute(query, (voice_id,)).fetchone()[0]
    else:
        setting = request.getfixturevalue("postgres").new_database()

        def raw(voice_id):
            with psycopg.connect(setting) as conn:
                query = "SELECT codes FROM voices WHERE voice_id = %s"
                return conn.execute(query, (voice_id,)).fetchone()[0]

    databases = []

    def reopen():
        databases.append(open_voice_database(setting))
        return databases[-1]

    yield setting, reopen, raw
    for db in databases:
        db.close()


def test_a_voice_round_trips_with_its_codes_as_little_endian_int16(opened):
    setting, reopen, raw = opened
    db = reopen()
    db.save("v_a", "k_1", "alice", REF, 5.0)
    db.save("v_b", None, None, OTHER, 6.0)
    assert raw("v_a") == np.asarray(REF.codes, dtype="<i2").tobytes()  # 30 rows of 8, no pickle
    again = reopen()  # a second server, or a restart: the schema is there, the rows too
    assert again.load() == [
        VoiceRow("v_a", "k_1", "alice", REF, 5.0),
        VoiceRow("v_b", None, None, OTHER, 6.0),
    ]
    assert [r.voice_id for r in again.matching("alice")] == ["v_a"]
    assert [r.voice_id for r in again.matching("v_b")] == ["v_b"]
    assert again.matching("nobody") == [] and again.count() == 2
    again.delete("v_a")
    assert [r.voice_id for r in db.load()] == ["v_b"] and db.count() == 1


def test_a_name_is_unique_per_owner_and_a_second_save_only_adds_a_name(opened):
    _, reopen, _ = opened
    db = reopen()
    db.save("v_1", "k_a", "bob", REF, 1.0)
    db.save("v_2", "k_b", "bob", OTHER, 2.0)  # another owner's "bob"
    with pytest.raises(NameTaken):
        db.save("v_3", "k_a", "bob", OTHER, 3.0)
    db.save("v_4", "k_a", None, OTHER, 4.0)
    db.save("v_4", "k_a", "robert", OTHER, 4.0)  # a kept voice named later
    db.save("v_4", "k_a", None, OTHER, 4.0)  # saved again without one: the name stays
    assert {(r.voice_id, r.name) for r in db.matching("robert")} == {("v_4", "robert")}
    assert {r.voice_id for r in db.matching("bob")} == {"v_1", "v_2"}
    assert db.count() == 3


def test_a_shared_database_holds_one_preloaded_voice_per_name(postgres):
    """Voices without an owner (CLONECAST_VOICES_DIR) are everyone's: two servers preloading
    different recordings under one name cannot both have it."""
    db = PostgresVoiceDatabase(postgres.new_database())
    db.save("v_1", None, "house", REF, 1.0)
    with pytest.raises(NameTaken):
        db.save("v_2", None, "house", OTHER, 2.0)
    db.close()


@pytest.mark.parametrize(
    "url, said",
    [
        ("postgresql://clonecast:{pw}@127.0.0.1:1/voices", "127.0.0.1:1/voices cannot be opened"),
        ("postgresql://clonecast:wrong-{pw}@127.0.0.1:{port}/postgres", "password authentication"),
        ("postgresql://clonecast:{pw}@127.0.0.1:{port}/missing", 'database "missing"'),
    ],
)
def test_a_database_that_cannot_be_opened_is_named_in_one_line_without_its_password(
    postgres, url, said
):
    url = url.format(pw=PASSWORD, port=postgres.port)
    with pytest.raises(ConfigError) as refused:
        open_voice_database(url)
    message = str(refused.value)
    assert said in message and "\n" not in message
    assert "postgresql://127.0.0.1:" in message  # named by host, port and database
    assert PASSWORD not in message and PASSWORD not in repr(refused.value.__cause__)


def test_a_broken_connection_is_replaced_and_a_refused_write_is_a_store_write_error(postgres):
    url = postgres.new_database()
    db = PostgresVoiceDatabase(url)
    db.save("v_1", None, None, REF, 1.0)
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        database = url.rsplit("/", 1)[1]
        admin.execute(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (database,),
        )
    assert db.count() == 1  # the dropped connection: replaced on the next call
    with pytest.raises(StoreWriteError) as refused:  # the new one is read-only
        db.save("v_2", None, None, OTHER, 2.0)
    assert "could not be written" in str(refused.value) and PASSWORD not in str(refused.value)
    db.close()


def test_without_the_postgresql_binaries_the_tests_skip_saying_how_to_install_them(monkeypatch):
    import tests.postgres_server as server

    monkeypatch.setattr(server.glob, "glob", lambda pattern: [])
    with pytest.raises(pytest.skip.Exception, match="postgresql package"):
        server.PostgresServer()
