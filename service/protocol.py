"""Parsing of client messages of `clonecast.v1`; every rejection is a `ProtocolError` with
the stable error code the client receives (docs/protocol.md)."""

from __future__ import annotations

import json

MESSAGE_TYPES = ("speak", "append", "flush", "cancel", "voice.create", "voice.upload", "ping")


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, uid: str | None = None):
        super().__init__(message)
        self.code = code
        self.uid = uid


def parse_message(text: str) -> dict:
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc.msg}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("bad_json", "a message must be a JSON object")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r}; known: {list(MESSAGE_TYPES)}"
        )
    return message
