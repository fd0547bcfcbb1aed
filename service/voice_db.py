"""What a voice database is, whichever holds it: the interface `VoiceStore` writes kept voices
through (`VoiceDatabase`), its row, its errors, how codes are stored (little-endian int16, rows
of 8, never a pickle) and the one function that opens the database a setting names: a file
path for the embedded SQLite (service/voice_db_sqlite.py), a `postgresql://` URL for a
PostgreSQL database that several servers share (service/voice_db_postgres.py). It knows
nothing of owners' rights or of caching: service/voices.py owns those."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from engine import NUM_CODEBOOKS, ConfigError, VoiceReference

URL_SCHEMES = ("postgresql://", "postgres://")


class StoreWriteError(Exception):
    """A voice could not be written or deleted (the disk is full, the file is read-only, the
    database is unreachable): the store's own wording, the same for every backend."""


class StoreReadError(Exception):
    """The database could not be read (a shared database that is unreachable)."""


class NameTaken(Exception):
    """The database's UNIQUE (owner, name) refused a write: another voice holds the name
    (written by another server sharing the database)."""


class VoiceRow(NamedTuple):
    voice_id: str
    owner: str | None
    name: str | None
    reference: VoiceReference
    created_at: float


class VoiceDatabase(Protocol):
    """Kept voices by voice_id, with (owner, name) unique. `shared`: other servers write it
    too, so a server's memory is only a cache of it (service/voices.py)."""

    shared: bool

    def save(
        self,
        voice_id: str,
        owner: str | None,
        name: str | None,
        reference: VoiceReference,
        created: float,
    ) -> None:
        """Inserts, or sets the name of an existing row; NameTaken, StoreWriteError."""

    def delete(self, voice_id: str) -> None: ...

    def load(self) -> list[VoiceRow]:
        """Every stored voice, oldest first."""

    def matching(self, key: str) -> list[VoiceRow]:
        """The rows whose voice_id or name is `key` (a name may be several owners')."""

    def count(self) -> int: ...

    def close(self) -> None: ...


def open_voice_database(setting: str | Path) -> VoiceDatabase:
    """The database CLONECAST_VOICE_STORE names; ConfigError in one line (naming the file, or
    the URL's host and database, never its password) when it cannot be opened."""
    if isinstance(setting, str) and setting.startswith(URL_SCHEMES):
        from service.voice_db_postgres import PostgresVoiceDatabase  # psycopg: only when used

        return PostgresVoiceDatabase(setting)
    from service.voice_db_sqlite import SqliteVoiceDatabase

    path = Path(setting)
    try:
        return SqliteVoiceDatabase(path)
    except Exception as exc:  # OSError, sqlite3.Error
        raise ConfigError(f"the voice store {str(path)!r} cannot be opened: {exc}") from exc


def codes_bytes(reference: VoiceReference) -> tuple[int, bytes]:
    """(frames, the codes as little-endian int16 bytes, 8 a frame)."""
    codes = np.asarray(reference.codes, dtype="<i2")  # [frames, 8]
    return len(codes), codes.tobytes()


def row_of(voice_id, owner, name, transcript, frames, blob, created) -> VoiceRow:
    codes = np.frombuffer(bytes(blob), "<i2").reshape(frames, NUM_CODEBOOKS)
    rows = tuple(tuple(int(c) for c in frame) for frame in codes)
    return VoiceRow(voice_id, owner, name, VoiceReference(rows, transcript), float(created))
