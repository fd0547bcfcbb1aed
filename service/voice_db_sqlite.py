"""The embedded voice database, the default: one SQLite file (the standard library's sqlite3)
for one server, one row per kept voice with its metadata and its reference codes
(service/voice_db.py's layout). Thread-safe (one connection behind a lock); the file is in WAL
mode, so a crash loses at most the voice being written. Not shared: a server's memory holds
every voice (a second server on the same file would not see the first one's changes)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from service.voice_db import NameTaken, StoreWriteError, VoiceRow, codes_bytes, row_of

SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    voice_id TEXT PRIMARY KEY,
    owner TEXT,
    name TEXT,
    transcript TEXT,
    frames INTEGER NOT NULL,
    codes BLOB NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (owner, name)
)
"""
COLUMNS = "voice_id, owner, name, transcript, frames, codes, created_at"


class SqliteVoiceDatabase:
    shared = False

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(voices)")}
        if columns and "owner" not in columns:  # the first layout (no owners): rebuilt
            self._db.execute("ALTER TABLE voices RENAME TO voices_v0")
            self._db.execute(SCHEMA)
            self._db.execute(
                "INSERT INTO voices SELECT voice_id, NULL, name, transcript, frames, codes, "
                "created_at FROM voices_v0"
            )
            self._db.execute("DROP TABLE voices_v0")
        self._db.execute(SCHEMA)

    def save(self, voice_id, owner, name, reference, created) -> None:
        frames, blob = codes_bytes(reference)
        with self._lock, _writing():
            self._db.execute(
                f"INSERT INTO voices ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (voice_id) DO UPDATE SET name = COALESCE(excluded.name, voices.name)",
                (voice_id, owner, name, reference.text, frames, blob, created),
            )

    def delete(self, voice_id: str) -> None:
        with self._lock, _writing():
            self._db.execute("DELETE FROM voices WHERE voice_id = ?", (voice_id,))

    def load(self) -> list[VoiceRow]:
        return self._rows(f"SELECT {COLUMNS} FROM voices ORDER BY created_at", ())

    def matching(self, key: str) -> list[VoiceRow]:
        query = f"SELECT {COLUMNS} FROM voices WHERE voice_id = ? OR name = ?"
        return self._rows(query, (key, key))

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM voices").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, query: str, args: tuple) -> list[VoiceRow]:
        with self._lock:
            return [row_of(*row) for row in self._db.execute(query, args).fetchall()]


@contextlib.contextmanager
def _writing():
    try:
        yield
    except sqlite3.IntegrityError as exc:  # UNIQUE (owner, name): another voice's name
        raise NameTaken(str(exc)) from exc
    except sqlite3.Error as exc:  # e.g. "database or disk is full"
        raise StoreWriteError(f"the voice store could not be written: {exc}") from exc
