"""Registered voices: reference codes and transcript under a content-derived id (and, if
given, a name unique for its owner), shared by every connection and the HTTP API;
thread-safe. With API keys, a voice belongs to the key that created it: other keys neither
see, use nor delete it (an admin key sees all); preloaded voices (no owner) are everyone's.

Two kinds: a voice created on purpose (`voice.create`, `voice.upload`, `POST /v1/voices`, or
preloaded from a directory at start) is kept until deleted and, with a database, persists
across restarts; when `max_voices` of them exist, another is refused (`voice_store_full`),
never evicted behind its owner's back. A voice sent inline with a `speak` is kept only in
memory, least recently used first out past `max_voices`.

With a database that several servers share (PostgreSQL, service/voice_db_postgres.py) the
database is the truth and memory a cache: a lookup this server has not answered from the
database within `RECHECK_S` (1 s) reads it there (by voice_id or name, one indexed query), so
a voice created through another server is usable at once, and one deleted there is refused
here at most 1 s later. A voice's codes never change (its id is derived from them), so the
cache can only be stale about whether the voice (or which voice a name) exists. Names are
unique by the database's UNIQUE (owner, name) and `max_voices` is counted there. While the
database cannot be read, voices this server holds keep speaking."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from engine import FRAMES_PER_SECOND, ConfigError, VoiceReference
from service.auth import OPEN, Caller
from service.voice_db import NameTaken, StoreReadError, StoreWriteError, VoiceDatabase, VoiceRow

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RECHECK_S = 1.0  # a shared database: how long an answer read from it is trusted
log = logging.getLogger("clonecast.voices")


class VoiceError(ConfigError):
    """A refused registration, with its protocol code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Voice:
    voice_id: str
    reference: VoiceReference
    created_at: float
    name: str | None = None
    kept: bool = False  # created on purpose: kept until deleted (persisted with a database)
    owner: str | None = None  # the creating key's label (service/auth.py); None: everyone's

    @property
    def frames(self) -> int:
        return len(self.reference.codes)

    def describe(self) -> dict:
        return {
            "voice_id": self.voice_id,
            "name": self.name,
            "frames": self.frames,
            "duration_s": round(self.frames / FRAMES_PER_SECOND, 2),
            "transcript": self.reference.text,
            "created_at": self.created_at,
        }


def voice_id_for(audio: bytes, transcript: str | None, owner: str | None = None) -> str:
    """Derived from the recording, its transcript and its owner: two keys uploading the same
    recording get two voices, each its own."""
    h = hashlib.sha256(audio)
    h.update(b"\x00" + (transcript or "").encode())
    if owner is not None:
        h.update(b"\x00" + owner.encode())
    return "v_" + h.hexdigest()[:20]


def check_name(name: object) -> str | None:
    """A voice name: 1-64 letters, digits, `_`, `.`, `-` (not `v_...`, not "default")."""
    if name is None:
        return None
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise VoiceError(
            "bad_parameter", "a voice name is 1-64 letters, digits, '_', '.' or '-' characters"
        )
    if name.startswith("v_") or name == "default":
        raise VoiceError("bad_parameter", f"{name!r} is reserved: 'v_...' ids and 'default'")
    return name


