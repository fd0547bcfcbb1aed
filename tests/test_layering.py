"""Imports go one way: service -> engine (public names only) -> kernels -> torch/triton; the
bookkeeping modules import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOKKEEPING = [
    "engine.streaming",
    "engine.codec.voice_cache",
    "engine.config",
    "engine.prompt",
    "engine.request",
    "engine.block_manager",
    "engine.scheduler",
    "engine.stats",
]


def _imports(package: str):
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.module


def test_engine_and_kernels_never_import_upward():
    bad = [(p, m) for p, m in _imports("engine") if m.split(".")[0] == "service"]
    bad += [(p, m) for p, m in _imports("kernels") if m.split(".")[0] in ("service", "engine")]
    assert not bad, bad


def test_service_does_not_use_torch_directly():
    heavy = ("torch", "torchaudio", "triton")
    bad = [(p, m) for p, m in _imports("service") if m.split(".")[0] in heavy]
    assert not bad, bad


def test_service_uses_only_the_engine_public_api():
    bad = [
        (p, m)
        for p, m in _imports("service")
        if m.startswith("engine.") or m.split(".")[0] == "kernels"
    ]
    assert not bad, bad


def test_bookkeeping_imports_no_torch():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in BOOKKEEPING)
        + "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
