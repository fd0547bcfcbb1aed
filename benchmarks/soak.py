"""The soak (issue 23): N clients for M minutes (or R requests) against a real server, with a
mix of voices, normal utterances in several output formats, streams, barge-in cancels,
clients that vanish mid-stream and bad inputs over the WebSocket and HTTP
(benchmarks/soak_load.py, soak_faults.py). Every 10 s it samples the server's and the
engine process's resident memory, open files and threads, the KV blocks in use and the
voice-cache bytes (benchmarks/soak_probe.py); it prints one row per sample, then a verdict per
series, the idle check against the baseline, every request by scenario and outcome, and the
client's outcomes reconciled with the server's counters (benchmarks/soak_report.py). Any
request that did not end as expected fails the run (exit status 1).

    python benchmarks/soak.py --minutes 30                   # starts `clonecast serve`
    python benchmarks/soak.py --url http://HOST:PORT --minutes 5 --json out/soak.json

Started by the script, the server is `clonecast serve` with no flags (the embedded default
model, cuda when available; run as `python -m service.cli serve` from this tree's root), on a
free port, its voices in a temporary SQLite store. Attached
by `--url`, its process is the one listening on that port (or `--server-pid`), on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import soak_report as report  # noqa: E402
from benchmarks.soak_load import client_loop  # noqa: E402
from benchmarks.soak_probe import Probe, labelled, listening_pid, scrape  # noqa: E402
from benchmarks.soak_setup import clients_for, scenarios, warm_up  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def started_server(env: dict | None = None, ready_timeout_s: float = 300):
    """`clonecast serve` on a free port (`env`: more CLONECAST_* settings): yields
    (http_url, pid); stopped with SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="clonecast-soak-"))
    log_path = tmp / "server.log"
    env = {**os.environ, **(env or {}), "CLONECAST_PORT": str(port)}
    env["CLONECAST_VOICE_STORE"] = str(tmp / "voices.sqlite3")
    # `clonecast serve`, as `-m` from ROOT: the code of this tree (also a scratch copy's, as
    # the mutation check makes), never an installed copy's
    cmd = [sys.executable, "-m", "service.cli", "serve"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(url):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"the server did not become ready; its log ends:\n{tail}")
            time.sleep(0.5)
        yield url, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def identity() -> dict:
    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        platform.processor() or "?",
    )
    return {
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }


def counters(http_url: str) -> dict:
    metrics = scrape(http_url)
    return {
        "outcomes": labelled(metrics, "clonecast_request_success_total", "finished_reason"),
        "errors": labelled(metrics, "clonecast_errors_total", "code"),
    }


def _delta(before: dict, after: dict) -> dict:
    return {
        part: {k: round(v - before[part].get(k, 0)) for k, v in after[part].items()}
        for part in before
    }


async def _settle(probe: Probe, baseline: dict | None, requests: int, settle_s: float) -> dict:
    """Samples once a second until the server is idle and back to `baseline` (without one:
    idle, its open files and threads the same two samples running), at most `settle_s`;
    returns the last sample's row."""
    deadline, previous = time.monotonic() + settle_s, None
    steady = ("server_fds", "server_threads", "engine_fds", "engine_threads")
    while True:
        row = (await asyncio.to_thread(probe.sample, "idle", requests)).row()
        quiet = not (row["kv_blocks_used"] or row["engine_running"] or row["connections"])
        if baseline is not None:
            back = not report.idle_check(baseline, row)
        else:
            back = previous is not None and all(row[k] == previous[k] for k in steady)
        if (quiet and back) or time.monotonic() > deadline:
            return row
        previous = row
        await asyncio.sleep(1.0)


async def _sampler(probe: Probe, load, rows: list, every_s: float, out) -> None:
    """A sample every `every_s`; one that fails (the server gone, /metrics not answering)
    fails the run."""
    while True:
        await asyncio.sleep(every_s)
        try:
            row = (await asyncio.to_thread(probe.sample, "load", load.tally.requests)).row()
        except (OSError, KeyError, ValueError) as e:
            load.tally.fail("sampler", f"no sample: {type(e).__name__}: {e}")
            continue
        rows.append(row)
        out(report.line(row))


