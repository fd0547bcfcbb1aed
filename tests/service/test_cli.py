"""The CLI end to end, as a subprocess on the embedded default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
    env = {**os.environ, "CLONECAST_CACHE_DIR": str(tmp_path / "cache"), "CLONECAST_DEVICE": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_writes_rows_and_says_untrained(tmp_path):
    out = tmp_path / "codes.json"
    r = _run(["generate", "--text", "Hello CLI.", "--max-rows", "12", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "random weights" in r.stderr
    data = json.loads(out.read_text())
    assert data["untrained_default_model"] is True
    assert len(data["delayed_rows"]) == 12 and all(len(row) == 8 for row in data["delayed_rows"])


def test_generate_rejects_bad_parameters_clearly(tmp_path):
    r = _run(["generate", "--text", "x", "--top-p", "0"], tmp_path)
    assert r.returncode == 2
    assert "top_p must be in (0, 1]" in r.stderr
