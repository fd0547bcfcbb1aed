"""The Grafana dashboard (grafana/generate.py -> grafana/dashboards/clonecast.json): the JSON
is what the script generates, it follows the dashboard-linter's rules (one datasource
variable, job and instance variables, `$__rate_interval` in every rate, a unit, title and
description on every panel, every query on the datasource variable), and every metric it
queries is one a real server exports and docs/protocol.md documents."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "clonecast.json"


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def test_the_committed_json_is_what_the_script_generates():
    result = subprocess.run(
        [sys.executable, "grafana/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_linter_rules_hold():
    board = _dashboard()
    variables = board["templating"]["list"]
    datasources = [v for v in variables if v["type"] == "datasource"]
    assert len(datasources) == 1 and datasources[0]["query"] == "prometheus"
    assert {v["name"] for v in variables} >= {"datasource", "job", "instance"}
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    windows = 0
    for p in board["panels"]:
        assert p["title"] and p["description"], p
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            for window in re.findall(r"\b(?:rate|irate|increase)\([^\[]*\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", (p["title"], t["expr"])
                windows += 1
            if "clonecast_" in t["expr"]:
                assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"]
    assert windows >= 10  # the rule was applied to the rates, not to nothing


def _queried_metrics() -> set[str]:
    names = set()
    for expr in _exprs():
        names |= set(re.findall(r"\b(clonecast_[a-z_]+)", expr))
    return names


def _base(name: str) -> str:
    return re.sub(r"_(bucket|count|sum|total)$", "", name)


def test_every_queried_metric_is_exported_and_documented(server):
    exported = set()
    for line in httpx.get(server.http + "/metrics", timeout=30).text.splitlines():
        if line.startswith("# TYPE "):
            exported.add(line.split()[2])
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    queried = _queried_metrics()
    assert queried, "no panel queries a clonecast metric"
    for name in sorted(queried):
        assert _base(name) in {_base(e) for e in exported}, f"{name} is not exported"
        documented = _base(name).removeprefix("clonecast_")
        assert documented in protocol, f"{name} is not documented in docs/protocol.md"


def test_the_first_audio_objective_is_a_bucket_edge():
    """The share within 320 ms is exact only if 0.32 is an edge of the histogram."""
    from service.metrics import FIRST_AUDIO_BUCKETS

    assert 0.32 in FIRST_AUDIO_BUCKETS
    assert any('le="0.32"' in expr for expr in _exprs())
