"""A voice database that several servers share: PostgreSQL through psycopg 3, selected by a
`postgresql://USER:PASSWORD@HOST:PORT/DB` CLONECAST_VOICE_STORE. The layout is the embedded
one's (codes as little-endian int16 bytes), created if missing; (owner, name) is unique
across every server, preloaded voices (no owner) included. One connection behind a lock (the
voice store serialises its calls, so a pool would add nothing): reconnected when it broke,
and each call bounded by timeouts, since the calls run on the server's event loop. The URL's
password never appears in an error or a log line: the database is named by host, port and
database only."""

from __future__ import annotations

import re
import threading

import psycopg
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict

from engine import ConfigError
from service.voice_db import (
    NameTaken,
    StoreReadError,
    StoreWriteError,
    VoiceRow,
    codes_bytes,
    row_of,
)

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS voices (
        voice_id TEXT PRIMARY KEY,
        owner TEXT,
        name TEXT,
        transcript TEXT,
        frames INTEGER NOT NULL,
        codes BYTEA NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    # NULL owners (preloaded voices) compare equal here, unlike in a plain UNIQUE (owner, name)
    "CREATE UNIQUE INDEX IF NOT EXISTS voices_owner_name ON voices ((COALESCE(owner, '')), name)",
    "CREATE INDEX IF NOT EXISTS voices_name ON voices (name)",
)
COLUMNS = "voice_id, owner, name, transcript, frames, codes, created_at"
SCHEMA_LOCK = 0x636C6F6E  # pg_advisory_xact_lock key: two servers starting at once
# libpq settings unless the URL sets them: a dead database or network costs seconds, not the
# minutes of TCP's own timeouts (the calls block the event loop while they wait)
CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
    "options": "-c statement_timeout=5000",
    "application_name": "clonecast",
}


class PostgresVoiceDatabase:
    shared = True

    def __init__(self, url: str):
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error:
            raise ConfigError("CLONECAST_VOICE_STORE is not a valid postgresql:// URL") from None
        self._password = params.get("password")
        self.where = "{}:{}/{}".format(
            params.get("host", "localhost"), params.get("port", 5432), params.get("dbname", "")
        )
        self._params = {**CONNECT_DEFAULTS, **params}
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        try:
            with self._lock:
                self._create_schema(self._connected())
        except psycopg.Error as exc:
            raise ConfigError(
                f"the voice store postgresql://{self.where} cannot be opened: {self._said(exc)}"
                " (check CLONECAST_VOICE_STORE and that the database is reachable)"
            ) from None

    def save(self, voice_id, owner, name, reference, created) -> None:
        frames, blob = codes_bytes(reference)
        query = (
            f"INSERT INTO voices ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (voice_id) DO UPDATE SET name = COALESCE(EXCLUDED.name, voices.name)"
        )
        self._write(query, (voice_id, owner, name, reference.text, frames, blob, created))

    def delete(self, voice_id: str) -> None:
        self._write("DELETE FROM voices WHERE voice_id = %s", (voice_id,))

    def load(self) -> list[VoiceRow]:
        rows = self._read(f"SELECT {COLUMNS} FROM voices ORDER BY created_at", ())
        return [row_of(*row) for row in rows]

    def matching(self, key: str) -> list[VoiceRow]:
        query = f"SELECT {COLUMNS} FROM voices WHERE voice_id = %s OR name = %s"
        return [row_of(*row) for row in self._read(query, (key, key))]

    def count(self) -> int:
        return self._read("SELECT count(*) FROM voices", ())[0][0]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _read(self, query: str, args: tuple) -> list[tuple]:
        try:
            return self._run(query, args, fetch=True)
        except psycopg.Error as exc:
            raise StoreReadError(self._failed("read", exc)) from None

    def _write(self, query: str, args: tuple) -> None:
        try:
            self._run(query, args, fetch=False)
        except errors.UniqueViolation as exc:  # voices_owner_name: another voice's name
            raise NameTaken(self._said(exc)) from None
        except psycopg.Error as exc:
            raise StoreWriteError(self._failed("written", exc)) from None

    def _run(self, query: str, args: tuple, fetch: bool):
        """Once, and once more on a new connection when the first had broken (the database
        restarted since its last use); every statement here is safe to repeat."""
        with self._lock:
            conn = self._connected()
            try:
                return _execute(conn, query, args, fetch)
            except psycopg.OperationalError:
                if not conn.closed:  # the statement failed (a timeout), not the connection
                    raise
            self._conn = None
            return _execute(self._connected(), query, args, fetch)

    def _connected(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(**self._params, autocommit=True)
        return self._conn

    @staticmethod
    def _create_schema(conn: psycopg.Connection) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            for statement in SCHEMA:
                conn.execute(statement)

    def _failed(self, what: str, exc: psycopg.Error) -> str:
        return f"the voice store postgresql://{self.where} could not be {what}: {self._said(exc)}"

    def _said(self, exc: psycopg.Error) -> str:
        """libpq's message on one line, the password (were it ever quoted) masked."""
        text = " ".join(str(exc).split())
        if not self._password:
            return text
        return re.sub(rf"(?<!\w){re.escape(self._password)}(?!\w)", "[redacted]", text)


def _execute(conn: psycopg.Connection, query: str, args: tuple, fetch: bool):
    cursor = conn.execute(query, args)
    return cursor.fetchall() if fetch else None
