"""How the server logs: uvicorn's configuration with clonecast's own loggers beside it, and
no secret in any record. Every log record made in the server process (uvicorn's access log
with its `?api_key=` query, the WebSocket handshake's headers at debug, ASGI scopes at trace,
an exception's text) has its keys and tokens replaced by `[redacted]` when it is created, so
no handler, formatter or later configuration can print one.

What counts as a secret: the values of the query parameters api_key, token, access_token and
key (also percent-encoded, as Starlette would decode them), of the Authorization,
Proxy-Authorization and X-API-Key headers, a `bearer.KEY` subprotocol, a browser token
(`cct1.<claims>.<signature>`) anywhere, and the password of a URL (`postgresql://USER:PASSWORD@`,
a `password=` parameter: a shared voice store's)."""

from __future__ import annotations

import copy
import logging
import re
from urllib.parse import unquote_plus

REDACTED = "[redacted]"
SECRET_PARAMS = {"api_key", "token", "access_token", "key", "password"}
_PARAM = re.compile(r"(?<![\w%.-])([\w%.-]+)=(\[redacted\]|[^&\s\"'<>,;)\]}]*)")
_HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|x-api-key)(['\"]?\s*[:=,]\s*(?-i:b)?['\"]?)"
    r"([^'\"\r\n]*)"
)
_SUBPROTOCOL = re.compile(r"(?i)\bbearer\.[^\s,'\"]+")
_TOKEN = re.compile(r"\bcct1\.[\w-]+\.[\w-]+")
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^/\s:@]*:)([^@\s/]+)@")


def redact(text: str) -> str:
    """`text` with every key and token in it replaced by [redacted] (idempotent: a redacted
    text is left as it is)."""
    if "=" in text:
        text = _PARAM.sub(_param, text)
    text = _HEADER.sub(lambda m: m[1] + m[2] + REDACTED if m[3] else m[0], text)
    text = _SUBPROTOCOL.sub("bearer." + REDACTED, text)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m[1] + REDACTED + "@", text)
    return _TOKEN.sub("cct1." + REDACTED, text)


def _param(match: re.Match) -> str:
    if match[2] not in ("", REDACTED) and unquote_plus(match[1]).lower() in SECRET_PARAMS:
        return f"{match[1]}={REDACTED}"
    return match[0]


def _redact_record(record: logging.LogRecord) -> None:
    """In place: the message and each text argument (uvicorn's access formatter reads its
    arguments one by one); a secret that only the formatted message shows (a header's name
    and value given as two arguments) collapses the record to its redacted message."""
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    if isinstance(record.args, tuple):
        record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: the handler will report it, without our help
        message = None
    if message is not None and redact(message) != message:
        record.msg, record.args = redact(message), None
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def redact_secrets() -> None:
    """Every log record made from now on in this process is redacted (idempotent)."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacts", False):
        return

    def make(*args, **kwargs) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        _redact_record(record)
        return record

    make.redacts = True
    logging.setLogRecordFactory(make)


def log_config(level: str = "info") -> dict:
    """uvicorn's logging configuration plus the `clonecast` loggers (the per-utterance line,
    warnings, errors) on stderr beside uvicorn's own, at `level` (uvicorn's level names, as
    `--log-level` takes them; uvicorn sets its own loggers' level), and other libraries'
    warnings."""
    from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["clonecast"] = {
        "()": "uvicorn.logging.DefaultFormatter",
        "fmt": "%(levelprefix)s %(name)s: %(message)s",
    }
    config["handlers"]["clonecast"] = {
        "formatter": "clonecast",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
    }
    # on the root logger: clonecast's records reach it (and any handler a host process has
    # put there, such as pytest's), and other libraries' warnings are printed the same way
    config["root"] = {"handlers": ["clonecast"], "level": "WARNING"}
    config["loggers"]["clonecast"] = {"level": LOG_LEVELS[level]}
    return config