class VoiceStore:
    def __init__(
        self,
        max_voices: int,
        db: VoiceDatabase | None = None,
        recheck_s: float = RECHECK_S,
        clock=time.monotonic,
    ):
        self.max_voices, self.db = max_voices, db
        self.shared = db is not None and db.shared
        self.recheck_s, self._clock = recheck_s, clock
        self._voices: OrderedDict[str, Voice] = OrderedDict()
        self._names: dict[tuple[str | None, str], str] = {}  # (owner, name) -> voice_id
        # shared: (key, caller's owner, admin) -> (voice_id, when the database said so)
        self._checked: OrderedDict[tuple, tuple[str, float]] = OrderedDict()
        self._unreadable = False  # the last read of a shared database failed
        self._lock = threading.Lock()
        for row in db.load() if db else ():
            self._cache(row)

    def put(
        self,
        voice_id: str,
        reference: VoiceReference,
        name: str | None = None,
        keep: bool = True,
        owner: str | None = None,
    ) -> Voice:
        """Registers (or finds) a voice; `keep`: created on purpose (see the module)."""
        with self._lock:
            existing = self._current(voice_id)
            # shared: the database's UNIQUE (owner, name) decides (NameTaken in _write)
            holder = self._names.get((owner, name)) if name and not self.shared else None
            if holder is not None and holder != voice_id:
                raise VoiceError("name_conflict", f"the name {name!r} is another voice's")
            if name and existing is not None and existing.name not in (None, name):
                raise VoiceError("name_conflict", f"this voice is named {existing.name!r}")
            kept = keep or (existing is not None and existing.kept)
            if kept and not (existing and existing.kept) and self._num_kept() >= self.max_voices:
                raise VoiceError(
                    "voice_store_full",
                    f"{self.max_voices} voices are stored: delete one (DELETE /v1/voices/ID)",
                )
            voice = existing or Voice(voice_id, reference, time.time(), owner=owner)
            voice = replace(voice, name=name or voice.name, kept=kept)
            if voice != existing:
                if kept and self.db is not None:  # written first: a kept voice persists
                    self._write(
                        self.db.save, voice_id, owner, voice.name, voice.reference, voice.created_at
                    )
                if voice.name:
                    self._names[owner, voice.name] = voice_id
            self._voices[voice_id] = voice
            self._voices.move_to_end(voice_id)
            self._evict()
            return voice

    def get(self, key: str, caller: Caller = OPEN) -> Voice | None:
        """By voice_id or by name (the caller's own name first, then a shared one); None
        when there is none the caller may see."""
        with self._lock:
            voice = self._find(key, caller)
            if voice is not None:
                self._voices.move_to_end(voice.voice_id)
            if self.shared and len(self._voices) > self.max_voices:
                self._evict()  # the database's voices this server has read
            return voice

    def delete(self, key: str, caller: Caller = OPEN) -> bool:
        """A shared voice (no owner) only by an admin, or on a server without keys."""
        with self._lock:
            voice = self._find(key, caller)
            if voice is None or (voice.owner is None and caller.owner and not caller.admin):
                return False
            if voice.kept and self.db is not None:
                self._write(self.db.delete, voice.voice_id)
            self._forget(voice.voice_id)
            return True

    def list(self, caller: Caller = OPEN) -> list[Voice]:
        with self._lock:
            voices = list(self._voices.values())
            if self.shared and (rows := self._read_or_none(self.db.load)) is not None:
                inline = [v for v in voices if not v.kept]
                voices = [_voice_of(row) for row in rows] + inline
            return [v for v in voices if caller.sees(v.owner)]

    def _find(self, key: str, caller: Caller) -> Voice | None:
        return self._find_shared(key, caller) if self.shared else self._find_local(key, caller)

    def _find_shared(self, key: str, caller: Caller) -> Voice | None:
        """The database's answer, or this server's own of less than `recheck_s` ago."""
        cached = self._voices.get(key)
        if cached is not None and not cached.kept:  # an inline voice: this server's only
            return cached if caller.sees(cached.owner) else None
        asked, now = (key, caller.owner, caller.admin), self._clock()
        seen = self._checked.get(asked)
        if seen is not None and now - seen[1] < self.recheck_s and seen[0] in self._voices:
            return self._voices[seen[0]]
        rows = self._read_or_none(self.db.matching, key)
        if rows is None:  # unreadable: what this server holds
            return self._find_local(key, caller)
        row = _pick(rows, key, caller)
        if row is None:
            self._checked.pop(asked, None)
            # deleted through another server (asked by its id, or by its name: a name is only
            # ever lost with its voice): forgotten here, so no other key of it is trusted
            gone = key if cached is not None else self._names.get((caller.owner, key))
            gone = gone or self._names.get((None, key))
            if gone in self._voices and self._voices[gone].kept:
                self._forget(gone)
            return None
        self._checked[asked] = (row.voice_id, now)
        self._checked.move_to_end(asked)
        while len(self._checked) > 4 * self.max_voices:
            self._checked.popitem(last=False)
        return self._cache(row)

    def _find_local(self, key: str, caller: Caller) -> Voice | None:
        voice_id = self._names.get((caller.owner, key)) or self._names.get((None, key), key)
        voice = self._voices.get(voice_id)
        if voice is None and caller.admin:  # an admin may name anyone's voice by its name
            voice_id = next((v for (o, n), v in self._names.items() if n == key), key)
            voice = self._voices.get(voice_id)
        return voice if voice is not None and caller.sees(voice.owner) else None

    def _current(self, voice_id: str) -> Voice | None:
        """The voice under this id as it stands (shared: in the database, else inline here)."""
        cached = self._voices.get(voice_id)
        if not self.shared:
            return cached
        rows = self._read(self.db.matching, voice_id)
        row = next((r for r in rows if r.voice_id == voice_id), None)
        if row is not None:
            return self._cache(row)
        if cached is not None and cached.kept:  # deleted through another server
            self._forget(voice_id)
            return None
        return cached

    def _cache(self, row: VoiceRow) -> Voice:
        """A kept voice as the database has it, in memory."""
        old = self._voices.get(row.voice_id)
        if old is not None and old.name and old.name != row.name:
            self._names.pop((old.owner, old.name), None)
        voice = _voice_of(row)
        self._voices[row.voice_id] = voice
        if voice.name:
            self._names[voice.owner, voice.name] = voice.voice_id
        return voice

    def _forget(self, voice_id: str) -> None:
        voice = self._voices.pop(voice_id)
        if voice.name and self._names.get((voice.owner, voice.name)) == voice_id:
            del self._names[voice.owner, voice.name]

    @staticmethod
    def _write(operation, *args) -> None:
        """A database write; its failure refuses the change (nothing changes in memory)
        with `voice_store_error`, and affects nothing else."""
        try:
            operation(*args)
        except NameTaken as exc:  # a name given through another server sharing the database
            raise VoiceError("name_conflict", "the name is another voice's") from exc
        except StoreWriteError as exc:
            raise VoiceError("voice_store_error", f"{exc}; nothing was changed") from exc

    def _read(self, operation, *args):
        """A read of a shared database that the change being made needs."""
        try:
            return operation(*args)
        except StoreReadError as exc:
            raise VoiceError("voice_store_error", f"{exc}; nothing was changed") from exc

    def _read_or_none(self, operation, *args):
        """A read of a shared database, None while it cannot be read (logged when that
        starts and when it ends: lookups run at the rate of utterances)."""
        try:
            result = operation(*args)
        except StoreReadError as exc:
            if not self._unreadable:
                log.warning("%s: this server's voices are used as they are until it can", exc)
            self._unreadable = True
            return None
        if self._unreadable:
            log.warning("the voice store can be read again")
        self._unreadable = False
        return result

    def _num_kept(self) -> int:
        if self.shared:
            return self._read(self.db.count)
        return sum(v.kept for v in self._voices.values())

    def _evict(self) -> None:
        """Inline voices past `max_voices`, least recently used first; shared, also the
        cached copies of kept ones (the database keeps them)."""
        inline = [k for k, v in self._voices.items() if not v.kept]
        evicted = inline[: max(0, len(inline) - self.max_voices)]
        if self.shared:
            cached = [k for k, v in self._voices.items() if v.kept]
            evicted += cached[: max(0, len(cached) - self.max_voices)]
        for voice_id in evicted:
            self._forget(voice_id)


def _voice_of(row: VoiceRow) -> Voice:
    return Voice(row.voice_id, row.reference, row.created_at, row.name, True, row.owner)


def _pick(rows: list[VoiceRow], key: str, caller: Caller) -> VoiceRow | None:
    """What `key` names for `caller` (the order of VoiceStore._find_local): its own name,
    a shared name, a voice_id, and for an admin anyone's name."""

    def first(test) -> VoiceRow | None:
        return next((row for row in rows if test(row)), None)

    row = (
        first(lambda r: r.name == key and r.owner == caller.owner)
        or first(lambda r: r.name == key and r.owner is None)
        or first(lambda r: r.voice_id == key)
    )
    if row is None and caller.admin:
        row = first(lambda r: r.name == key)
    return row if row is not None and caller.sees(row.owner) else None
