"""A real PostgreSQL for tests, from Debian's `postgresql` package: a cluster initialised in a
temporary directory and started on a free loopback port (its unix socket in that directory
too), password authentication over TCP, stopped and removed afterwards. As root, the server
runs as `nobody` (PostgreSQL refuses to run as root). Without the binaries the tests that
need it skip, saying so (`make system-deps` installs the package)."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.serve_process import free_port

SUPERUSER = "clonecast"
PASSWORD = "pg-secret-7f3a"  # tests grep for it: it must never be shown


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_version)
    return Path(found[-1]).parent if found else None


def _version(path: str) -> float:
    try:
        return float(Path(path).parts[-3])
    except ValueError:
        return 0.0


class PostgresServer:
    """`url(db)`: a postgresql:// URL for a database of this cluster; `new_database()`: an
    empty database of its own for each test."""

    def __init__(self):
        bin_dir = _bin_dir()
        if bin_dir is None:
            pytest.skip("no PostgreSQL: Debian's postgresql package (make system-deps installs it)")
        self.bin = bin_dir
        root = os.geteuid() == 0
        # as root, in /tmp itself (not a $TMPDIR that `nobody` may not enter)
        self.root = Path(tempfile.mkdtemp(prefix="clonecast-pg-", dir="/tmp" if root else None))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_user = ["runuser", "-u", "nobody", "--"] if root else []
        try:
            self._start()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self._names = itertools.count()

    def _start(self) -> None:
        if self._as_user:
            shutil.chown(self.root, "nobody")
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self._as_user:
            shutil.chown(pwfile, "nobody")
        self._run(
            "initdb", "-D", self.data, "-U", SUPERUSER, "--pwfile", pwfile,
            "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", self.data, "-l", self.root / "log", "-o", options, "-w", "start")

    def url(self, database: str = "postgres", password: str = PASSWORD) -> str:
        return f"postgresql://{SUPERUSER}:{password}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        name = f"voices_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, tool: str, *args, check: bool = True) -> None:
        command = [*self._as_user, str(self.bin / tool), *map(str, args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} failed: {done.stderr or done.stdout}\n{tail}")
