"""What the soak prints and decides (benchmarks/soak.py): the table of samples, a verdict per
series (flat or growing), the idle check against the baseline, the reconciliation of the
client's outcomes with the server's counters, and the samples as JSON or CSV.

The growth rule: of the samples taken under load, the first 20% are dropped (warm-up: pools
and caches filling), the rest split in thirds; a series is growing when the median of the
last third exceeds the median of the first by more than max(absolute, relative x first)
tolerance (SERIES). Medians of thirds ignore a few outliers (a burst of connections at one
sample) and a short run's noise; a real leak grows with the requests, so it shows as the
run gets longer. The idle check is the strict one: after the load, with no connection and no
request left, KV blocks in use must be 0 and open files and threads back to the baseline
(taken idle after a warm-up pass) within IDLE_SLACK."""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter

# series: (absolute, relative) tolerance of the growth rule
SERIES = {
    "server_rss_mb": (24.0, 0.03),
    "engine_rss_mb": (24.0, 0.03),
    "server_fds": (4, 0.10),
    "engine_fds": (2, 0.0),
    "server_threads": (3, 0.0),
    "engine_threads": (2, 0.0),
    "kv_blocks_used": (64, 0.25),
    "voice_cache_bytes": (4096, 0.01),
}
IDLE_SLACK = {"server_fds": 2, "engine_fds": 1, "server_threads": 2, "engine_threads": 1}
COLUMNS = (
    ("t_s", "t s", 7),
    ("phase", "phase", 8),
    ("requests", "requests", 8),
    ("server_rss_mb", "srv MB", 7),
    ("server_fds", "srv fd", 6),
    ("server_threads", "srv thr", 7),
    ("engine_rss_mb", "eng MB", 7),
    ("engine_fds", "eng fd", 6),
    ("engine_threads", "eng thr", 7),
    ("kv_blocks_used", "KV used", 7),
    ("voice_cache_bytes", "voice B", 8),
    ("engine_running", "running", 7),
    ("connections", "conns", 5),
)


def header() -> str:
    return " ".join(f"{title:>{width}}" for _, title, width in COLUMNS)


def line(row: dict) -> str:
    return " ".join(
        f"{'-' if row[key] is None else row[key]:>{width}}" for key, _, width in COLUMNS
    )


def growth(rows: list[dict]) -> dict[str, dict]:
    """Per series: first and last third's medians, the change, and flat / growing (or
    too_few_samples under 6 load samples after the warm-up)."""
    load = [r for r in rows if r["phase"] == "load"]
    kept = load[max(1, len(load) // 5) :]
    verdicts = {}
    for name, (absolute, relative) in SERIES.items():
        values = [r[name] for r in kept if r[name] is not None]
        if len(values) < 6:
            verdicts[name] = {"verdict": "too_few_samples", "samples": len(values)}
            continue
        third = len(values) // 3
        first, last = statistics.median(values[:third]), statistics.median(values[-third:])
        tolerance = max(absolute, relative * abs(first))
        verdicts[name] = {
            "first": round(first, 1),
            "last": round(last, 1),
            "change": round(last - first, 1),
            "tolerance": round(tolerance, 1),
            "verdict": "growing" if last - first > tolerance else "flat",
        }
    return verdicts


def idle_check(baseline: dict, idle: dict) -> list[str]:
    """What did not come back once idle (empty: everything did)."""
    problems = []
    for name in ("kv_blocks_used", "engine_running", "connections"):
        if idle[name] != 0:
            problems.append(f"{name} is {idle[name]} when idle (expected 0)")
    for name, slack in IDLE_SLACK.items():
        if baseline[name] is None or idle[name] is None:
            problems.append(f"{name} was not measured (process gone?)")
        elif idle[name] > baseline[name] + slack:
            problems.append(f"{name} {idle[name]} when idle, baseline {baseline[name]}")
    return problems


def reconcile(tally_outcomes: Counter, server_delta: dict) -> list[str]:
    """The client's outcomes against what the server counted over the same run: utterances
    ended (done, cancelled or disconnected: the server's eos, length, cancelled and
    disconnected) and errors by code (both transports)."""
    client: Counter = Counter()
    for (_, outcome), n in tally_outcomes.items():
        client[outcome] += n
    problems = []
    ended = client["done"] + client["cancelled"] + client["disconnected"]
    served = sum(server_delta["outcomes"].get(k, 0) for k in ("eos", "length"))
    served += sum(server_delta["outcomes"].get(k, 0) for k in ("cancelled", "disconnected"))
    if ended != served:
        problems.append(f"the client saw {ended} utterances end, the server counted {served}")
    if client["cancelled"] != server_delta["outcomes"].get("cancelled", 0):
        problems.append(
            f"cancelled: client {client['cancelled']}, server "
            f"{server_delta['outcomes'].get('cancelled', 0)}"
        )
    codes = {k.split(":", 1)[1]: n for k, n in client.items() if k.startswith("error:")}
    for code in sorted(set(codes) | set(server_delta["errors"])):
        if codes.get(code, 0) != server_delta["errors"].get(code, 0):
            problems.append(
                f"error {code}: client saw {codes.get(code, 0)}, server counted "
                f"{server_delta['errors'].get(code, 0)}"
            )
    return problems


def outcome_table(outcomes: Counter, failures: Counter) -> list[str]:
    scenarios = sorted({s for s, _ in outcomes} | set(failures))
    lines = [f"{'scenario':<16} {'failed':>6}  outcomes"]
    for scenario in scenarios:
        mine = sorted((o, n) for (s, o), n in outcomes.items() if s == scenario)
        listed = ", ".join(f"{o} {n}" for o, n in mine)
        lines.append(f"{scenario:<16} {failures.get(scenario, 0):>6}  {listed}")
    return lines


def write(path: str, rows: list[dict], summary: dict) -> None:
    """`.csv`: the samples; otherwise JSON: the samples and the summary."""
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        with open(path, "w") as f:
            json.dump({"samples": rows, **summary}, f, indent=1)
