"""The served benchmark of docs/PERFORMANCE.md: the real server, the real WebSocket protocol, a
closed loop of C clients on the same host sending voice-clone requests.

For each concurrency: warm-up requests excluded (`--warmup`, 64, but never fewer than C: with
fewer, the timed window opens on the cold ramp of C simultaneous first requests), then
`--requests` timed requests, repeated `--starts` times (fresh connections each time; a fresh
server each time with `--fresh-server`); `--sim ARGS` runs benchmarks/sim_server.py (the real
service with the GPU work simulated) instead of the real server; output lengths drawn from a
seeded distribution with mean 109 frames (4.36 s), range 1-10 s, enforced with
`max_duration_s` (random weights never choose to stop). Prints audio-s/s, requests/s, first
audio mean/P50/P95/P99, completion mean, underruns and the first payload sizes; with
`--eager`, the same load against a server without CUDA graphs, and the ratio.

    python benchmarks/serve_bench.py --model DIR [--write-full] [--concurrency 1,32,64]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.floor import floor_ms  # noqa: E402
from benchmarks.metrics_window import RunningSampler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Thanks for calling, how can I help you today?",
    "The package will arrive on Thursday between nine and noon.",
    "Please hold while I transfer you to a specialist.",
    "Your appointment is confirmed for next Monday at three in the afternoon.",
    "I can read that back to you one more time if you like.",
    "The weather tomorrow looks clear with a light breeze from the west.",
]


@dataclass
class Record:
    sent: float
    first_audio: float | None
    done: float
    audio_s: float
    first_payload: int
    underruns: int
    reason: str
    arrivals: list[tuple[float, float]]  # (time, audio seconds) of every audio frame
    client: int = -1


def reference_wav(seconds: float, seed: int = 0) -> bytes:
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24000)) / 24000
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.5 * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / 24000) / k for k in range(1, 8))
    x = 0.2 * x * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.003 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), 24000, format="WAV")
    return buf.getvalue()


def durations(n: int, seed: int) -> list[float]:
    """Seeded output lengths: mean about 4.36 s (109 frames), clipped to 1-10 s."""
    rng = random.Random(seed)
    return [min(10.0, max(1.0, rng.gammavariate(4.0, 4.36 / 4.0))) for _ in range(n)]


async def one_request(ws, uid: str, voice_id: str, text: str, seconds: float, seed: int) -> Record:
    from clonecast_client.wire import unpack_audio

    sent = time.perf_counter()
    await ws.send(
        json.dumps(
            {
                "type": "speak",
                "id": uid,
                "text": text,
                "voice_id": voice_id,
                "params": {
                    "temperature": 1.0,
                    "top_k": 50,
                    "top_p": 0.95,
                    "seed": seed,
                    "max_duration_s": seconds,
                },
            }
        )
    )
    first = None
    first_payload = 0
    audio = 0.0
    underruns = 0
    arrivals = []
    while True:
        msg = await ws.recv()
        now = time.perf_counter()
        if isinstance(msg, bytes):
            frame = unpack_audio(msg)
            if frame.payload:
                if first is None:
                    first, first_payload = now, len(frame.payload)
                elif now > first + audio:
                    underruns += 1
                audio += len(frame.payload) / 48000
                arrivals.append((now, len(frame.payload) / 48000))
            continue
        data = json.loads(msg)
        if data["type"] == "done":
            reason = data["reason"]
            return Record(sent, first, now, audio, first_payload, underruns, reason, arrivals)
        if data["type"] == "error":
            raise RuntimeError(f"server error: {data}")


async def run_load(
    url: str, voice_id: str, concurrency: int, warmup: int, timed: int, seed: int
) -> tuple[list[Record], list[Record], float]:
    """The timed records, every record (warm-up included), and when the first client ran
    out of requests (until then every client was busy: the saturated window ends there)."""
    import websockets

    lengths = durations(warmup + timed + concurrency, seed)
    counter = iter(range(10**9))
    records: list[tuple[int, Record]] = []
    first_idle: list[float] = []

    async def client(c: int) -> None:
        async with websockets.connect(url, max_size=None) as ws:
            json.loads(await ws.recv())  # ready
            while True:
                i = next(counter)
                if i >= warmup + timed:
                    first_idle.append(time.perf_counter())
                    return
                rec = await one_request(
                    ws, f"c{c}-{i}", voice_id, TEXTS[i % len(TEXTS)], lengths[i], seed * 100_000 + i
                )
                rec.client = c
                records.append((i, rec))

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    ordered = sorted(records, key=lambda x: x[0])
    return [r for i, r in ordered if i >= warmup], [r for _, r in ordered], min(first_idle)


def saturated(timed: list[Record], every: list[Record], end: float) -> tuple[float, float]:
    """(audio seconds, wall seconds) received while every client was busy: from the first
    timed send to the moment the first client ran out of requests, counting every request's
    audio that arrived in that window (warm-up requests still running included). Unlike the
    whole run's wall, it leaves out the tail where fewer than C requests remain."""
    start = min(r.sent for r in timed)
    audio = sum(s for r in every for t, s in r.arrivals if start <= t <= end)
    return audio, end - start


