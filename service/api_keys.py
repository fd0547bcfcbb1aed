"""The API keys a server accepts, held as names and SHA-256 digests only: from a key file
(`NAME SHA256HEX [admin]` lines: no plaintext at rest) and from keys given in plaintext
(CLONECAST_API_KEYS, --api-key), which are hashed at once and named by their owner label.
A presented key is hashed and compared against every digest in constant time. Knows nothing
of HTTP or WebSockets (service/auth.py reads keys off a request)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DIGEST = re.compile(r"[0-9a-fA-F]{64}")
KEY_PREFIX = "cck_"  # a key made by `clonecast key new`: recognisable in a leaked file


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def owner_of(digest: bytes) -> str:
    """The voices' owner label of a key: `k_` and 12 hex digits of its SHA-256, the same
    whether the key was given in plaintext or by its hash (its voices stay its own)."""
    return "k_" + digest.hex()[:12]


@dataclass(frozen=True)
class KeyEntry:
    name: str  # what logs and metrics show
    digest: bytes = b""  # SHA-256 of the key
    admin: bool = False

    def __repr__(self) -> str:  # never a digest in a log either
        return f"KeyEntry({self.name!r}, admin={self.admin})"


@dataclass(frozen=True)
class KeyRing:
    entries: tuple[KeyEntry, ...] = ()

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two API keys are named {name!r}")

    @classmethod
    def of(
        cls,
        keys: tuple[str, ...] = (),
        admin_keys: tuple[str, ...] = (),
        file_entries: tuple[KeyEntry, ...] = (),
    ) -> KeyRing:
        """Each key once: its key file entry (with its name) first, then an admin key's (a key
        given as both is an admin's)."""
        entries, digests = [], set()
        plain = (*plaintext_entries(admin_keys, True), *plaintext_entries(keys))
        for entry in (*file_entries, *plain):
            if entry.digest not in digests:
                digests.add(entry.digest)
                entries.append(entry)
        return cls(tuple(entries))

    @property
    def open(self) -> bool:
        """No keys: every request is accepted (and everything is everyone's)."""
        return not self.entries

    def match(self, key: str | None) -> KeyEntry | None:
        """The entry of `key`, or None. Every digest is compared (constant time each), so
        timing tells neither which entry nearly matched nor where it is."""
        if key is None:
            return None
        presented = digest_of(key)
        found = None
        for entry in self.entries:
            if hmac.compare_digest(presented, entry.digest) and found is None:
                found = entry
        return found


def plaintext_entries(keys: tuple[str, ...], admin: bool = False) -> tuple[KeyEntry, ...]:
    """Keys given in plaintext, hashed now; each named by its owner label (a stable name that
    is not the key)."""
    return tuple(KeyEntry(owner_of(digest_of(k)), digest_of(k), admin) for k in keys)


def read_key_file(path: Path) -> tuple[KeyEntry, ...]:
    """`NAME SHA256HEX [admin]` per line; `#` comments and blank lines are skipped.
    ValueError names the file and the line of a bad entry."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"CLONECAST_API_KEY_FILE {str(path)!r} cannot be read: {exc}") from exc
    entries, digests = [], set()
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"CLONECAST_API_KEY_FILE {str(path)!r} line {number}"
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "admin"):
            raise ValueError(f"{where}: expected 'NAME SHA256HEX' or 'NAME SHA256HEX admin'")
        name, hex_digest = fields[0], fields[1]
        if not NAME.fullmatch(name):
            raise ValueError(f"{where}: a name is 1-64 letters, digits, '_', '.' or '-'")
        if not DIGEST.fullmatch(hex_digest):
            raise ValueError(
                f"{where}: the hash must be 64 hex digits (the key's SHA-256; "
                "`clonecast key new NAME` makes a line)"
            )
        digest = bytes.fromhex(hex_digest)
        if digest in digests:
            raise ValueError(f"{where}: this hash is already another name's")
        if any(e.name == name for e in entries):
            raise ValueError(f"{where}: the name {name!r} is already used")
        digests.add(digest)
        entries.append(KeyEntry(name, digest, len(fields) == 3))
    return tuple(entries)


def new_key() -> str:
    """A fresh random key: 256 bits, URL-safe (fine in a query string and a subprotocol)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_file_line(name: str, key: str, admin: bool = False) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"a key name is 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    return f"{name} {hashlib.sha256(key.encode()).hexdigest()}" + (" admin" if admin else "")
