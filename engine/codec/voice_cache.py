"""Encoded reference voices cached by content hash: LRU, bounded by bytes, thread-safe.
Concurrent requests for the same new audio encode it once: the first caller encodes while
the others wait for its result. Imports no torch."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

Frames = tuple[tuple[int, ...], ...]
BYTES_PER_FRAME = 8 * 8 + 64  # eight Python ints and the tuple around them, roughly


@dataclass
class VoiceCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class VoiceCache:
    def __init__(self, max_bytes: int = 64 * 1024 * 1024):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Frames] = OrderedDict()
        self._inflight: dict[bytes, threading.Event] = {}
        self._lock = threading.Lock()
        self.stats = VoiceCacheStats()

    def get_or_encode(self, key: bytes, encode: Callable[[], Frames]) -> tuple[Frames, bool]:
        """Returns (frames, was_cached). `encode` runs at most once per key at a time."""
        while True:
            with self._lock:
                frames = self._entries.get(key)
                if frames is not None:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    return frames, True
                event = self._inflight.get(key)
                if event is None:
                    self._inflight[key] = threading.Event()
                    self.stats.misses += 1
                    break
            event.wait()  # another caller is encoding this audio; then look again
        try:
            frames = encode()
            with self._lock:
                self._store(key, frames)
            return frames, False
        finally:
            with self._lock:
                self._inflight.pop(key).set()

    def _store(self, key: bytes, frames: Frames) -> None:
        self._entries[key] = frames
        self.stats.bytes += len(frames) * BYTES_PER_FRAME
        while self.stats.bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.stats.bytes -= len(old) * BYTES_PER_FRAME
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)