def summarise(
    records: list[Record], window: tuple[float, float], wall: float | None = None
) -> dict:
    """Figures over `records`; `wall` defaults to first send -> last done; `window` is the
    saturated (audio seconds, wall seconds)."""
    wall = wall or max(r.done for r in records) - min(r.sent for r in records)
    ttfa = sorted((r.first_audio - r.sent) * 1e3 for r in records if r.first_audio)
    pct = lambda p: ttfa[min(len(ttfa) - 1, int(round(p / 100 * (len(ttfa) - 1))))]  # noqa: E731
    return {
        "audio_s_per_s": window[0] / window[1],
        "saturated_s": window[1],
        "audio_s_per_s_whole": sum(r.audio_s for r in records) / wall,
        "requests_per_s": len(records) / wall,
        "wall_s": wall,
        "ttfa_mean": statistics.fmean(ttfa),
        "ttfa_p50": pct(50),
        "ttfa_p95": pct(95),
        "ttfa_p99": pct(99),
        "completion_mean": statistics.fmean(r.done - r.sent for r in records),
        "underruns": sum(r.underruns for r in records),
        "first_payloads": sorted({r.first_payload for r in records}),
        "mean_audio_s": statistics.fmean(r.audio_s for r in records),
        "reasons": sorted({r.reason for r in records}),
        "client_gap_ms": 1e3 * client_gap(records),
    }


def client_gap(records: list[Record]) -> float:
    """Mean time a client spends between a `done` and its next send (client-side overhead)."""
    gaps, by_client = [], {}
    for r in sorted(records, key=lambda r: r.sent):
        prev = by_client.get(r.client)
        if prev is not None:
            gaps.append(r.sent - prev.done)
        by_client[r.client] = r
    return statistics.fmean(gaps) if gaps else 0.0


