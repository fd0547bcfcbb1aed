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
