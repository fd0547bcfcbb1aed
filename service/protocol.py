"""Parsing of client messages of `clonecast.v1`; every rejection is a `ProtocolError` with
the stable error code the client receives (docs/protocol.md)."""

from __future__ import annotations

import base64
import binascii
import json
import math

from engine import (
    FRAMES_PER_SECOND,
    MAX_AUDIO_SECONDS,
    MAX_ROWS,
    NUM_CODEBOOKS,
    ConfigError,
    SamplingParams,
)
from service.audio_format import OutputFormat

MESSAGE_TYPES = ("speak", "append", "flush", "cancel", "voice.create", "voice.upload", "ping")


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, uid: str | None = None, **extra):
        """`extra`: more fields of the error message (`retry_after_s` of `rate_limited`)."""
        super().__init__(message)
        self.code = code
        self.uid = uid
        self.extra = extra


MAX_TRANSCRIPT_CHARS = 4096  # a reference of at most 30 s says far less than this


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str | bytes) -> object:
    """Strict JSON (WebSocket messages and HTTP bodies alike): no NaN or Infinity, nesting
    the parser can follow, and strings of valid Unicode (a `\\ud800` escape decodes to a lone
    surrogate, which no text can hold). Anything else is a `bad_json` ProtocolError."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc.msg}") from exc
    except RecursionError as exc:
        raise ProtocolError("bad_json", "not valid JSON: nested too deeply") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc}") from exc
    # surrogates can only come from \u escapes: skip the check when there are none
    escaped = b"\\u" in text if isinstance(text, bytes) else "\\u" in text
    if escaped:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ProtocolError(
                "bad_json", "not valid JSON: a string holds a lone UTF-16 surrogate"
            ) from exc
    return value


def as_object(text: str) -> dict:
    """The message as a JSON object, or {} when it is none (for an error's ids only)."""
    try:
        value = loads_json(text)
    except ProtocolError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_message(text: str) -> dict:
    message = loads_json(text)
    if not isinstance(message, dict):
        raise ProtocolError("bad_json", "a message must be a JSON object")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(
            "unknown_type", f"unknown message type {kind!r}; known: {list(MESSAGE_TYPES)}"
        )
    return message


def parse_params(
    params: object, output: object, uid: str | None = None, default_max_s: float | None = None
) -> tuple[SamplingParams, OutputFormat]:
    """`params` and `output` of a speak (or an HTTP speech request) -> validated objects.
    `max_duration_s` (0, 81.6] becomes the row cap: ceil(s * 25) frames + the 8-row ramp
    (seven rows before the first complete frame, one for the frame the stream drops); when
    absent, `default_max_s` if given (the server's default for its model), else 81.6 s."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ProtocolError("bad_parameter", "'params' must be an object", uid)
    raw = dict(params)
    if "max_rows" in raw:  # the engine's own cap, set from max_duration_s; not a protocol field
        raise ProtocolError(
            "bad_parameter", "unknown parameter 'max_rows': the length cap is max_duration_s", uid
        )
    try:
        max_s = raw.pop("max_duration_s", default_max_s)
        if max_s is not None:
            if (
                not isinstance(max_s, (int, float))
                or isinstance(max_s, bool)
                or not 0 < max_s <= MAX_AUDIO_SECONDS
            ):
                raise ConfigError(
                    f"max_duration_s must be in (0, {MAX_AUDIO_SECONDS:g}], got {max_s!r}"
                )
            frames = math.ceil(max_s * FRAMES_PER_SECOND)
            raw["max_rows"] = min(MAX_ROWS, frames + NUM_CODEBOOKS)
        sampling = SamplingParams.from_dict(raw)
        fmt = OutputFormat.parse(output)
    except (ConfigError, ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError("bad_parameter", str(exc), uid) from exc
    return sampling, fmt


def decode_b64(value, field: str, max_bytes: int, uid: str | None = None) -> bytes:
    """Reference audio sent as base64; empty is `audio_empty`, as an empty HTTP upload."""
    if value == "":
        raise ProtocolError(
            "audio_empty", f"'{field}' is empty: the reference audio has 0 bytes", uid
        )
    if not isinstance(value, str):
        raise ProtocolError("bad_request", f"'{field}' must be a non-empty base64 string", uid)
    if len(value) * 3 // 4 > max_bytes:
        raise ProtocolError(
            "message_too_large", f"reference audio is limited to {max_bytes} bytes", uid
        )
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad_request", f"'{field}' is not valid base64", uid) from exc


def check_transcript(value, uid: str | None = None) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError("bad_request", "'transcript' must be a string", uid)
    if value is not None and len(value) > MAX_TRANSCRIPT_CHARS:
        raise ProtocolError(
            "text_too_long", f"'transcript' is limited to {MAX_TRANSCRIPT_CHARS} characters", uid
        )
    return value


def parse_id(message: dict) -> str:
    uid = message.get("id")
    if not isinstance(uid, str) or not uid or len(uid.encode()) > 255:
        raise ProtocolError("bad_request", "'id' must be a non-empty string of at most 255 bytes")
    return uid


def parse_text(message: dict, max_chars: int) -> str:
    """The whole text of a speak."""
    text = message.get("text")
    uid = message.get("id") if isinstance(message.get("id"), str) else None
    if not isinstance(text, str):
        raise ProtocolError("bad_request", "'text' must be a string", uid)
    if not text.strip():
        raise ProtocolError("empty_text", "nothing to speak: 'text' is empty", uid)
    if len(text) > max_chars:
        raise ProtocolError(
            "text_too_long", f"'text' is {len(text)} characters; the limit is {max_chars}", uid
        )
    return text


def parse_voice_id(message: dict, uid: str) -> str | None:
    """A voice_id, or None for none (absent, or "default" as over HTTP: no reference)."""
    voice_id = message.get("voice_id")
    if voice_id is not None and not isinstance(voice_id, str):
        raise ProtocolError("bad_request", "'voice_id' must be a string", uid)
    return None if voice_id == "default" else voice_id


def parse_inline_voice(message: dict, max_bytes: int, uid: str) -> tuple[bytes, str | None] | None:
    """A speak's (or first append's) inline `voice`: (audio bytes, transcript), or None."""
    inline = message.get("voice")
    if inline is None:
        return None
    if not isinstance(inline, dict):
        raise ProtocolError("bad_request", "'voice' must be an object with audio_b64", uid)
    data = decode_b64(inline.get("audio_b64"), "voice.audio_b64", max_bytes, uid)
    return data, check_transcript(inline.get("transcript"), uid)


def parse_upload(message: dict, max_bytes: int) -> int:
    """The announced size of a voice.upload's binary frame (its transcript checked too)."""
    size = message.get("bytes")
    if size == 0 and not isinstance(size, bool):
        raise ProtocolError("audio_empty", "voice.upload announced 0 bytes: the audio is empty")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ProtocolError(
            "bad_request", "voice.upload needs 'bytes': the size of the binary frame"
        )
    if size > max_bytes:
        raise ProtocolError(
            "message_too_large", f"reference uploads are limited to {max_bytes} bytes"
        )
    check_transcript(message.get("transcript"))
    return size
