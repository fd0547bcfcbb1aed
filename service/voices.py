"""Registered voices: reference codes and transcript under a content-derived id, shared by
every connection and the HTTP API. Bounded (least recently used first out); thread-safe."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine import FRAMES_PER_SECOND, VoiceReference


@dataclass(frozen=True)
class Voice:
    voice_id: str
    reference: VoiceReference
    created_at: float

    @property
    def frames(self) -> int:
        return len(self.reference.codes)

    def describe(self) -> dict:
        return {
            "voice_id": self.voice_id,
            "frames": self.frames,
            "duration_s": round(self.frames / FRAMES_PER_SECOND, 2),
            "transcript": self.reference.text,
            "created_at": self.created_at,
        }


def voice_id_for(audio: bytes, transcript: str | None) -> str:
    h = hashlib.sha256(audio)
    h.update(b"\x00" + (transcript or "").encode())
    return "v_" + h.hexdigest()[:20]


class VoiceStore:
    def __init__(self, max_voices: int):
        self.max_voices = max_voices
        self._voices: OrderedDict[str, Voice] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, voice_id: str, reference: VoiceReference) -> Voice:
        with self._lock:
            voice = self._voices.get(voice_id) or Voice(voice_id, reference, time.time())
            self._voices[voice_id] = voice
            self._voices.move_to_end(voice_id)
            while len(self._voices) > self.max_voices:
                self._voices.popitem(last=False)
            return voice

    def get(self, voice_id: str) -> Voice | None:
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is not None:
                self._voices.move_to_end(voice_id)
            return voice

    def delete(self, voice_id: str) -> bool:
        with self._lock:
            return self._voices.pop(voice_id, None) is not None

    def list(self) -> list[Voice]:
        with self._lock:
            return list(self._voices.values())
