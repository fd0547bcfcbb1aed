"""API keys (compared in constant time) and allowed browser origins."""

from __future__ import annotations

import hmac
from collections.abc import Mapping


def extract_key(
    headers: Mapping[str, str], query: Mapping[str, str], subprotocols: list[str]
) -> str | None:
    """The key from `Authorization: Bearer`, `X-API-Key`, `?api_key=` or a `bearer.KEY`
    subprotocol, in that order."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if headers.get("x-api-key"):
        return headers["x-api-key"].strip()
    if query.get("api_key"):
        return query["api_key"]
    for proto in subprotocols:
        if proto.startswith("bearer."):
            return proto[len("bearer.") :]
    return None


def key_allowed(key: str | None, keys: tuple[str, ...]) -> bool:
    """True when no keys are configured, or `key` equals one of them. Every configured key is
    compared (constant time per key) so timing does not reveal which one nearly matched."""
    if not keys:
        return True
    if key is None:
        return False
    ok = False
    for candidate in keys:
        ok |= hmac.compare_digest(key.encode(), candidate.encode())
    return ok


def origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """Non-browser clients send no Origin and are always allowed."""
    return not allowed or origin is None or origin in allowed
