"""Secrets never reach a log (service/logs.py): what is redacted, in the shapes uvicorn and
the WebSocket library log it, and every record of the process once it is installed (the
real server's logs are grepped in tests/service/test_secrets_in_logs.py)."""

from __future__ import annotations

import io
import logging

import pytest
from uvicorn.logging import AccessFormatter

from service.logs import REDACTED, log_config, redact, redact_secrets


@pytest.mark.parametrize(
    "line, secret",
    [
        ('127.0.0.1:5 - "POST /v1/audio/speech?api_key=secret1 HTTP/1.1" 200', "secret1"),
        ("GET /v1/stream?x=1&token=cct1.abc.def&y=2", "abc.def"),
        ("GET /v1/stream?api%5Fkey=pct-secret", "pct-secret"),
        ("GET /v1/stream?API_KEY=upper-secret", "upper-secret"),
        ("< Authorization: Bearer hdr-secret", "hdr-secret"),
        ("< authorization: Basic azE6cGFzcw==", "azE6cGFzcw=="),
        ("< X-API-Key: xkey-secret", "xkey-secret"),
        ("< Sec-WebSocket-Protocol: clonecast.v1, bearer.sub-secret", "sub-secret"),
        ("scope={'query_string': b'api_key=scope-secret', 'headers': []}", "scope-secret"),
        ("[(b'authorization', b'Bearer tuple-secret'), (b'host', b'x')]", "tuple-secret"),
        ("[(b'x-api-key', b'tuple-x-secret')]", "tuple-x-secret"),
        ("the token cct1.eyJleHAiOjF9.c2lnbmF0dXJl was refused", "eyJleHAiOjF9"),
        ("CLONECAST_VOICE_STORE=postgresql://cc:pg-pass@db:5432/voices", "pg-pass"),
        ("postgres://cc@db/voices?sslmode=require&password=pg-query", "pg-query"),
        ("conninfo dbname=voices password=pg-kw host=db", "pg-kw"),
    ],
)
def test_keys_and_tokens_are_redacted_wherever_they_appear(line, secret):
    out = redact(line)
    assert secret not in out and REDACTED in out
    assert redact(out) == out


def test_everything_else_is_left_as_it_was():
    for line in (
        'utterance="s_1/a" transport="http" key="alice" voice="v_x" outcome="eos"',
        "GET /v1/voices?name=bob&transcript=hello HTTP/1.1",
        "monkey=1 turkey=2 keyboard",
        "bearer token missing",
        "the voice store postgresql://db:5432/voices cannot be opened",
    ):
        assert redact(line) == line


def test_every_record_is_redacted_also_through_uvicorns_access_formatter():
    redact_secrets()
    redact_secrets()  # idempotent: one wrapper
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(AccessFormatter("%(client_addr)s - %(request_line)s %(status_code)s"))
    access = logging.getLogger("test.logs.access")
    access.addHandler(handler)
    access.propagate = False
    access.warning(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:9", "POST", "/v1/x?api_key=acc-secret", "1.1", 200
    )
    plain = logging.getLogger("test.logs.plain")
    plain_handler = logging.StreamHandler(stream)
    plain.addHandler(plain_handler)
    plain.propagate = False
    plain.warning("< %s: %s", "Authorization", "Bearer split-secret")  # name and value apart
    try:
        raise ValueError("bad key ?api_key=exc-secret")
    except ValueError:
        plain.exception("failed")
    text = stream.getvalue()
    for secret in ("acc-secret", "split-secret", "exc-secret"):
        assert secret not in text
    assert "POST /v1/x?api_key=[redacted] HTTP/1.1 200" in text
    assert "< Authorization: [redacted]\n" in text and "ValueError" in text


def test_the_log_config_adds_clonecasts_loggers_at_the_level():
    config = log_config("debug")
    assert config["loggers"]["clonecast"]["level"] == logging.DEBUG
    assert config["root"]["handlers"] == ["clonecast"]  # clonecast's records propagate there
    assert config["loggers"]["uvicorn.access"]["handlers"] == ["access"]
