"""Where registered voices persist across restarts: one SQLite file (the standard library's
sqlite3), one row per voice with its metadata and its reference codes as little-endian int16
rows of 8 (never a pickle). Thread-safe (one connection behind a lock); the file is in WAL
mode, so a crash loses at most the voice being written."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

import numpy as np

from engine import NUM_CODEBOOKS, VoiceReference

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


class StoreWriteError(Exception):
    """A voice could not be written or deleted (the disk is full, the file is read-only):
    the store's own wording, the same for every backend."""


class VoiceDatabase:
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

    def save(
        self,
        voice_id: str,
        owner: str | None,
        name: str | None,
        reference: VoiceReference,
        created: float,
    ) -> None:
        codes = np.asarray(reference.codes, dtype="<i2")
        with self._lock, _writing():
            self._db.execute(
                "INSERT OR REPLACE INTO voices VALUES (?, ?, ?, ?, ?, ?, ?)",
                (voice_id, owner, name, reference.text, len(codes), codes.tobytes(), created),
            )

    def delete(self, voice_id: str) -> None:
        with self._lock, _writing():
            self._db.execute("DELETE FROM voices WHERE voice_id = ?", (voice_id,))

    def load(self) -> list[tuple[str, str | None, str | None, VoiceReference, float]]:
        """Every stored voice, oldest first: (voice_id, owner, name, reference, created_at)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT voice_id, owner, name, transcript, frames, codes, created_at FROM voices "
                "ORDER BY created_at"
            ).fetchall()
        out = []
        for voice_id, owner, name, transcript, frames, blob, created in rows:
            codes = np.frombuffer(blob, "<i2").reshape(frames, NUM_CODEBOOKS)
            rows_ = tuple(tuple(int(c) for c in row) for row in codes)
            out.append((voice_id, owner, name, VoiceReference(rows_, transcript), created))
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()


@contextlib.contextmanager
def _writing():
    try:
        yield
    except sqlite3.Error as exc:  # e.g. "database or disk is full"
        raise StoreWriteError(f"the voice store could not be written: {exc}") from exc
