"""The served benchmark of docs/PERFORMANCE.md: the real server, the real WebSocket protocol, a
closed loop of C clients on the same host sending voice-clone requests.

For each voice pool (`--voices 64,1`: 64 distinct 3-6 s references with transcripts, each
request drawing one, then a single voice the prefix cache serves) and concurrency: warm-up
requests excluded (`--warmup`, 64, but never fewer than C: with fewer, the timed window
opens on the cold ramp of C simultaneous first requests; and never more than 4 a client: a
closed loop of one is steady after its first request), then `--requests` timed requests
(or, with `--timed-s`, every request sent in that many seconds), repeated `--starts` times
(fresh connections each time; a fresh server each time with `--fresh-server`); `--sim ARGS`
runs benchmarks/sim_server.py (the real service with the GPU work simulated) instead of the
real server; output lengths drawn from a seeded distribution with mean 109 frames (4.36 s),
range 1-10 s, enforced with `max_duration_s` (random weights never choose to stop). Prints
the run's identity, then per start and pooled (benchmarks/bench_report.py) audio-s/s with its
range, requests/s and first audio mean/P50/P95/P99 over the saturated window, underruns per
1,000 chunks, the window's length and requests, the prefix-hit share and prefill per request,
the steps per graph bucket, the ratios to the floor and to vLLM-Omni, PASS / FAIL per target
and VALID or not; with `--eager`, the same load against a server without CUDA graphs.

    python benchmarks/serve_bench.py --model DIR [--write-full] [--concurrency 1,32,64]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_report import describe_identity, identity, print_table  # noqa: E402
from benchmarks.bench_server import (  # noqa: E402
    delta,
    process_cpu,
    read_metrics,
    start_server,
    stop_server,
)
from benchmarks.metrics_window import RunningSampler  # noqa: E402
from benchmarks.voice_pool import pool  # noqa: E402

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
    url: str,
    voice_ids: list[str],
    concurrency: int,
    warmup: int,
    timed: int,
    seed: int,
    timed_s: float = 0.0,
) -> tuple[list[Record], list[Record], float]:
    """The timed records, every record (warm-up included), and when the first client ran
    out of requests (until then every client was busy: the saturated window ends there).
    Each request draws its voice from `voice_ids` (seeded). The timed requests are `timed`
    of them or, with `timed_s`, every request sent within `timed_s` seconds of the first
    timed one (so the saturated window lasts at least that long at any concurrency)."""
    import websockets

    limit = warmup + timed + concurrency if not timed_s else 200_000
    lengths = durations(limit, seed)
    draw = random.Random(seed + 7)
    voices = [voice_ids[draw.randrange(len(voice_ids))] for _ in lengths]
    counter = iter(range(limit))
    records: list[tuple[int, Record]] = []
    first_idle: list[float] = []
    deadline: list[float] = []  # set when the first timed request is sent

    def more(i: int) -> bool:
        if i < warmup:
            return True
        if not timed_s:
            return i < warmup + timed
        if not deadline:  # this request opens the window: it lasts timed_s from its send
            deadline.append(time.perf_counter() + timed_s + 1e-3)
        return time.perf_counter() < deadline[0]

    async def client(c: int) -> None:
        async with websockets.connect(url, max_size=None) as ws:
            json.loads(await ws.recv())  # ready
            while True:
                i = next(counter)
                if not more(i):
                    first_idle.append(time.perf_counter())
                    return
                rec = await one_request(
                    ws,
                    f"c{c}-{i}",
                    voices[i],
                    TEXTS[i % len(TEXTS)],
                    lengths[i],
                    seed * 100_000 + i,
                )
                rec.client = c
                records.append((i, rec))

    port = urllib.parse.urlsplit(url).port if url.startswith("ws://127.0.0.1") else None
    reporter = asyncio.create_task(_report_progress(records, warmup, concurrency, port))
    try:
        await asyncio.gather(*(client(c) for c in range(concurrency)))
    finally:
        reporter.cancel()
    ordered = sorted(records, key=lambda x: x[0])
    return [r for i, r in ordered if i >= warmup], [r for _, r in ordered], min(first_idle)


async def _report_progress(
    records: list, warmup: int, concurrency: int, port: int | None, every_s: float = 15.0
):
    """A line every `every_s` while a load runs, so that a run cut short by its time limit
    still tells a slow start (requests finishing) from a stall (none for a while), and,
    from the server's /metrics, a stall inside one engine step (no step ended since the
    last line: a hang or a kernel compiling) from steps that run but finish nothing (slow
    steps, or preemptions for want of KV blocks)."""
    start = time.perf_counter()
    before = None
    while True:
        await asyncio.sleep(every_s)
        warm = sum(i < warmup for i, _ in records)
        last = max((rec.done for _, rec in records), default=start)
        line = (
            f"  C={concurrency}: {time.perf_counter() - start:.0f} s into the load, "
            f"{warm} of {warmup} warm-up and {len(records) - warm} timed "
            f"requests done, the last {time.perf_counter() - last:.1f} s ago"
        )
        if port is not None:
            try:
                now = await asyncio.to_thread(read_metrics, port)
            except OSError as exc:
                line += f"; server metrics unreadable ({exc})"
            else:
                if before is not None:
                    steps = now["steps"] - before["steps"]
                    mean = (now["step_s"] - before["step_s"]) / steps * 1e3 if steps else 0.0
                    line += (
                        f"; server: {steps:.0f} steps ended since the last line "
                        f"({mean:.1f} ms mean), {now['preempted'] - before['preempted']:.0f} "
                        "preemptions"
                    )
                before = now
        print(line, flush=True)


def saturated(timed: list[Record], every: list[Record], end: float) -> tuple[float, float, int]:
    """(audio seconds, wall seconds, requests finished) while every client was busy: from the
    first timed send to the moment the first client ran out of requests, counting every
    request's audio that arrived in that window (warm-up requests still running included).
    Unlike the whole run's wall, it leaves out the tail where fewer than C requests remain."""
    start = min(r.sent for r in timed)
    audio = sum(s for r in every for t, s in r.arrivals if start <= t <= end)
    return audio, end - start, sum(1 for r in every if start <= r.done <= end)


