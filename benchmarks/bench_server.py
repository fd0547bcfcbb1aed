"""The served benchmark's server side: starting a fresh server (serve or the simulated one)
and waiting until it is ready, and reading what it and its processes report: /metrics
(running totals, capture times, KV blocks) and /proc (CPU seconds). Knows nothing of the
load or of the report."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_server(
    model: str | None,
    port: int,
    eager: bool,
    max_num_seqs: int,
    log: Path,
    sim: str | None,
    prefix_caching: bool = True,
):
    cmd = [sys.executable, "-m", "service.cli", "serve", "--log-level", "warning"]
    if sim is not None:  # the host side for real, GPU work simulated (benchmarks/sim_server.py)
        script = os.environ.get("CLONECAST_SIM_SCRIPT", str(ROOT / "benchmarks" / "sim_server.py"))
        cmd = [sys.executable, script, *sim.split()]
    cmd += ["--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    if model and sim is None:
        cmd += ["--model", model]
    if eager:
        cmd.append("--eager")
    env_extra = {} if prefix_caching else {"CLONECAST_PREFIX_CACHING": "0"}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **env_extra}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    deadline = started + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    took = time.monotonic() - started
                    print(f"server ready after {took:.0f} s{startup_facts(port)}", flush=True)
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become ready")


def startup_facts(port: int) -> str:
    """What the start-up made, from /metrics once ready: the seconds each graph family took
    to capture (autotuned codec graphs show here) and the KV cache's free blocks (all of
    them before any request; fp8 weights should give more than bf16). Empty where the
    server does not export them."""
    try:
        now = read_metrics(port)
    except OSError:
        return ""
    capture = ", ".join(f"{family} {s:.1f} s" for family, s in now["capture"].items())
    facts = f"; graph capture: {capture}" if capture else ""
    return facts + (f"; KV cache: {now['kv_free']:,.0f} blocks free" if now["kv_free"] else "")


def process_cpu(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of this client, the server and the server's
    children (the engine process), from /proc; empty where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: int) -> list[str] | None:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        return text.rpartition(")")[2].split()  # fields after the command name

    out = {}
    for name, pid in (("client", os.getpid()), ("server", server_pid)):
        fields = stat(pid)
        if fields is not None:
            out[name] = (int(fields[11]) + int(fields[12])) / tick
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat(int(entry.name))
        if fields is not None and int(fields[1]) == server_pid:  # field 4: parent pid
            out[f"child {entry.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


COUNTERS = {
    "step_s": "clonecast_engine_step_seconds_sum",
    "steps": "clonecast_engine_step_seconds_count",
    "rows": "clonecast_engine_rows_total",
    "preempted": "clonecast_preemptions_total",
    "prefill": "clonecast_prefill_tokens_total",
    "prefix_hits": "clonecast_prefix_cache_hit_tokens_total",
    "queued": "clonecast_queue_time_seconds_count",
    "codec_windows": "clonecast_codec_windows_total",
    "codec_batches": "clonecast_codec_batch_seconds_count",
}


def read_metrics(port: int) -> dict:
    """From the server's /metrics: its running totals (COUNTERS, each summed over its
    labels), the launched steps' token counts (`tokens`: {bucket edge: steps at or below
    it}), the utterances routed per engine and reason (`routed`), and two start-up
    readings: graph capture seconds per family (`capture`) and free KV blocks (`kv_free`)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    names = {v: k for k, v in COUNTERS.items()}
    out: dict = {k: 0.0 for k in COUNTERS} | {"tokens": {}, "routed": {}, "capture": {}}
    out["kv_free"] = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{")[0]
        if name in names:
            out[names[name]] += float(value)
        elif name == "clonecast_engine_routed_total":  # utterances per engine and reason
            engine, reason = (series.split(f'{k}="')[1].split('"')[0] for k in ("engine", "reason"))
            out["routed"][f"{engine}/{reason}"] = float(value)
        elif name == "clonecast_engine_step_tokens_bucket":
            edge = float(series.split('le="')[1].split('"')[0])
            out["tokens"][edge] = float(value)
        elif name == "clonecast_graph_capture_seconds":
            out["capture"][series.split('family="')[1].split('"')[0]] = float(value)
        elif name == "clonecast_kv_cache_free_blocks":
            out["kv_free"] += float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    grown = {k: after[k] - before[k] for k in COUNTERS}
    grown["tokens"] = {e: n - before["tokens"].get(e, 0.0) for e, n in after["tokens"].items()}
    grown["routed"] = {k: n - before["routed"].get(k, 0.0) for k, n in after["routed"].items()}
    return grown


def stop_server(proc) -> None:
    proc.terminate()
    proc.wait(timeout=60)
