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


def summed(metric: str, by: str = "", extra: str = "") -> str:
    """The per-second rate of a counter, summed (by the labels in `by`)."""
    return f"sum{f' by ({by})' if by else ''} ({rate(metric, extra)})"


def quantile(q: float, histogram: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket')}))"


def quantiles(histogram: str, qs=(0.5, 0.95), by: str = "") -> list[tuple[str, str]]:
    label = f" {{{{{by}}}}}" if by else ""
    return [(quantile(q, histogram, by), f"P{round(q * 100)}{label}") for q in qs]


def mean(histogram: str) -> str:
    """The mean of a histogram's observations (nothing while there are none)."""
    return f"{summed(histogram + '_sum')} / ({summed(histogram + '_count')} > 0)"


def gauge(metric: str, how: str = "sum", by: str = "") -> str:
    return f"{how}{f' by ({by})' if by else ''} ({metric}{{{SEL}}})"


def panel(title: str, description: str, unit: str, targets: list[tuple[str, str]], **extra):
    """A time series panel (or `type`); `targets`: (PromQL, legend); `query`: what every
    target adds (a table's instant query)."""
    query = extra.pop("query", {})
    return {
        "type": extra.pop("type", "timeseries"),
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i), **query}
            for i, (expr, legend) in enumerate(targets)
        ],
        **extra,
    }


FIRST = "clonecast_time_to_first_audio_seconds"
OBJECTIVE_S = 0.32  # the first chunk's length: a bucket edge of the first-audio histogram


