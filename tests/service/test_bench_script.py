"""The served benchmark script runs end to end (tiny scale, CPU, embedded model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_process import free_port

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, model_cache, *extra: str, voices: int = 1) -> tuple[dict, str]:
    """serve_bench at C = 2 (1 warm-up, 3 timed requests, one start, a pool of `voices`):
    the pooled figures."""
    port = free_port()
    env = {**os.environ, "CLONECAST_CACHE_DIR": str(model_cache), "CLONECAST_DEVICE": "cpu"}
    cmd = [sys.executable, "benchmarks/serve_bench.py", *extra, "--concurrency", "2"]
    cmd += ["--requests", "3", "--warmup", "1", "--starts", "1", "--port", str(port)]
    cmd += ["--voices", str(voices)]
    cmd += ["--out", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads((tmp_path / "serve_bench.json").read_text())
    assert runs["identity"]["commit"] and "versions" in runs["identity"]
    return runs[f"v{voices}"]["2"][-1], result.stdout


def test_serve_bench_smoke(tmp_path, model_cache):
    """Four distinct voices: each prompt is mostly its own (few prefix hits), and the report
    says what it measured and that one start is not a valid result."""
    pool, stdout = _bench(tmp_path, model_cache, voices=4)
    assert pool["first_payloads"] == [15360]
    assert pool["audio_s_per_s"] > 0 and pool["ttfa_p50"] > 0
    assert pool["voices"] == 4 and pool["prefill_per_request"] > 75  # 3-6 s references
    assert pool["window_requests"] >= 1 and pool["underruns_per_1000"] >= 0
    assert pool["codec_windows_per_batch"] >= 1  # every chunk of every request decoded
    assert " windows a codec batch; " in stdout
    assert "commit " in stdout and "NOT VALID (1 starts < 3" in stdout
    # what the start-up made: capture seconds per graph family (none on the CPU) and blocks
    assert "graph capture: backbone 0.0 s, sampler 0.0 s, codec 0.0 s; KV cache: " in stdout
    assert "steps per graph bucket" not in stdout  # the CPU runs eagerly: no buckets
    assert "pool" in stdout


@pytest.mark.parametrize("where", ["", " --engine-process"])
def test_simulated_server_runs_the_same_protocol(tmp_path, model_cache, where):
    """`--sim`: the real service with the GPU work replaced by waits (benchmarks/sim_server.py),
    its engine in a thread of the server or, as served on a GPU, in its own process (where
    the simulation must reach the spawned process: the real CPU forward waits for nothing).
    Steps of 20 + 0 ms: 2 clients of 3 requests each need at least 15 steps to first audio."""
    pool, _ = _bench(tmp_path, model_cache, "--sim", "--step-ms 20+0 --codec-ms 1" + where)
    assert pool["first_payloads"] == [15360]
    assert pool["ttfa_mean"] >= 15 * 20  # the simulated step time really paces the engine
    # the server's own figures inside the saturated window (benchmarks/metrics_window.py)
    start = json.loads((tmp_path / "serve_bench.json").read_text())["v1"]["2"][0]
    # A step takes no longer than the wall time per step, up to the window's edges: the
    # engine reports its step times in batches (every 50 ms), so a window can count a step or
    # two that ran just outside it (seen: 19.9 ms a step against 19.7 of wall time).
    assert 19 <= start["window_step_ms"] <= start["window_wall_ms"] * 1.05
    assert start["window_wall_ms"] < 60
    # two streams: at most two rows a step, up to the same edge effect (rows are counted when
    # read, a step later than it launched; seen 2.02)
    assert 0 < start["window_rows_per_step"] <= 2 * 1.05
    phases = start["window_phase_ms"]
    assert list(phases) == ["schedule", "launch", "audio", "gpu_wait", "rows"]
    assert phases["gpu_wait"] > 10  # the simulated GPU work is waited for there
    # the phases split the time inside step(), and a scrape sees each report of steps whole
    # (their times with the totals taken after the last of them): no edge effect here
    assert sum(phases.values()) <= start["window_step_ms"] + 1e-6


def test_simulated_step_costs_the_mixed_premium_only_with_a_prompt():
    """`--step-ms A+B+M`: a simulated step that computes a prompt chunk (it leaves the decode
    graph) takes M ms more than one of decode chunks alone; both take A + B * tokens."""
    import time
    from types import SimpleNamespace

    from benchmarks.sim_server import simulate
    from engine.request import Request
    from engine.scheduler import ScheduledChunk, SchedulerOutput

    runner = SimpleNamespace(_next_staging_buffer=lambda: None, _prepare=lambda sched: None)
    engine = SimpleNamespace(runner=runner, codec=SimpleNamespace(chunks=SimpleNamespace()))
    simulate(engine, 10.0, 1.0, 0.0, mixed_ms=40.0)
    request = Request.__new__(Request)  # only passed through: the launch reads no field
    decode = [ScheduledChunk(request, 300, 1, True)] * 2
    prompt = [ScheduledChunk(request, 0, 9, True)]

    def cost_ms(chunks, decodes: int) -> float:
        tokens = sum(c.num_tokens for c in chunks)
        sched = SchedulerOutput(chunks, num_tokens=tokens, num_decodes=decodes)
        time.sleep(0.2)  # the simulated GPU is idle again: the step starts now
        t0 = time.perf_counter()
        return (runner.launch(sched).ready_at - t0) * 1e3

    assert cost_ms(decode, 2) == pytest.approx(10 + 2, abs=5)
    assert cost_ms(decode + prompt, 2) == pytest.approx(10 + 11 + 40, abs=5)
    assert cost_ms(prompt, 0) == pytest.approx(10 + 9 + 40, abs=5)

    from benchmarks.sim_server import parse_step_ms, read_sim_env, sim_env

    assert parse_step_ms("3.7+0.029") == (3.7, 0.029, 0.0)
    assert parse_step_ms("1.9+0.0275+0.7") == (1.9, 0.0275, 0.7)
    for bad in ("5", "1+2+3+4", "1+x"):
        with pytest.raises(ValueError):
            parse_step_ms(bad)
    # the engine process gets A, B, the codec's ms and M back in that order
    assert read_sim_env(sim_env(1.5, 0.25, 2.0, 0.75)) == (1.5, 0.25, 2.0, 0.75)
    refused = subprocess.run(
        [sys.executable, "benchmarks/sim_server.py", "--step-ms", "1+2+3+4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "A+B or A+B+M" in refused.stderr


def test_benchmark_config_overrides_parse_and_refuse_bad_items():
    """`--set FIELD=VALUE` of the benchmarks: typed values, and a clear exit otherwise."""
    from benchmarks.overrides import overrides

    assert overrides(["noise_kernel=true", "few_row_gemm_rows=-5"]) == {
        "noise_kernel": True,
        "few_row_gemm_rows": -5,
    }
    assert overrides(["attention_backend=torch", "kv_cache_memory_fraction=0.5"]) == {
        "attention_backend": "torch",
        "kv_cache_memory_fraction": 0.5,
    }
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        overrides(["attention_backend"])


def test_the_report_shares_steps_by_graph_bucket_and_judges_validity():
    from benchmarks.bench_report import bucket_shares, validity, verdicts

    # cumulative step-token histogram: 60 steps <= 64 tokens, 30 more <= 256, 10 above 512
    hist = {1.0: 0, 2.0: 0, 64.0: 60, 128.0: 60, 256.0: 90, 272.0: 90, 512.0: 90}
    hist[float("inf")] = 100
    shares = bucket_shares(hist, [1, 2, 64, 256, 512])
    assert shares == {64: 0.6, 256: 0.3, "eager": 0.1}
    assert bucket_shares(hist, []) == {}
    with pytest.raises(ValueError, match="no edge at graph bucket 32"):
        bucket_shares(hist, [32, 64])
    from engine.plan import DEFAULT_BUCKETS
    from service.metrics import TOKEN_BUCKETS

    assert set(DEFAULT_BUCKETS) <= set(TOKEN_BUCKETS)  # the server's histogram has every edge
    starts = [{"saturated_s": 12.0}, {"saturated_s": 11.0}, {"saturated_s": 10.5}]
    pool = {"audio_s_per_s": 100.0, "audio_s_per_s_range": (98.0, 102.0)}
    assert validity(pool, starts) == "VALID"
    pool["audio_s_per_s_range"] = (90.0, 102.0)
    assert validity(pool, starts[:2]) == "NOT VALID (2 starts < 3; spread 12.0% > 5%)"
    figures = {"audio_s_per_s": 650.0, "ttfa_mean": 90.0, "ttfa_p95": 160.0, "underruns": 0}
    assert verdicts(64, figures) == [
        "audio_s_per_s 650.0 >= 600: PASS",
        "ttfa_mean 90.0 <= 100: PASS",
        "ttfa_p95 160.0 <= 150: FAIL",
        "underruns 0.0 <= 0: PASS",
    ]


def test_a_load_reports_its_progress_while_it_runs(capsys):
    """A run cut by its time limit must still say whether requests were finishing (a slow
    start) or not (a stall): a line every interval with the counts and the last finish."""
    import asyncio
    import time

    from benchmarks.serve_bench import Record, _report_progress

    now = time.perf_counter()
    # requests 0..4 done, 3 of them warm-up (the timed request 4 finished before warm-up 2)
    records = [(i, Record(now, now, now - 2.0, 1.0, 0, 0, "length", [])) for i in (0, 1, 4, 3)]
    printed = []

    async def run():
        task = asyncio.create_task(_report_progress(records, 3, 2, None, every_s=0.05))
        deadline = time.perf_counter() + 10
        while len(printed) < 2 and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
            printed.extend(capsys.readouterr().out.splitlines())
        task.cancel()

    asyncio.run(run())
    assert len(printed) >= 2
    assert "2 of 3 warm-up and 2 timed requests done" in printed[0]
    assert float(printed[-1].rsplit("the last ", 1)[1].split(" s")[0]) >= 2.0


def test_progress_lines_say_whether_the_servers_steps_end(capsys):
    """With the server's /metrics (a loopback stand-in whose step count grows by 3 between
    reads, at 10 ms a step, with one preemption), each line after the first says how many
    engine steps ended since the last line, their mean length and the preemptions; a
    metrics endpoint that fails is named, not fatal."""
    import asyncio
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from benchmarks.serve_bench import _report_progress

    reads = []

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            n = len(reads)
            reads.append(n)
            if n == 3:
                self.send_error(500)
                return
            body = (
                "# HELP clonecast_engine_step_seconds x\n"
                f'clonecast_engine_step_seconds_count{{engine="0"}} {3 * n}\n'
                f'clonecast_engine_step_seconds_sum{{engine="0"}} {0.03 * n}\n'
                f"clonecast_preemptions_total {n}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    printed = []

    async def run():
        task = asyncio.create_task(_report_progress([], 1, 2, server.server_port, every_s=0.05))
        deadline = time.perf_counter() + 10
        while len(printed) < 4 and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
            printed.extend(capsys.readouterr().out.splitlines())
        task.cancel()

    try:
        asyncio.run(run())
    finally:
        server.shutdown()
    assert len(printed) >= 4
    assert "server:" not in printed[0]  # nothing to compare the first read with
    assert "server: 3 steps ended since the last line (10.0 ms mean), 1 preemptions" in printed[1]
    assert "server metrics unreadable" in printed[3]


def test_the_identity_names_the_files_that_ran_by_their_git_tree(tmp_path, monkeypatch):
    """A copied tree's .git may be stale (its HEAD an older commit): the identity's tree id
    is computed from the files themselves, equal to `COMMIT^{tree}` of the commit they are,
    other after any change, and never touches the real index (nothing staged)."""
    import subprocess

    from benchmarks import bench_report

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("build/\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.bin").write_text("ignored")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "w.whl").write_text("the device's wheels")
    monkeypatch.setattr(bench_report, "ROOT", tmp_path)
    assert bench_report.tree_id() == git("rev-parse", "HEAD^{tree}")[:12]
    (tmp_path / "new.py").write_text("y = 2\n")  # untracked, as a copy's new files are
    changed = bench_report.tree_id()
    assert changed not in ("?", git("rev-parse", "HEAD^{tree}")[:12])
    assert git("status", "--porcelain", "--untracked-files=no") == ""  # nothing staged
    monkeypatch.setattr(bench_report, "ROOT", tmp_path / "build")  # not a repository root
    (tmp_path / ".git").rename(tmp_path / "git-moved")
    assert bench_report.tree_id() == "?"


def test_the_identity_shows_the_servers_settings_but_no_secret():
    """A lever's settings reach the servers through the environment: the identity names
    them, but never a key, a secret or a URL (a voice store's may hold a password)."""
    from benchmarks.bench_report import describe_identity, server_environment

    env = {
        "CLONECAST_QUANTIZATION": "fp8",
        "CLONECAST_PLAN": '{"codec_defer_steps":6}',
        "CLONECAST_API_KEYS": "sk-one,sk-two",
        "CLONECAST_API_KEY_FILE": "/etc/keys",
        "CLONECAST_TOKEN_SECRET": "hush",
        "CLONECAST_VOICE_STORE": "postgresql://clonecast:pw@db/voices",
        "HOME": "/root",
    }
    shown = server_environment(env)
    assert shown == {
        "CLONECAST_API_KEYS": "(set)",
        "CLONECAST_API_KEY_FILE": "(set)",
        "CLONECAST_PLAN": '{"codec_defer_steps":6}',
        "CLONECAST_QUANTIZATION": "fp8",
        "CLONECAST_TOKEN_SECRET": "(set)",
        "CLONECAST_VOICE_STORE": "(set)",
    }
    ident = {"commit": "abc", "dirty": False, "gpu": "none", "versions": {}, "settings": {}}
    line = describe_identity({**ident, "environment": shown})
    assert "environment: CLONECAST_API_KEYS=(set), " in line
    assert 'CLONECAST_PLAN={"codec_defer_steps":6}, CLONECAST_QUANTIZATION=fp8' in line
    for secret in ("sk-one", "hush", "pw@", "/etc/keys"):
        assert secret not in line
    assert describe_identity(ident).endswith("settings: defaults; environment: none")
