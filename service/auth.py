"""Who a caller is (from its API key: service/api_keys.py holds and compares them), where a
request carries its key, and allowed browser origins."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from service.api_keys import KeyRing, digest_of, owner_of


@dataclass(frozen=True)
class Caller:
    """Who is asking: `owner` labels the key's voices (`k_` and 12 hex digits of the key's
    SHA-256: never the key), None when the server has no keys (everything is everyone's);
    an admin key sees and deletes every voice. `name`: the key's name, what logs, metrics
    and the per-key limits know it by (its owner label for a key given in plaintext)."""

    owner: str | None = None
    admin: bool = False
    name: str | None = None

    def sees(self, owner: str | None) -> bool:
        return self.owner is None or self.admin or owner is None or owner == self.owner


OPEN = Caller()  # a server without keys


def owner_label(key: str) -> str:
    return owner_of(digest_of(key))


def caller_for(key: str | None, ring: KeyRing) -> Caller | None:
    """The caller a key makes, or None when the key is not accepted."""
    if ring.open:
        return OPEN
    entry = ring.match(key)
    if entry is None:
        return None
    return Caller(owner_of(entry.digest), entry.admin, entry.name)


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


def origin_allowed(origin: str | None, allowed: tuple[str, ...]) -> bool:
    """Non-browser clients send no Origin and are always allowed."""
    return not allowed or origin is None or origin in allowed
