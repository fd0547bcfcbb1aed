"""Short-lived browser tokens: a page must never hold a long-lived API key, so a backend with
one asks `POST /v1/tokens` for a token that expires (and may be bound to the page's origin)
and hands that to the browser, which connects with `?token=`.

A token is `cct1.<claims>.<signature>`: the claims (expiry, origin, the issuing key's owner
label, so the page sees that key's voices, its name, so the page counts against that key's
limits, and a nonce) as base64url
JSON, signed with HMAC-SHA256 under the server's secret (CLONECAST_TOKEN_SECRET, shared by
the servers behind one balancer; random per start when unset, so a restart invalidates the
tokens it issued). Nothing is stored: verification is the signature, the clock, the origin.
Standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

PREFIX = "cct1"
DEFAULT_TTL_S = 600
MAX_TTL_S = 3600


class TokenError(ValueError):
    """Why a token is refused (the client gets `unauthorized` with this message)."""


@dataclass(frozen=True)
class Token:
    token: str
    expires_at: int  # seconds since the epoch
    origin: str | None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenIssuer:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def mint(
        self,
        ttl_s: int = DEFAULT_TTL_S,
        origin: str | None = None,
        owner: str | None = None,
        key_name: str | None = None,
    ) -> Token:
        expires = int(time.time()) + ttl_s
        claims = {"exp": expires, "origin": origin, "own": owner, "nonce": secrets.token_hex(8)}
        if key_name is not None:
            claims["key"] = key_name
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return Token(f"{PREFIX}.{body}.{self._sign(body)}", expires, origin)

    def verify(self, token: str, origin: str | None) -> tuple[str | None, str | None]:
        """The owner label and the name of the key that asked for it (a token of a server
        without keys: None, None); raises TokenError unless `token` is ours, unexpired, and
        (if bound) from `origin`."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise TokenError("not a clonecast token")
        _, body, signature = parts
        if not hmac.compare_digest(signature, self._sign(body)):
            raise TokenError("the token's signature is not valid (forged, or another server's)")
        try:
            claims = json.loads(_unb64(body))
            expires = int(claims["exp"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenError("the token's claims cannot be read") from exc
        if expires <= time.time():
            raise TokenError("the token has expired: ask your backend for a new one")
        bound = claims.get("origin")
        if bound is not None and bound != origin:
            raise TokenError("the token is bound to another origin")
        owner = claims.get("own")
        return owner, claims.get("key", owner)

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
