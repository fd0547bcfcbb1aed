"""API keys (compared in constant time), who a caller is, and allowed browser origins."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """Who is asking: `owner` labels the key's voices (`k_` and 12 hex digits of the key's
    SHA-256: never the key), None when the server has no keys (everything is everyone's);
    an admin key sees and deletes every voice."""

    owner: str | None = None
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        return self.owner is None or self.admin or owner is None or owner == self.owner


OPEN = Caller()  # a server without keys


def owner_label(key: str) -> str:
    return "k_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def caller_for(
    key: str | None, keys: tuple[str, ...], admin_keys: tuple[str, ...]
) -> Caller | None:
    """The caller a key makes, or None when the key is not accepted."""
    if not keys and not admin_keys:
        return OPEN
    if key is None:
        return None
    if admin_keys and key_allowed(key, admin_keys):
        return Caller(owner_label(key), admin=True)
    if keys and key_allowed(key, keys):
        return Caller(owner_label(key))
    return None


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
