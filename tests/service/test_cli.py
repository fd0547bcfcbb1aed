"""The CLI end to end, as a subprocess on the embedded default model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, env_extra: dict | None = None):
    env = {**os.environ, "CLONECAST_CACHE_DIR": str(tmp_path / "cache"), "CLONECAST_DEVICE": "cpu"}
    env.update(env_extra or {})
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


def test_synthesize_writes_a_wav_of_the_streamed_audio(tmp_path):
    """`clonecast synthesize` with a reference recording: a 24 kHz mono WAV whose length is
    the streamed frames of `--max-rows` rows (rows - 7 lag - 1 terminal frame, 40 ms each)."""
    import numpy as np
    import soundfile as sf

    ref = tmp_path / "ref.wav"
    t = np.arange(48000) / 24000
    sf.write(ref, (0.3 * np.sin(2 * np.pi * 160 * t)).astype(np.float32), 24000)
    out = tmp_path / "speech.wav"
    args = ["synthesize", "--text", "Hello there.", "--reference", str(ref), "--max-rows", "30"]
    r = _run([*args, "--seed", "3", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    audio, rate = sf.read(out, dtype="int16")
    assert rate == 24000 and audio.ndim == 1
    assert len(audio) == (30 - 7 - 1) * 960
    r = _run(["synthesize", "--text", "x", "--top-p", "0", "--out", str(out)], tmp_path)
    assert r.returncode != 0 and "top_p" in r.stderr
    missing = ["synthesize", "--text", "x", "--reference", str(tmp_path / "none.wav")]
    r = _run(missing, tmp_path)
    assert r.returncode == 2 and "cannot read the reference recording" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    r = _run(["synthesize", "--text", "x", "--reference", str(tmp_path / "bad.wav")], tmp_path)
    assert r.returncode == 2 and "could not be decoded" in r.stderr


def test_serve_passes_the_kv_cache_dtype_and_refuses_unknown_ones(monkeypatch, capsys):
    """`clonecast serve --kv-cache-dtype fp8` reaches the service settings (the engine's
    config); an unknown value is refused by the parser, naming the choices."""
    from types import SimpleNamespace

    import pytest

    import service.app
    import service.drain
    from service import cli

    seen = {}

    def create_app(settings):
        seen["s"] = settings
        services = SimpleNamespace(load_error=None, on_load_failed=None)
        return SimpleNamespace(state=SimpleNamespace(services=services))

    monkeypatch.setattr(service.app, "create_app", create_app)
    monkeypatch.setattr(
        service.drain, "DrainingServer", lambda config, services: SimpleNamespace(run=lambda: None)
    )
    monkeypatch.setattr(cli, "_check_port", lambda host, port: None)
    monkeypatch.delenv("CLONECAST_KV_CACHE_DTYPE", raising=False)
    # uvicorn.Config applies serve's logging configuration to this process: its handlers
    # would keep writing to this test's captured stderr, closed once the test ends
    for logger in (logging.root, logging.getLogger("clonecast")):
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "level", logger.level)
    assert cli.main(["serve", "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 0
    assert seen["s"].kv_cache_dtype == "fp8"
    seen.clear()
    assert cli.main(["serve", "--device", "cpu"]) == 0
    assert seen["s"].kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--kv-cache-dtype", "int8"])
    assert "invalid choice" in capsys.readouterr().err


def test_version_and_help_answer_without_loading_torch(tmp_path):
    probe = (
        "import sys, contextlib, io\n"
        "from service.cli import main\n"
        "for argv in (['--version'], ['--help'], ['serve', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    version = _run(["--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == "clonecast 0.1.0"


def test_a_bad_setting_fails_in_one_line_naming_it(tmp_path):
    env_bad = {"CLONECAST_LOG_FORMAT": "xml", "CLONECAST_PLAN": "[1]"}
    for name, value in env_bad.items():
        env = {**os.environ, name: value, "CLONECAST_CACHE_DIR": str(tmp_path)}
        r = subprocess.run(
            [sys.executable, "-m", "service.cli", "serve", "--port", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        [line] = r.stderr.strip().splitlines()
        assert line.startswith("error: ") and name in line


def test_a_port_in_use_and_a_failed_load_are_one_line(tmp_path):
    """Before the model loads, a port in use names the setting (exit 2); a model that fails
    to load stops the server after binding, in one line (exit 1)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run(["serve", "--port", str(port)], tmp_path)
    assert r.returncode == 2 and "CLONECAST_PORT" in r.stderr.strip().splitlines()[-1]
    missing = tmp_path / "no-such-model"  # a path: refused before loading, naming it
    r = _run(["serve", "--port", "0", "--model", str(missing)], tmp_path)
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "no-such-model" in line and "CLONECAST_MODEL" in line
    broken = tmp_path / "broken-model"  # a directory that is no checkpoint: the load fails
    broken.mkdir()
    r = _run(["serve", "--port", "0", "--model", str(broken)], tmp_path)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "broken-model" in last


def test_hugging_faces_kernels_beside_ours_is_one_clear_line(tmp_path):
    """Hugging Face's `kernels` distribution shares our kernels package's import name: an
    engine refuses to load beside it, naming the way out, instead of failing inside
    transformers (here its metadata alone, on the path of the process). Before binding,
    `generate` ends with that line (exit 2); `serve` binds, fails its load with it (exit 1);
    commands without an engine are unaffected."""
    dist = tmp_path / "site" / "kernels-0.19.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    site = str(tmp_path / "site")
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    r = _run(["generate", "--text", "Hi.", "--out", str(tmp_path / "c.json")], tmp_path, env)
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: Hugging Face's `kernels` package (0.19.1)")
    assert "virtual environment of its own" in line
    r = _run(["serve", "--port", "0"], tmp_path, env)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Hugging Face's `kernels` package (0.19.1)" in last
    assert _run(["key", "new", "ci-key"], tmp_path, env).returncode == 0  # no engine: no check