def latency() -> list[dict]:
    in_time = summed(FIRST + "_bucket", "transport", f', le="{OBJECTIVE_S}"')
    within = f"{in_time} / {summed(FIRST + '_count', 'transport')}"
    line = {"thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None}]}}
    return [
        panel(
            "First audio (P50 / P95 / P99)",
            "Request received to first audio byte sent, by transport; the line is 320 ms, the "
            "first chunk's length (a player that starts then has that long for the next).",
            "s",
            quantiles(FIRST, (0.5, 0.95, 0.99), "transport")
            + [(f"vector({OBJECTIVE_S})", "320 ms")],
            defaults=line,
        ),
        panel(
            "Share of utterances with first audio within 320 ms",
            "Fraction of utterances whose first audio left within 320 ms (0.32 s is a bucket "
            "edge of the histogram, so this is exact, not interpolated).",
            "percentunit",
            [(within, "{{transport}}")],
        ),
        panel(
            "Queue time (P50 / P95 / P99)",
            "A request's arrival in the engine to its first scheduled step: waiting for a slot "
            "or for KV cache blocks. Growing with load means the engine is full.",
            "s",
            quantiles("clonecast_queue_time_seconds", (0.5, 0.95, 0.99)),
        ),
        panel(
            "End to end (P50 / P95)",
            "Request received to last audio byte sent, by transport.",
            "s",
            quantiles("clonecast_e2e_request_latency_seconds", by="transport"),
        ),
        panel(
            "Real-time factor (P50 / P95)",
            "Generation time over audio duration per utterance; below 1 is faster than real time.",
            "none",
            quantiles("clonecast_real_time_factor"),
        ),
    ]


def streaming() -> list[dict]:
    return [
        panel(
            "Audio seconds per second",
            "Seconds of audio sent to clients per second of wall time, by transport.",
            "none",
            [(summed("clonecast_audio_seconds_total", "transport"), "{{transport}}")],
        ),
        panel(
            "Chunk lead (P1 / P5 / P50)",
            "How far ahead of a player's playhead each chunk after the first arrived (the "
            "player starts with the first audio and waits when it runs dry). Near 0: close to "
            "an underrun; negative: an underrun.",
            "s",
            quantiles("clonecast_chunk_lead_seconds", (0.01, 0.05, 0.5), "transport"),
        ),
        panel(
            "Underruns",
            "Chunks sent after the audio before them had played, per second, and the seconds "
            "per second a player would have waited out of audio, by transport.",
            "none",
            [
                (summed("clonecast_underruns_total", "transport"), "underruns/s {{transport}}"),
                (
                    summed("clonecast_underrun_seconds_total", "transport"),
                    "silent s/s {{transport}}",
                ),
            ],
        ),
        panel(
            "Utterances ended, by outcome",
            "Utterances per second by how they ended: eos, length, cancelled (by the client), "
            "disconnected (the client left first) or error (see errors by code).",
            "reqps",
            [(summed("clonecast_request_success_total", "finished_reason"), "{{finished_reason}}")],
        ),
    ]


def engine() -> list[dict]:
    step = "clonecast_engine_step_seconds"
    hits, prefill = "clonecast_prefix_cache_hit_tokens_total", "clonecast_prefill_tokens_total"
    return [
        panel(
            "Requests running and waiting",
            "Engine requests (one per sentence segment) running in the batch and waiting for it.",
            "none",
            [
                (gauge("clonecast_num_requests_running"), "running"),
                (gauge("clonecast_num_requests_waiting"), "waiting"),
            ],
        ),
        panel(
            "Utterances per engine",
            "Utterances sent to each of the server's engines (one per device) per second, by "
            "why: affinity (the engine served the voice last and holds its prompt prefix) or "
            "least_loaded. One engine: one pair of lines.",
            "reqps",
            [(summed("clonecast_engine_routed_total", "engine, reason"), "{{engine}} {{reason}}")],
        ),
        panel(
            "Batch size (mean / P95)",
            "Requests in each launched engine step.",
            "none",
            [(mean("clonecast_engine_batch_size"), "mean")]
            + quantiles("clonecast_engine_batch_size", (0.95,)),
        ),
        panel(
            "Step time by kind (P50 / P95)",
            "Duration of one engine step by what it launched: prefill, decode, mixed, or only "
            "a read-back. A decode step yields 40 ms of audio per stream: it must stay below.",
            "s",
            quantiles(step, by="kind"),
        ),
        panel(
            "Host time in steps by phase",
            "Share of wall time the engine's host spends in each phase of its steps "
            "(schedule, launch, audio, gpu_wait, rows); gpu_wait is time the GPU is the limit.",
            "percentunit",
            [(summed("clonecast_engine_phase_seconds_total", "phase"), "{{phase}}")],
        ),
        panel(
            "Prefill tokens per second",
            "Prompt positions computed, and those taken from the prefix cache instead.",
            "none",
            [(summed(prefill), "computed"), (summed(hits), "prefix-cache hits")],
        ),
        panel(
            "Prefix-cache hit ratio",
            "Share of prompt positions served by the prefix cache (a voice used again reuses "
            "its prompt).",
            "percentunit",
            [(f"{summed(hits)} / (({summed(hits)} + {summed(prefill)}) > 0)", "hit ratio")],
        ),
        panel(
            "KV cache use",
            "Fraction of the KV cache's blocks in use.",
            "percentunit",
            [(gauge("clonecast_kv_cache_usage_perc", "max"), "used")],
        ),
        panel(
            "Preemptions per second",
            "Requests preempted for want of KV cache blocks (they recompute their prompt).",
            "none",
            [(summed("clonecast_preemptions_total"), "preemptions")],
        ),
        panel(
            "Codec batch latency (P50 / P95)",
            "A codec batch's submission to its audio read back by the engine.",
            "s",
            quantiles("clonecast_codec_batch_seconds"),
        ),
        panel(
            "Codec windows per batch",
            "Mean chunk windows decoded together in one codec batch.",
            "none",
            [
                (
                    f"{summed('clonecast_codec_windows_total')} / "
                    f"({summed('clonecast_codec_batch_seconds_count')} > 0)",
                    "windows per batch",
                )
            ],
        ),
    ]


def caches() -> list[dict]:
    hits, misses = "clonecast_voice_cache_hits_total", "clonecast_voice_cache_misses_total"
    return [
        panel(
            "Voice cache",
            "Reference recordings per second served from the voice cache (hits) or encoded by "
            "the codec (misses).",
            "none",
            [(summed(hits), "hits"), (summed(misses), "misses")],
        ),
        panel(
            "Voice cache hit ratio",
            "Share of reference recordings whose codes came from the cache.",
            "percentunit",
            [(f"{summed(hits)} / (({summed(hits)} + {summed(misses)}) > 0)", "hit ratio")],
        ),
        panel(
            "Graph capture time",
            "Seconds each graph family (backbone, sampler, codec) took to capture before /ready.",
            "s",
            [(gauge("clonecast_graph_capture_seconds", "max", "family"), "{{family}}")],
        ),
        panel(
            "Graph capture memory",
            "Memory each graph family's captured graphs hold: allocated and reserved.",
            "bytes",
            [
                (
                    gauge("clonecast_graph_capture_memory_bytes", "max", "family, kind"),
                    "{{family}} {{kind}}",
                )
            ],
        ),
    ]


def clients() -> list[dict]:
    return [
        panel(
            "WebSocket connections",
            "Open WebSocket connections.",
            "none",
            [(gauge("clonecast_websocket_connections"), "connections")],
        ),
        panel(
            "Connection ends by reason",
            "WebSocket connections ended per second: the client closed it, the client was lost "
            "(no close frame, or sending failed), or it idled out.",
            "cps",
            [(summed("clonecast_websocket_closes_total", "reason"), "{{reason}}")],
        ),
        panel(
            "Errors by code",
            "Errors sent to clients per second, by their protocol code (slow_consumer: a client "
            "that read too slowly).",
            "cps",
            [(summed("clonecast_errors_total", "code"), "{{code}}")],
        ),
        panel(
            "Engine up and restarts",
            "1 while the engine (its process or thread) runs, 0 once it has exited; engines "
            "started again by the server after one died; and server processes started within "
            "the interval (a new start time per instance).",
            "none",
            [
                (gauge("clonecast_engine_up", "min"), "engine up"),
                (
                    f"sum (increase(clonecast_engine_restarts_total{{{SEL}}}[$__rate_interval]))",
                    "engine restarts",
                ),
                (
                    f"sum (changes(process_start_time_seconds{{{SEL}}}[$__rate_interval]))",
                    "server restarts",
                ),
            ],
        ),
        panel(
            "Server memory",
            "Resident memory of each server process (the engine process is not included).",
            "bytes",
            [(gauge("process_resident_memory_bytes", "max", "instance"), "{{instance}}")],
        ),
        panel(
            "Servers",
            "What each server runs: version, model (untrained: the embedded random model), "
            "device and dtype.",
            "none",
            [
                (
                    f"max by (instance, version, model, untrained, device, dtype) "
                    f"(clonecast_build_info{{{SEL}}})",
                    "{{instance}}",
                )
            ],
            type="table",
            query={"instant": True, "format": "table"},
        ),
    ]


SECTIONS = (
    ("Latency", latency),
    ("Streaming", streaming),
    ("Engine", engine),
    ("Caches and start-up", caches),
    ("Clients and health", clients),
)


def dashboard() -> dict:
    laid, y, ids = [], 0, iter(range(1, 1000))
    for title, make in SECTIONS:
        row = {"type": "row", "title": title, "id": next(ids), "collapsed": False, "panels": []}
        laid.append({**row, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        made = make()
        for i, p in enumerate(made):
            grid = {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)}
            laid.append({**p, "id": next(ids), "gridPos": grid})
        y += 8 * -(-len(made) // 3)  # three panels a line
    variable = {"type": "query", "refresh": 2, "includeAll": True, "multi": True, "datasource": DS}
    return {
        "title": "clonecast",
        "uid": "clonecast-overview",
        "description": "Voice cloning in real time: latency, streaming, engine, caches, clients.",
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
                },
                {
                    **variable,
                    "name": "instance",
                    "label": "Instance",
                    "query": 'label_values(clonecast_engine_up{job=~"$job"}, instance)',
                },
            ]
        },
        "panels": laid,
    }


def panels() -> list[dict]:
    """Every panel that queries (rows are only headings)."""
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


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
