"""Every script in benchmarks/ imports on a machine without a GPU: device time is scarce, and
a script that fails at its first line (a name moved to another module) wastes a whole call."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted(p.stem for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py"))


def test_there_are_scripts_to_check():
    assert {"serve_bench", "codec_throughput", "workspace_race_probe"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_script_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__, f"benchmarks/{name}.py opens with what it measures"


def test_server_procs_names_the_server_and_its_engine_and_survives_a_missing_py_spy(
    tmp_path, monkeypatch
):
    """benchmarks/server_procs.py, against a real `clonecast serve` on the CPU: once ready it
    names the server and its engine process; a dump whose py-spy cannot run says so in the
    output file for each process and goes on to the next time."""
    import time

    from benchmarks import server_procs
    from tests.serve_process import children, start_serve, stop_serve

    server, url, _ = start_serve(tmp_path)
    try:
        assert server_procs.wait_ready(int(url.rsplit(":", 1)[1]), limit_s=10)
        pids = server_procs.server_pids()
        assert str(server.pid) in pids
        assert {str(c) for c in children(server.pid)} <= set(pids)
        assert len(pids) >= 2  # the engine runs in a process of its own
        monkeypatch.setattr(server_procs, "PY_SPY", str(tmp_path / "no-py-spy"))
        out = tmp_path / "dump.txt"
        server_procs.dump(out, [0, 0.1], time.time())
        text = out.read_text()
        headers = text.count("=== 0 s after ready")
        assert headers >= 2 * 2  # two times, server and engine at least
        assert text.count("py-spy failed") == headers  # each one said, none stopped the rest
    finally:
        stop_serve(server)