def start_server(
    model: str | None, port: int, eager: bool, max_num_seqs: int, log: Path, sim: str | None
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
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become ready")


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


def step_stats(port: int) -> tuple[float, float, float]:
    """(seconds in steps, steps, rows sampled) so far, from the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()

    def get(name: str) -> float:  # summed over the series' labels (the step's kind)
        lines = text.splitlines()
        return sum(float(x.split()[-1]) for x in lines if x.split("{")[0].split(" ")[0] == name)

    return (
        get("clonecast_engine_step_seconds_sum"),
        get("clonecast_engine_step_seconds_count"),
        get("clonecast_engine_rows_total"),
    )


async def create_voice(url: str, audio: bytes) -> str:
    import websockets

    async with websockets.connect(url, max_size=None) as ws:
        json.loads(await ws.recv())
        await ws.send(
            json.dumps(
                {
                    "type": "voice.create",
                    "request_id": "bench",
                    "audio_b64": base64.b64encode(audio).decode(),
                    "transcript": "A short reference recording for the benchmark.",
                }
            )
        )
        while True:
            data = json.loads(await ws.recv())
            if data["type"] == "voice.created":
                return data["voice_id"]
            if data["type"] == "error":
                raise RuntimeError(data)


def bench_server(args, eager: bool, out: Path) -> dict:
    """Every concurrency, `--starts` times; with `--fresh-server` each start gets its own
    server process (independent starts), otherwise one server serves them all."""
    port = args.port + (1 if eager else 0)
    log = out / f"server{'-eager' if eager else ''}.log"
    url = f"ws://127.0.0.1:{port}/v1/stream"
    runs: dict[int, list] = {int(c): [] for c in args.concurrency.split(",")}
    server = None
    try:
        for s in range(args.starts):
            if server is None:
                server = start_server(args.model, port, eager, args.max_num_seqs, log, args.sim)
                voice = asyncio.run(create_voice(url, reference_wav(args.reference_s)))
            for c, starts in runs.items():
                s0, n0, rows0 = step_stats(port)
                cpu0 = process_cpu(server.pid)
                t0 = time.perf_counter()
                warmup = max(args.warmup, c)
                timed = args.requests if args.requests > 0 else max(16, 2 * c)
                if c == 1 and args.requests > 0:  # a closed loop of one: fewer suffice
                    warmup, timed = min(warmup, 4), args.c1_requests
                sampler = RunningSampler(port)
                recs, every, end = asyncio.run(
                    run_load(url, voice, c, warmup, timed, seed=1000 * c + s)
                )
                running, waiting = sampler.stop(min(r.sent for r in recs), end)
                window_rows = sampler.window_rows
                window_ms = (sampler.window_wall_ms, sampler.window_step_ms)
                s1, n1, rows1 = step_stats(port)
                load_s = time.perf_counter() - t0
                cpu = {
                    k: (v - cpu0.get(k, 0.0)) / load_s for k, v in process_cpu(server.pid).items()
                }
                window = saturated(recs, every, end)
                summary = summarise(recs, window)
                summary["window"] = window
                summary["cpu_cores"] = cpu
                summary["mean_running"], summary["mean_waiting"] = running, waiting
                steps = max(1, n1 - n0)
                summary["rows_per_step"] = (rows1 - rows0) / steps
                summary["window_rows_per_step"] = window_rows
                summary["window_wall_ms"], summary["window_step_ms"] = window_ms
                summary["window_phase_ms"] = sampler.window_phase_ms
                summary["window_long_steps"] = sampler.window_long_steps
                summary["loop_ms"] = load_s / steps * 1e3  # wall per step, idle included
                print(
                    f"C={c} start {s + 1}: saturated window: mean running {running:.1f}, "
                    f"waiting {waiting:.1f}, {window_rows:.1f} rows a step, "
                    f"{window_ms[0]:.2f} ms of wall and {window_ms[1]:.2f} ms in step() a "
                    f"step ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in sampler.window_phase_ms.items())
                    + f"), {sampler.window_long_steps:.0f} steps over 20 ms, "
                    f"client gap "
                    f"{summary['client_gap_ms']:.1f} ms, saturated window {window[1]:.1f} s; "
                    f"whole load: {summary['rows_per_step']:.1f} rows a step, "
                    f"{summary['loop_ms']:.2f} ms of wall a step; CPU cores busy: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()),
                    flush=True,
                )
                partial = {str(k): [x for x, _ in v] for k, v in runs.items()}
                (out / f"partial{'-eager' if eager else ''}.json").write_text(
                    json.dumps(partial, indent=1)
                )
                summary["step_ms"] = (s1 - s0) / max(1, n1 - n0) * 1e3
                starts.append((summary, recs))
            if args.fresh_server:
                _stop(server)
                server = None
    finally:
        if server is not None:
            _stop(server)
    results = {}
    for c, starts in runs.items():
        windows = [s["window"] for s, _ in starts]
        pool = summarise(
            [r for _, recs in starts for r in recs],
            (sum(w[0] for w in windows), sum(w[1] for w in windows)),
            wall=sum(s["wall_s"] for s, _ in starts),
        )
        pool["step_ms"] = statistics.fmean(s["step_ms"] for s, _ in starts)
        results[c] = [s for s, _ in starts] + [pool]
    return results


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint dir (default: the embedded default model)")
    ap.add_argument(
        "--write-full", help="write a full-size random checkpoint with codec here first"
    )
    ap.add_argument("--concurrency", default="1,32,64")
    ap.add_argument("--requests", type=int, default=256, help="timed requests (0: max(16, 2C))")
    ap.add_argument(
        "--warmup",
        type=int,
        default=64,
        help="excluded requests, at least C (fewer would time the cold ramp); -1: C",
    )
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--reference-s", type=float, default=4.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--c1-requests", type=int, default=32, help="timed requests at C=1")
    ap.add_argument("--eager", action="store_true", help="also run without CUDA graphs")
    ap.add_argument("--eager-concurrency", default="1,64", help="concurrencies of the eager run")
    ap.add_argument("--eager-requests", type=int, default=0, help="timed requests of the eager run")
    ap.add_argument("--fresh-server", action="store_true", help="a new server process per start")
    ap.add_argument(
        "--sim",
        help="run benchmarks/sim_server.py with these arguments instead (GPU work simulated)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.write_full:
        write_full(Path(args.write_full))
        args.model = args.write_full
    runs = {"default": bench_server(args, eager=False, out=out)}
    if args.eager:
        args.concurrency, args.requests = args.eager_concurrency, args.eager_requests
        args.starts, args.warmup = 1, -1
        runs["eager"] = bench_server(args, eager=True, out=out)
    (out / "serve_bench.json").write_text(json.dumps(runs, indent=2))
    print_table(runs)


def write_full(path: Path) -> None:
    from engine.checkpoint_writer import write_full_size_checkpoint

    write_full_size_checkpoint(path)


ROW = (
    "{:<7}{:>4}{:>6}{:>10.1f}{:>7.1f}{:>7.1f}{:>10.1f}{:>7.1f}{:>7.1f}{:>7.1f}{:>8.2f}{:>10}"
    "{:>8.2f}  {}"
)


def print_table(runs: dict) -> None:
    head = (
        "mode",
        "C",
        "start",
        "audio-s/s",
        "whole",
        "req/s",
        "TTFA mean",
        "P50",
        "P95",
        "P99",
        "compl s",
        "underruns",
        "step ms",
        "first bytes",
    )
    print(
        "\n"
        + "{:<7}{:>4}{:>6}{:>10}{:>7}{:>7}{:>10}{:>7}{:>7}{:>7}{:>8}{:>10}{:>8}  {}".format(*head)
    )
    for mode, per_c in runs.items():
        for c, starts in per_c.items():
            for i, s in enumerate(starts):
                label = "pool" if i == len(starts) - 1 else str(i + 1)
                row = (
                    mode,
                    c,
                    label,
                    s["audio_s_per_s"],
                    s["audio_s_per_s_whole"],
                    s["requests_per_s"],
                    s["ttfa_mean"],
                    s["ttfa_p50"],
                    s["ttfa_p95"],
                    s["ttfa_p99"],
                    s["completion_mean"],
                    s["underruns"],
                    s["step_ms"],
                    s["first_payloads"],
                )
                print(ROW.format(*row))

    if 64 in runs["default"]:
        step = runs["default"][64][-1]["step_ms"]
        print(
            f"served step at C=64: {step:.2f} ms (decode and prefill mixed, codec on its own "
            f"stream); decode-step floor at batch 64, 400-token context: {floor_ms(64, 400):.2f}"
            f" ms (x{step / floor_ms(64, 400):.2f}); the clean decode step: eager_step.py"
        )
    if "eager" in runs:
        for c, starts in runs["eager"].items():
            if c in runs["default"]:
                g, e = runs["default"][c][-1], starts[-1]
                ratio = g["audio_s_per_s"] / e["audio_s_per_s"]
                print(
                    f"graphs vs eager at C={c}: audio-s/s x{ratio:.2f}, "
                    f"first audio mean x{e['ttfa_mean'] / g['ttfa_mean']:.2f} faster"
                )


if __name__ == "__main__":
    main()
