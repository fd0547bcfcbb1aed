"""The Grafana dashboard of clonecast, generated: `python grafana/generate.py` writes
grafana/dashboards/clonecast.json; `--check` fails when the committed JSON differs from what
this script makes (the JSON is never edited by hand). One datasource variable, job and
instance variables, `$__rate_interval` in every rate, a unit and a description on every
panel. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "clonecast.json"
SEL = 'job=~"$job", instance=~"$instance"'  # every query's selector
DS = {"type": "prometheus", "uid": "${datasource}"}


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{{{SEL}{extra}}}[$__rate_interval])"


def quantile(q: float, histogram: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket')}))"


def panel(title: str, description: str, unit: str, targets: list[tuple[str, str]], **extra):
    """A time series panel; `targets`: (PromQL, legend)."""
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        **extra,
    }


def panels() -> list[dict]:
    first = "clonecast_time_to_first_audio_seconds"
    in_time = rate(first + "_bucket", ', le="0.32"')
    within = f"sum by (transport) ({in_time}) / sum by (transport) ({rate(first + '_count')})"
    objective = {"thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None}]}}
    return [
        panel(
            "First audio (P50 / P95 / P99)",
            "Request received to first audio byte sent, by transport. The objective is 320 ms.",
            "s",
            [
                (quantile(q, first, "transport"), f"P{int(q * 100)} {{{{transport}}}}")
                for q in (0.5, 0.95, 0.99)
            ]
            + [("vector(0.32)", "objective 320 ms")],
            defaults=objective,
        ),
        panel(
            "Share of utterances with first audio within 320 ms",
            "Fraction of utterances whose first audio left within the 320 ms objective "
            "(0.32 s is a bucket edge of the histogram, so this is exact).",
            "percentunit",
            [(within, "{{transport}}")],
        ),
        panel(
            "Audio seconds per second",
            "Seconds of audio sent to clients per second of wall time, by transport.",
            "none",
            [(f"sum by (transport) ({rate('clonecast_audio_seconds_total')})", "{{transport}}")],
        ),
        panel(
            "Real-time factor (P50 / P95)",
            "Generation time over audio duration per utterance; below 1 is faster than real time.",
            "none",
            [(quantile(q, "clonecast_real_time_factor"), f"P{int(q * 100)}") for q in (0.5, 0.95)],
        ),
        panel(
            "Underruns per second",
            "Chunks that were ready only after the audio before them had finished playing.",
            "cps",
            [(f"sum by (transport) ({rate('clonecast_underruns_total')})", "{{transport}}")],
        ),
        panel(
            "Utterances ended, by reason",
            "Utterances per second that ended by eos, length, cancelled or error.",
            "reqps",
            [
                (
                    f"sum by (finished_reason) ({rate('clonecast_request_success_total')})",
                    "{{finished_reason}}",
                )
            ],
        ),
        panel(
            "Errors by code",
            "Errors sent to clients per second, by their protocol code.",
            "cps",
            [(f"sum by (code) ({rate('clonecast_errors_total')})", "{{code}}")],
        ),
        panel(
            "Requests running and waiting",
            "Engine requests (one per sentence segment) running in the batch and waiting for it.",
            "none",
            [
                (f"sum(clonecast_num_requests_running{{{SEL}}})", "running"),
                (f"sum(clonecast_num_requests_waiting{{{SEL}}})", "waiting"),
            ],
        ),
        panel(
            "Engine step time (P50 / P95)",
            "Duration of one engine step; each step yields 40 ms of audio per running stream.",
            "s",
            [
                (quantile(q, "clonecast_engine_step_seconds"), f"P{int(q * 100)}")
                for q in (0.5, 0.95)
            ],
        ),
        panel(
            "KV cache use",
            "Fraction of the KV cache's blocks in use.",
            "percentunit",
            [(f"max(clonecast_kv_cache_usage_perc{{{SEL}}})", "used")],
        ),
        panel(
            "Graph capture at start-up",
            "Seconds each graph family (backbone, sampler, codec) took to capture before /ready.",
            "s",
            [(f"max by (family) (clonecast_graph_capture_seconds{{{SEL}}})", "{{family}}")],
        ),
        panel(
            "WebSocket connections",
            "Open WebSocket connections.",
            "none",
            [(f"sum(clonecast_websocket_connections{{{SEL}}})", "connections")],
        ),
        panel(
            "Engine up",
            "1 while the engine (its process or thread) runs; 0 once it has exited.",
            "none",
            [(f"min(clonecast_engine_up{{{SEL}}})", "up")],
        ),
    ]


def dashboard() -> dict:
    laid = []
    for i, p in enumerate(panels()):
        laid.append(
            {**p, "id": i + 1, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}}
        )
    variable = {"type": "query", "refresh": 2, "includeAll": True, "multi": True, "datasource": DS}
    return {
        "title": "clonecast",
        "uid": "clonecast-overview",
        "description": "Voice cloning in real time: latency, throughput, streaming, the engine.",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["clonecast", "tts"],
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Datasource",
                    "query": "prometheus",
                },
                {
                    **variable,
                    "name": "job",
                    "label": "Job",
                    "query": "label_values(clonecast_engine_up, job)",
                    "definition": "label_values(clonecast_engine_up, job)",
                },
                {
                    **variable,
                    "name": "instance",
                    "label": "Instance",
                    "query": 'label_values(clonecast_engine_up{job=~"$job"}, instance)',
                    "definition": 'label_values(clonecast_engine_up{job=~"$job"}, instance)',
                },
            ]
        },
        "panels": laid,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON drifted")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} differs from grafana/generate.py: run python grafana/generate.py")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
