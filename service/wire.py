"""The binary audio frame header of protocol `clonecast.v1` (docs/protocol.md), shared by
the server and the SDK. Standard library only."""

from __future__ import annotations

import struct
from dataclasses import dataclass

PROTOCOL = "clonecast.v1"
MAGIC = b"CC"
VERSION = 1
FLAG_LAST = 1
_FIXED = struct.Struct("<2sBBIB")  # magic, version, flags, seq, id length


@dataclass(frozen=True)
class AudioFrame:
    utterance_id: str
    seq: int
    last: bool
    payload: bytes


def pack_audio(utterance_id: str, seq: int, last: bool, payload: bytes) -> bytes:
    uid = utterance_id.encode()
    if len(uid) > 255:
        raise ValueError("utterance id longer than 255 bytes")
    return _FIXED.pack(MAGIC, VERSION, FLAG_LAST if last else 0, seq, len(uid)) + uid + payload


def unpack_audio(frame: bytes) -> AudioFrame:
    if len(frame) < _FIXED.size:
        raise ValueError("binary frame shorter than the audio header")
    magic, version, flags, seq, n = _FIXED.unpack_from(frame)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a clonecast.v1 audio frame (magic {magic!r}, version {version})")
    start = _FIXED.size
    uid = frame[start : start + n].decode()
    return AudioFrame(uid, seq, bool(flags & FLAG_LAST), frame[start + n :])
