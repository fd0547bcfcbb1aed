"""The wire constants of protocol `clonecast.v1` (docs/protocol.md), shared by the server and
the SDK: the binary audio frame header, the close codes, the default audio rate. Standard
library only (clients import it without the engine; a test holds DEFAULT_SAMPLE_RATE to the
engine's)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

PROTOCOL = "clonecast.v1"
MAGIC = b"CC"
VERSION = 1
FLAG_LAST = 1
DEFAULT_SAMPLE_RATE = 24000  # audio without an `output` rate: the engine's own

# Close codes of the protocol, named like the error codes the server sends before them.
CLOSE_UNAUTHORIZED, CLOSE_FORBIDDEN, CLOSE_IDLE, CLOSE_CAPACITY = 4401, 4403, 4408, 4429
CLOSE_SERVICE_RESTART = 1012  # the standard code: the server drains (a deploy), reconnect
CLOSE_POLICY = 1008  # the standard code for a policy violation: a client that floods
CLOSE_CODES = {
    CLOSE_POLICY: "rate_limited",
    1009: "message_too_large",
    1011: "server_error",
    CLOSE_SERVICE_RESTART: "server_restarting",
    CLOSE_UNAUTHORIZED: "unauthorized",
    CLOSE_FORBIDDEN: "forbidden_origin",
    CLOSE_IDLE: "idle_timeout",
    CLOSE_CAPACITY: "over_capacity",
}
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
