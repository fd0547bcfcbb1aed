"""The soak (benchmarks/soak.py): its checks can fail (a growing series, a file or thread
left after the load, a count the server disagrees with, audio after the last frame), and a
short soak on the embedded model (about 300 requests, every scenario) leaks no KV block,
open file or thread in the server or its engine process, and every request ends as
expected."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import soak_report as report  # noqa: E402
from benchmarks.soak_conn import Unexpected, UtteranceReader  # noqa: E402
from benchmarks.soak_probe import kv_blocks_used, parse_metrics  # noqa: E402
from clonecast_client.wire import pack_audio, unpack_audio  # noqa: E402


def _rows(values: list[float], name: str = "server_fds") -> list[dict]:
    base = {k: 0 for k in report.SERIES} | {"phase": "load"}
    return [{**base, name: v} for v in values]


def test_growth_tells_a_leak_from_noise():
    noisy = [20, 24, 19, 23, 21, 25, 20, 22, 24, 19, 21, 23]
    assert report.growth(_rows(noisy))["server_fds"]["verdict"] == "flat"
    leaking = list(range(20, 44, 2))  # two more open files every sample
    assert report.growth(_rows(leaking))["server_fds"]["verdict"] == "growing"
    assert report.growth(_rows([20] * 4))["server_fds"]["verdict"] == "too_few_samples"


def test_idle_check_flags_what_did_not_come_back():
    baseline = {"kv_blocks_used": 0, "engine_running": 0, "connections": 0}
    baseline |= {"server_fds": 18, "engine_fds": 11, "server_threads": 8, "engine_threads": 12}
    assert report.idle_check(baseline, {**baseline, "server_fds": 20}) == []  # the slack
    problems = report.idle_check(baseline, {**baseline, "server_fds": 21, "kv_blocks_used": 3})
    assert len(problems) == 2 and "kv_blocks_used" in problems[0] and "server_fds" in problems[1]
    assert report.idle_check(baseline, {**baseline, "engine_threads": None})  # engine gone


def test_reconcile_compares_outcomes_and_error_codes():
    client = Counter(
        {("speak", "done"): 5, ("cancel", "cancelled"): 2, ("bad", "error:bad_json"): 1}
    )
    server = {"outcomes": {"eos": 1, "length": 4, "cancelled": 2}, "errors": {"bad_json": 1}}
    assert report.reconcile(client, server) == []
    lost = {"outcomes": {"length": 4, "cancelled": 2}, "errors": {"bad_json": 1, "internal": 1}}
    problems = report.reconcile(client, lost)
    assert "7 utterances end, the server counted 6" in problems[0]
    assert "internal" in problems[1]


def test_kv_blocks_in_use_are_read_with_or_without_an_engine_label():
    one = "clonecast_kv_cache_free_blocks 12288.0\nclonecast_kv_cache_usage_perc 0.25\n"
    assert kv_blocks_used(parse_metrics(one)) == 4096
    two = (
        'clonecast_kv_cache_free_blocks{engine="0"} 100.0\n'
        'clonecast_kv_cache_free_blocks{engine="1"} 150.0\n'
        'clonecast_kv_cache_usage_perc{engine="0"} 0.5\n'
        'clonecast_kv_cache_usage_perc{engine="1"} 0.0\n'
    )
    assert kv_blocks_used(parse_metrics(two)) == 100


def _audio(queue: asyncio.Queue, seq: int, payload: bytes, last: bool) -> None:
    queue.put_nowait({"type": "audio", "id": "u", "seq": seq, "bytes": len(payload), "last": last})
    queue.put_nowait(unpack_audio(pack_audio("u", seq, last, payload)))


def _read(items) -> str:
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            item(queue) if callable(item) else queue.put_nowait(item)
        return await UtteranceReader(queue, "u").until_end(asyncio.get_running_loop().time() + 5)

    return asyncio.run(go())


def test_the_reader_accepts_a_well_formed_stream_and_refuses_broken_ones():
    chunk = lambda seq, last=False: lambda q: _audio(q, seq, b"\0\0" * 4, last)  # noqa: E731
    done = {"type": "done", "id": "u", "reason": "length"}
    assert _read([{"type": "started", "id": "u"}, chunk(0), chunk(1, True), done]) == "done"
    for broken in (
        [chunk(0), done],  # done before the last frame
        [chunk(0), chunk(2, True), done],  # a frame missing
        [chunk(0, True), chunk(1), done],  # audio after the last frame
    ):
        with pytest.raises(Unexpected):
            _read(broken)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_a_short_soak_leaks_nothing(model_cache):
    from benchmarks.soak import run_soak, started_server
    from benchmarks.soak_setup import scenarios

    lines: list[str] = []
    env = {"CLONECAST_CACHE_DIR": str(model_cache), "CLONECAST_DEVICE": "cpu"}
    with started_server(env) as (url, pid):
        summary = asyncio.run(
            run_soak(
                url,
                pid,
                clients=3,
                minutes=10,  # a cap: the run stops at max_requests
                max_requests=300,
                sample_s=3.0,
                max_duration_s=0.8,
                num_voices=4,
                out=lines.append,
            )
        )
    log = "\n".join(lines)
    assert summary["failures"] == {}, log
    assert summary["idle_problems"] == [], log
    assert summary["reconcile_problems"] == [], log
    assert summary["requests"] >= 300, log
    assert {key.split()[0] for key in summary["outcomes"]} == set(scenarios()), log
    rows = summary["rows"]
    baseline, idle = rows[0], rows[-1]
    assert idle["kv_blocks_used"] == 0 and idle["engine_running"] == 0, log
    assert len({row["engine_pid"] for row in rows}) == 1, log  # the same engine(s) throughout
    # the warm-up encoded every recording of the run (a refused one is never cached): the
    # voice cache (clonecast_voice_cache_bytes) holds them and grows no further
    assert baseline["voice_cache_bytes"] > 0, log
    assert idle["voice_cache_bytes"] == baseline["voice_cache_bytes"], log
    for name, slack in report.IDLE_SLACK.items():
        assert idle[name] <= baseline[name] + slack, (name, log)
