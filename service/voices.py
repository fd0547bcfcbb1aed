"""Registered voices: reference codes and transcript under a content-derived id (and, if
given, a name unique for its owner), shared by every connection and the HTTP API;
thread-safe. With API keys, a voice belongs to the key that created it: other keys neither
see, use nor delete it (an admin key sees all); preloaded voices (no owner) are everyone's.

Two kinds: a voice created on purpose (`voice.create`, `voice.upload`, `POST /v1/voices`, or
preloaded from a directory at start) is kept until deleted and, with a database, persists
across restarts; when `max_voices` of them exist, another is refused (`voice_store_full`),
never evicted behind its owner's back. A voice sent inline with a `speak` is kept only in
memory, least recently used first out past `max_voices`."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from engine import FRAMES_PER_SECOND, ConfigError, VoiceReference
from service.auth import OPEN, Caller
from service.voice_db import StoreWriteError, VoiceDatabase

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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
    def __init__(self, max_voices: int, db: VoiceDatabase | None = None):
        self.max_voices, self.db = max_voices, db
        self._voices: OrderedDict[str, Voice] = OrderedDict()
        self._names: dict[tuple[str | None, str], str] = {}  # (owner, name) -> voice_id
        self._lock = threading.Lock()
        for voice_id, owner, name, reference, created in db.load() if db else ():
            self._voices[voice_id] = Voice(voice_id, reference, created, name, True, owner)
            if name:
                self._names[owner, name] = voice_id

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
            existing = self._voices.get(voice_id)
            holder = self._names.get((owner, name)) if name else None
            if holder is not None and holder != voice_id:
                raise VoiceError("name_conflict", f"the name {name!r} is another voice's")
            if name and existing is not None and existing.name not in (None, name):
                raise VoiceError("name_conflict", f"this voice is named {existing.name!r}")
            kept = keep or (existing is not None and existing.kept)
            if kept and not (existing and existing.kept) and self._kept() >= self.max_voices:
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
            self._evict_inline()
            return voice

    def get(self, key: str, caller: Caller = OPEN) -> Voice | None:
        """By voice_id or by name (the caller's own name first, then a shared one); None
        when there is none the caller may see."""
        with self._lock:
            voice = self._find(key, caller)
            if voice is not None:
                self._voices.move_to_end(voice.voice_id)
            return voice

    def delete(self, key: str, caller: Caller = OPEN) -> bool:
        """A shared voice (no owner) only by an admin, or on a server without keys."""
        with self._lock:
            voice = self._find(key, caller)
            if voice is None or (voice.owner is None and caller.owner and not caller.admin):
                return False
            if voice.kept and self.db is not None:
                self._write(self.db.delete, voice.voice_id)
            del self._voices[voice.voice_id]
            if voice.name:
                self._names.pop((voice.owner, voice.name), None)
            return True

    def list(self, caller: Caller = OPEN) -> list[Voice]:
        with self._lock:
            return [v for v in self._voices.values() if caller.sees(v.owner)]

    def _find(self, key: str, caller: Caller) -> Voice | None:
        voice_id = self._names.get((caller.owner, key)) or self._names.get((None, key), key)
        voice = self._voices.get(voice_id)
        if voice is None and caller.admin:  # an admin may name anyone's voice by its name
            voice_id = next((v for (o, n), v in self._names.items() if n == key), key)
            voice = self._voices.get(voice_id)
        return voice if voice is not None and caller.sees(voice.owner) else None

    @staticmethod
    def _write(operation, *args) -> None:
        """A database write; its failure refuses the change (nothing changes in memory)
        with `voice_store_error`, and affects nothing else."""
        try:
            operation(*args)
        except StoreWriteError as exc:
            raise VoiceError("voice_store_error", f"{exc}; nothing was changed") from exc

    def _kept(self) -> int:
        return sum(v.kept for v in self._voices.values())

    def _evict_inline(self) -> None:
        inline = [k for k, v in self._voices.items() if not v.kept]  # oldest use first
        for voice_id in inline[: max(0, len(inline) - self.max_voices)]:
            voice = self._voices.pop(voice_id)
            if voice.name:
                self._names.pop((voice.owner, voice.name), None)
