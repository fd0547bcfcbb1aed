"""The Python client as its own distribution (clients/python, `clonecast-client`): it
installs into a fresh environment with `websockets` and nothing heavier, imports without the
engine, and its command runs."""

from __future__ import annotations

import ast
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "python"
FORBIDDEN = ("engine", "kernels", "service", "torch", "torchaudio", "numpy", "starlette")


def test_the_client_imports_nothing_of_the_server():
    bad = []
    for path in (PACKAGE / "clonecast_client").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [(path.name, n) for n in names if n.split(".")[0] in FORBIDDEN]
    assert not bad, bad


def test_the_client_installs_alone_with_websockets_only(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(PACKAGE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = wheels.glob("clonecast_client-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines() if line}
    assert names - {"pip", "setuptools"} == {"clonecast-client", "websockets"}, names
    code = (
        "import sys, clonecast_client\n"
        "from clonecast_client import AsyncClient, Client, ClonecastError\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    imported = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported
    helped = subprocess.run(
        [str(env_dir / "bin" / "clonecast-say"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "--text" in helped.stdout, helped.stderr