def summarise(
    records: list[Record], window: tuple[float, float], wall: float | None = None
) -> dict:
    """Figures over `records`; `wall` defaults to first send -> last done; `window` is the
    saturated (audio seconds, wall seconds, requests finished)."""
    wall = wall or max(r.done for r in records) - min(r.sent for r in records)
    ttfa = sorted((r.first_audio - r.sent) * 1e3 for r in records if r.first_audio)
    pct = lambda p: ttfa[min(len(ttfa) - 1, int(round(p / 100 * (len(ttfa) - 1))))]  # noqa: E731
    return {
        "audio_s_per_s": window[0] / window[1],
        "window_audio_s": window[0],
        "saturated_s": window[1],
        "window_requests": window[2],
        "window_requests_per_s": window[2] / window[1],
        "audio_s_per_s_whole": sum(r.audio_s for r in records) / wall,
        "requests_per_s": len(records) / wall,
        "wall_s": wall,
        "ttfa_mean": statistics.fmean(ttfa),
        "ttfa_p50": pct(50),
        "ttfa_p95": pct(95),
        "ttfa_p99": pct(99),
        "completion_mean": statistics.fmean(r.done - r.sent for r in records),
        "underruns": sum(r.underruns for r in records),
        "chunks": sum(len(r.arrivals) for r in records),
        "underruns_per_1000": 1e3
        * sum(r.underruns for r in records)
        / max(1, sum(len(r.arrivals) for r in records)),
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


async def create_voices(url: str, voices: list[tuple[bytes, str]]) -> list[str]:
    """Registers every (recording, transcript) on one connection; their voice ids."""
    import websockets

    ids = []
    async with websockets.connect(url, max_size=None) as ws:
        json.loads(await ws.recv())
        for n, (audio, transcript) in enumerate(voices):
            message = {
                "type": "voice.create",
                "request_id": f"bench-{n}",
                "audio_b64": base64.b64encode(audio).decode(),
                "transcript": transcript,
            }
            await ws.send(json.dumps(message))
            while True:
                data = json.loads(await ws.recv())
                if data["type"] == "voice.created":
                    ids.append(data["voice_id"])
                    break
                if data["type"] == "error":
                    raise RuntimeError(data)
    return ids


def bench_server(args, eager: bool, out: Path, num_voices: int, cold: bool = False) -> dict:
    """Every concurrency, `--starts` times, each request cloning one of `num_voices` voices
    (`cold`: on a server without prefix caching, so every clone prompt is computed in full);
    with `--fresh-server` each start gets its own server process (independent starts),
    otherwise one server serves them all."""
    port = args.port + (1 if eager else 0)
    tag = f"{'-eager' if eager else ''}-v{num_voices}{'-cold' if cold else ''}"
    log = out / f"server{tag}.log"
    url = f"ws://127.0.0.1:{port}/v1/stream"
    runs: dict[int, list] = {int(c): [] for c in args.concurrency.split(",")}
    server = None
    try:
        for s in range(args.starts):
            if server is None:
                server = start_server(
                    args.model, port, eager, args.max_num_seqs, log, args.sim, not cold
                )
                voice_ids = asyncio.run(create_voices(url, pool(num_voices, seed=num_voices)))
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready") as r:
                    plan = json.load(r)["plan"]
                buckets = plan["graph_buckets"] if plan["cuda_graphs"] else []  # []: eager
            for c, starts in runs.items():
                before = read_metrics(port)
                cpu0 = process_cpu(server.pid)
                t0 = time.perf_counter()
                warmup = max(c, min(args.warmup, 4 * c))
                timed = args.requests if args.requests > 0 else max(16, 2 * c)
                if c == 1 and args.requests > 0:  # a closed loop of one: fewer suffice
                    warmup, timed = min(warmup, 4), args.c1_requests
                sampler = RunningSampler(port)
                recs, every, end = asyncio.run(
                    run_load(url, voice_ids, c, warmup, timed, 1000 * c + s, args.timed_s)
                )
                running, waiting = sampler.stop(min(r.sent for r in recs), end)
                grown = delta(read_metrics(port), before)
                load_s = time.perf_counter() - t0
                cpu = {
                    k: (v - cpu0.get(k, 0.0)) / load_s for k, v in process_cpu(server.pid).items()
                }
                summary = summarise(recs, saturated(recs, every, end))
                summary["cpu_cores"] = cpu
                summary["mean_running"], summary["mean_waiting"] = running, waiting
                steps = max(1.0, grown["steps"])
                summary["rows_per_step"] = grown["rows"] / steps
                summary["step_ms"] = grown["step_s"] / steps * 1e3
                summary["loop_ms"] = load_s / steps * 1e3  # wall per step, idle included
                summary["window_rows_per_step"] = sampler.window_rows
                summary["window_wall_ms"] = sampler.window_wall_ms
                summary["window_step_ms"] = sampler.window_step_ms
                summary["window_phase_ms"] = sampler.window_phase_ms
                summary["window_long_steps"] = sampler.window_long_steps
                summary["metrics_scrape_ms"] = sampler.scrape_ms
                # the workload as the engine saw it (warm-up included: whole-load totals)
                prompts = grown["prefill"] + grown["prefix_hits"]
                summary["prefix_hit_share"] = grown["prefix_hits"] / prompts if prompts else 0.0
                summary["prefill_per_request"] = grown["prefill"] / max(1.0, grown["queued"])
                # chunk windows a codec batch (what the plan's codec_defer_steps raises)
                batches = max(1.0, grown["codec_batches"])
                summary["codec_windows_per_batch"] = grown["codec_windows"] / batches
                summary["voices"] = num_voices
                summary["step_tokens"] = grown["tokens"]
                summary["routed"] = grown["routed"]  # engine/reason -> utterances
                summary["graph_buckets"] = buckets
                print(
                    f"{num_voices} voices C={c} start {s + 1}: saturated window "
                    f"{summary['saturated_s']:.1f} s ({summary['window_requests']} requests done "
                    f"in it): mean running {running:.1f}, waiting {waiting:.1f}, "
                    f"{sampler.window_rows:.1f} rows a step, {sampler.window_wall_ms:.2f} ms of "
                    f"wall and {sampler.window_step_ms:.2f} ms in step() a step ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in sampler.window_phase_ms.items())
                    + f"), {sampler.window_long_steps:.0f} steps over 20 ms; prefix hits "
                    f"{summary['prefix_hit_share']:.0%} of prompt positions, "
                    f"{summary['prefill_per_request']:.0f} computed per request; "
                    f"{summary['codec_windows_per_batch']:.2f} windows a codec batch; /metrics "
                    f"answered in {sampler.scrape_ms[0]:.1f} ms mean, {sampler.scrape_ms[1]:.1f} "
                    f"max; client gap {summary['client_gap_ms']:.1f} ms; CPU cores busy: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()),
                    flush=True,
                )
                starts.append((summary, recs))
                partial = {str(k): [x for x, _ in v] for k, v in runs.items()}
                (out / f"partial{tag}.json").write_text(json.dumps(partial, indent=1))
            if args.fresh_server:
                stop_server(server)
                server = None
    finally:
        if server is not None:
            stop_server(server)
    results = {}
    for c, starts in runs.items():
        results[c] = [s for s, _ in starts] + [pooled([s for s, _ in starts], starts)]
    return results


def pooled(summaries: list[dict], starts) -> dict:
    """The starts together: every record's latencies, the windows' audio and wall summed,
    the per-start audio-s/s range, the mean of the per-start engine figures."""
    windows = [(s["window_audio_s"], s["saturated_s"], s["window_requests"]) for s in summaries]
    pool_ = summarise(
        [r for _, recs in starts for r in recs],
        tuple(sum(w[i] for w in windows) for i in range(3)),
        wall=sum(s["wall_s"] for s in summaries),
    )
    rates = [s["audio_s_per_s"] for s in summaries]
    pool_["audio_s_per_s_range"] = (min(rates), max(rates))
    pool_["starts"] = len(summaries)
    for key in (
        "step_ms",
        "prefix_hit_share",
        "prefill_per_request",
        "window_step_ms",
        "codec_windows_per_batch",
    ):
        pool_[key] = statistics.fmean(s[key] for s in summaries)
    pool_["voices"] = summaries[0]["voices"]
    pool_["graph_buckets"] = summaries[0]["graph_buckets"]
    tokens: dict[float, float] = {}
    for s in summaries:
        for edge, n in s["step_tokens"].items():
            tokens[edge] = tokens.get(edge, 0.0) + n
    pool_["step_tokens"] = tokens
    return pool_


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
        help="excluded requests, at least C (fewer would time the cold ramp) and at most 4C; -1: C",
    )
    ap.add_argument(
        "--timed-s",
        type=float,
        default=0.0,
        help="time every request sent within this many seconds instead of --requests (and "
        "--c1-requests): a saturated window of at least that long at any concurrency",
    )
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument(
        "--voices",
        default="64cold,64,1",
        help="voice pools, one run each: 64cold, 64 distinct 3-6 s references on a server "
        "without prefix caching (every clone prompt computed in full, ~200 positions); 64, "
        "the same with prefix caching (a voice used again reuses its prompt); 1, one voice",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--c1-requests", type=int, default=32, help="timed requests at C=1")
    ap.add_argument("--eager", action="store_true", help="also run without CUDA graphs")
    ap.add_argument("--eager-concurrency", default="1,64", help="concurrencies of the eager run")
    ap.add_argument("--eager-requests", type=int, default=0, help="timed requests of the eager run")
    ap.add_argument("--fresh-server", action="store_true", help="a new server process per start")
    ap.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="the servers' CLONECAST_QUANTIZATION (fp8: float8 projection weights, lossy)",
    )
    ap.add_argument(
        "--sim",
        help="run benchmarks/sim_server.py with these arguments instead (GPU work simulated)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    args = ap.parse_args()
    if args.quantization != "none":  # every server this run starts inherits it
        os.environ["CLONECAST_QUANTIZATION"] = args.quantization
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.write_full:
        write_full(Path(args.write_full))
        args.model = args.write_full
    ident = identity(args, ap)
    print(describe_identity(ident), flush=True)
    pools = [(int(v.removesuffix("cold")), v.endswith("cold")) for v in args.voices.split(",")]
    runs = {f"v{v}": bench_server(args, False, out, n, cold) for v, (n, cold) in zip(
        args.voices.split(","), pools, strict=True)}  # fmt: skip
    sizes = [n for n, _ in pools]
    if args.eager:
        args.concurrency, args.requests = args.eager_concurrency, args.eager_requests
        args.starts, args.warmup = 1, -1
        runs[f"eager-v{sizes[-1]}"] = bench_server(args, True, out, sizes[-1])
    (out / "serve_bench.json").write_text(json.dumps({"identity": ident, **runs}, indent=2))
    print(describe_identity(ident))
    print_table(runs)


def write_full(path: Path) -> None:
    from engine.checkpoint_writer import write_full_size_checkpoint

    write_full_size_checkpoint(path)


if __name__ == "__main__":
    main()
