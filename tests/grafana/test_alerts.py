"""The Prometheus files (grafana/prometheus/): promtool accepts the scrape config and the
alerting rules, `promtool test rules` runs every alert on synthetic series (each fires where
it should and stays silent elsewhere), every alert is tested and documented, and every metric
an alert names is one a real server exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "grafana" / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed: run `make test` as root, or apt-get install prometheus"
    return subprocess.run([promtool, *args], cwd=PROM, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_config_and_the_rules():
    result = _promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_every_alert_fires_and_stays_silent_on_synthetic_series():
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_case_and_a_silent_one():
    """Each alert is expected to fire somewhere in alerts_test.yml, for some instances only
    (the series of the others stay silent in the same test)."""
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    for rule in _rules():
        name = rule["alert"]
        cases = [c for t in tests for c in t["alert_rule_test"] if c["alertname"] == name]
        firing = [c for c in cases if c["exp_alerts"]]
        assert firing, f"{name} is never expected to fire"
        for case in firing:
            test = next(t for t in tests if case in t["alert_rule_test"])
            instances = {
                re.search(r'instance="([^"]+)"', s["series"])[1] for s in test["input_series"]
            }
            fired = {a["exp_labels"]["instance"] for a in case["exp_alerts"]}
            assert fired < instances, f"{name}: no series that stays silent beside it"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_is_documented():
    doc = (ROOT / "docs" / "observability.md").read_text()
    for rule in _rules():
        assert f"`{rule['alert']}`" in doc, f"{rule['alert']} is not in docs/observability.md"


def test_every_metric_an_alert_names_is_exported(server):
    exported = set()
    for line in httpx.get(server.http + "/metrics", timeout=30).text.splitlines():
        if line.startswith("# TYPE "):
            exported.add(line.split()[2])
    suffix = re.compile(r"_(bucket|count|sum|total)$")
    for rule in _rules():
        for name in re.findall(r"\b((?:clonecast|process)_[a-z0-9_]+)\b", rule["expr"]):
            assert suffix.sub("", name) in {suffix.sub("", e) for e in exported}, (
                f"{rule['alert']}: {name} is not exported"
            )
