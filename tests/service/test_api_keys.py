"""API keys held as names and SHA-256 digests (service/api_keys.py): the key file, its
errors, the ring's matching, and `clonecast key new`."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from service.api_keys import KeyRing, key_file_line, new_key, owner_of, read_key_file
from service.auth import caller_for, owner_label

ROOT = Path(__file__).resolve().parents[2]


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_key_file_gives_named_keys_and_admins(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        f"# tenants\n\nalice {_hex('ka')}\n  bob {_hex('kb').upper()}  # upper case too\n"
        f"ops {_hex('ko')} admin\n"
    )
    ring = KeyRing.of(file_entries=read_key_file(path))
    alice, bob, ops = (caller_for(k, ring) for k in ("ka", "kb", "ko"))
    assert (alice.name, alice.admin, alice.owner) == ("alice", False, owner_label("ka"))
    assert (bob.name, ops.name, ops.admin) == ("bob", "ops", True)
    assert caller_for("kc", ring) is None and caller_for(None, ring) is None
    assert caller_for(_hex("ka"), ring) is None  # the hash is not the key
    assert "ka" not in repr(ring) and _hex("ka") not in repr(ring)


def test_plaintext_keys_are_named_by_their_owner_label_and_keep_their_voices(tmp_path):
    ring = KeyRing.of(("k1", "k2"), ("adm",))
    k1 = caller_for("k1", ring)
    assert k1.name == k1.owner == owner_label("k1") == "k_" + _hex("k1")[:12]
    assert caller_for("adm", ring).admin
    assert caller_for("x", KeyRing()).owner is None  # no keys: everything is everyone's
    # the same key from a file has the same owner (its voices stay its own), and its name
    (tmp_path / "keys").write_text(f"alice {_hex('k1')}\n")
    both = KeyRing.of(("k1",), (), read_key_file(tmp_path / "keys"))
    assert len(both.entries) == 1
    assert caller_for("k1", both).name == "alice"
    assert caller_for("k1", both).owner == owner_of(hashlib.sha256(b"k1").digest())


@pytest.mark.parametrize(
    "text, why",
    [
        ("alice\n", "expected 'NAME SHA256HEX'"),
        (f"alice {_hex('a')} root\n", "expected 'NAME SHA256HEX'"),
        ("alice 1234\n", "64 hex digits"),
        (f"al ice {_hex('a')}\n", "expected"),
        (f"al/ice {_hex('a')}\n", "1-64 letters"),
        (f"a {_hex('a')}\nb {_hex('a')}\n", "already another name's"),
        (f"a {_hex('a')}\na {_hex('b')}\n", "already used"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_and_the_line(tmp_path, text, why):
    path = tmp_path / "keys"
    path.write_text("# header\n" + text)
    with pytest.raises(ValueError, match=why) as info:
        read_key_file(path)
    message = str(info.value)
    assert str(path) in message and f"line {text.count(chr(10)) + 1}" in message
    assert "\n" not in message


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="cannot be read") as info:
        read_key_file(tmp_path / "nope")
    assert "nope" in str(info.value)


def test_new_keys_are_random_and_lines_carry_their_hash():
    a, b = new_key(), new_key()
    assert a != b and len(a) > 40
    assert key_file_line("alice", a) == f"alice {_hex(a)}"
    assert key_file_line("ops", a, admin=True).endswith(" admin")
    with pytest.raises(ValueError, match="key name"):
        key_file_line("bad name", a)


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "key", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_key_new_prints_the_line_on_stdout_and_the_key_once_on_stderr(tmp_path):
    r = _cli("new", "alice")
    assert r.returncode == 0, r.stderr
    key = r.stderr.strip().rsplit(" ", 1)[1]
    assert r.stdout == f"alice {_hex(key)}\n" and key not in r.stdout
    (tmp_path / "keys").write_text(r.stdout)
    ring = KeyRing.of(file_entries=read_key_file(tmp_path / "keys"))
    assert caller_for(key, ring).name == "alice"
    r = _cli("new", "legacy", "--admin", "--stdin", stdin="k1\n")
    assert r.returncode == 0 and r.stdout == f"legacy {_hex('k1')} admin\n" and r.stderr == ""
    r = _cli("new", "no/slash")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stdout == ""


def test_a_bad_secret_in_a_config_file_is_named_but_never_shown(tmp_path):
    from service.config import config_file

    path = tmp_path / "clonecast.toml"
    path.write_text('CLONECAST_API_KEYS = ["conf-secret-1", 2]\n')
    with pytest.raises(ValueError, match="CLONECAST_API_KEYS") as info:
        config_file(path)
    assert "conf-secret-1" not in str(info.value)
    path.write_text("CLONECAST_PORT = {x = 1}\n")  # not a secret: shown, as before
    with pytest.raises(ValueError, match=r"\{'x': 1\}"):
        config_file(path)