async def run_soak(
    http_url: str,
    server_pid: int | None,
    clients: int = 8,
    minutes: float = 30.0,
    max_requests: int = 0,
    sample_s: float = 10.0,
    max_duration_s: float = 1.5,
    num_voices: int = 6,
    settle_s: float = 60.0,
    seed: int = 0,
    out=print,
) -> dict:
    """The whole soak; returns its summary (`passed`, `rows`, verdicts, outcomes...)."""

    ws_url = "ws" + http_url.removeprefix("http") + "/v1/stream"
    probe = Probe(http_url, server_pid)
    before = await asyncio.to_thread(counters, http_url)
    t0 = time.monotonic()
    load, users = await clients_for(ws_url, http_url, clients, num_voices, max_duration_s, seed)
    t1 = time.monotonic()
    await warm_up(users)
    t2 = time.monotonic()
    baseline = await _settle(probe, None, load.tally.requests, settle_s)
    probe.started = time.monotonic()
    out(
        f"registered {num_voices} voices in {t1 - t0:.1f} s, warm-up {t2 - t1:.1f} s, idle "
        f"after {probe.started - t2:.1f} s; then {clients} clients for {minutes} min"
        + (f" or {max_requests} requests" if max_requests else "")
    )
    baseline["phase"], baseline["t_s"] = "baseline", 0.0
    rows = [baseline]
    out(report.header())
    out(report.line(baseline))
    load.stop_at, load.max_requests = time.monotonic() + minutes * 60, max_requests
    sampler = asyncio.create_task(_sampler(probe, load, rows, sample_s, out))
    await asyncio.gather(*(client_loop(user, scenarios()) for user in users))
    sampler.cancel()
    for user in users:
        await user.http.aclose()
    idle = await _settle(probe, baseline, load.tally.requests, settle_s)
    rows.append(idle)
    out(report.line(idle))
    after = await asyncio.to_thread(counters, http_url)
    summary = {
        "growth": report.growth(rows),
        "idle_problems": report.idle_check(baseline, idle),
        "reconcile_problems": report.reconcile(load.tally.outcomes, _delta(before, after)),
        "outcomes": {f"{s} {o}": n for (s, o), n in sorted(load.tally.outcomes.items())},
        "failures": dict(load.tally.failures),
        "failure_details": load.tally.details,
        "requests": load.tally.requests,
        "load_s": round(idle["t_s"], 1),
    }
    summary["passed"] = not (
        summary["idle_problems"]
        or summary["reconcile_problems"]
        or load.tally.failures
        or any(v["verdict"] == "growing" for v in summary["growth"].values())
    )
    _print_summary(summary, load.tally, out)
    summary["rows"] = rows
    return summary


def _print_summary(summary: dict, tally, out) -> None:
    out("\nseries (median of the last third vs the first, load samples after the first 20%):")
    for name, v in summary["growth"].items():
        if "first" in v:
            out(
                f"  {name:<18} {v['first']:>10} -> {v['last']:>10}  (+{v['change']}, "
                f"tolerance {v['tolerance']}): {v['verdict']}"
            )
        else:
            out(f"  {name:<18} {v['verdict']} ({v['samples']})")
    out("idle after the load: " + ("; ".join(summary["idle_problems"]) or "back to baseline"))
    out(f"\n{summary['requests']} requests (the warm-up's included) by scenario and outcome:")
    for row in report.outcome_table(tally.outcomes, tally.failures):
        out("  " + row)
    out("server counters vs client: " + ("; ".join(summary["reconcile_problems"]) or "agree"))
    for detail in summary["failure_details"]:
        out("  failure: " + detail)
    out("VERDICT: " + ("PASS" if summary["passed"] else "FAIL"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="attach to this server (http://HOST:PORT) instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --url: its pid (default: by its port)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--requests", type=int, default=0, help="stop after this many (0: no limit)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--max-duration-s", type=float, default=1.5, help="longest normal utterance")
    p.add_argument("--voices", type=int, default=6, help="registered reference voices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the samples and the summary here")
    p.add_argument("--csv", help="write the samples here")
    args = p.parse_args(argv)
    for path in filter(None, (args.json, args.csv)):  # a bad path fails now, not at the end
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    ident = identity()
    out = lambda text: print(text, flush=True)  # noqa: E731
    out(
        f"soak: {args.clients} clients, {args.minutes} min, commit {ident['commit']}"
        f"{' (dirty tree)' if ident['dirty'] else ''}, {ident['cpu']}, {ident['date']}"
    )
    with contextlib.ExitStack() as stack:
        if args.url:
            url = args.url.rstrip("/")
            pid = args.server_pid or listening_pid(urlparse(url).port or 80)
        else:
            url, pid = stack.enter_context(started_server())
        out(f"server {url}, pid {pid}")
        summary = asyncio.run(
            run_soak(
                url,
                pid,
                args.clients,
                args.minutes,
                args.requests,
                args.sample_s,
                args.max_duration_s,
                args.voices,
                seed=args.seed,
                out=out,
            )
        )
    summary["identity"], summary["args"] = ident, vars(args)
    for path in filter(None, (args.json, args.csv)):
        report.write(path, summary["rows"], {k: v for k, v in summary.items() if k != "rows"})
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
