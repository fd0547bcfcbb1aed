"""The Grafana dashboard (grafana/generate.py -> grafana/dashboards/clonecast.json): the JSON
is what the script generates, it follows the dashboard-linter's rules (one datasource
variable, job and instance variables, `$__rate_interval` in every rate, a unit, title and
description on every panel, every query on the datasource variable), every field it sets is
one of Grafana's published dashboard schema (decoded by grafana-foundation-sdk, Grafana's
models generated from that schema, and encoded back unchanged), every metric it queries is
one a real server exports, and every metric a server exports is documented in
docs/observability.md."""

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


def _panels() -> list[dict]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]  # rows are headings


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


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
    for p in _panels():
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
        names |= set(re.findall(r"\b((?:clonecast|process)_[a-z0-9_]+)", expr))
    return names


def _base(name: str) -> str:
    return re.sub(r"_(bucket|count|sum|total|info)$", "", name)


def _exported(server) -> set[str]:
    text = httpx.get(server.http + "/metrics", timeout=30).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_every_queried_metric_is_exported(server):
    exported = {_base(e) for e in _exported(server)}
    queried = _queried_metrics()
    assert len(queried) >= 25, queried  # the panels really were searched
    for name in sorted(queried):
        assert _base(name) in exported, f"{name} is not exported"


def test_every_exported_metric_is_documented(server):
    """Each series of clonecast's own (not the process collector's) has its row in the
    metrics table of docs/observability.md, by its exposed name."""
    doc = (ROOT / "docs" / "observability.md").read_text()
    ours = sorted(e for e in _exported(server) if e.startswith("clonecast_"))
    assert len(ours) >= 30, ours
    for name in ours:
        assert re.search(rf"`{_base(name)}(_total|_info)?[`{{]", doc), f"{name} is undocumented"


def test_the_dashboard_is_grafanas_schema():
    """Decoded by Grafana's schema models and encoded back, the dashboard is unchanged: no
    field is unknown to the schema (the decoder drops those) or of a kind it reshapes."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()  # panel and query kinds: timeseries, table, prometheus
    board = _dashboard()
    again = json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))
    assert _lost(board, again) == []


def _lost(ours, theirs, path: str = "") -> list[str]:
    """Where `theirs` lacks or changed something of `ours` (it may add defaults)."""
    if isinstance(ours, dict):
        if not isinstance(theirs, dict):
            return [path]
        return [
            p
            for key, value in ours.items()
            for p in (
                [f"{path}/{key}"]
                if key not in theirs
                else _lost(value, theirs[key], f"{path}/{key}")
            )
        ]
    if isinstance(ours, list):
        if not isinstance(theirs, list) or len(ours) != len(theirs):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if ours == theirs else [path]


def test_the_first_audio_objective_is_a_bucket_edge():
    """The share within 320 ms is exact only if 0.32 is an edge of the histogram."""
    from service.metrics import FIRST_AUDIO_BUCKETS

    assert 0.32 in FIRST_AUDIO_BUCKETS
    assert any('le="0.32"' in expr for expr in _exprs())
