"""The dashboard and the alerts on a real Prometheus (Debian's), started here on loopback with
the shipped scrape config and rules (scraping every second): a short load over the WebSocket
and HTTP, then every panel query, with Grafana's macros and variables expanded, evaluated
through Prometheus' HTTP API. Each must return data (Prometheus answers a query of an unknown
metric with success and no data: that emptiness is the failure caught here), the variables'
queries must list the server, and every alert rule must evaluate without error."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serve_process import free_port
from tests.service.conftest import (
    b64,
    collect,
    open_ws,
    recv_until,
    reference_audio,
    run,
    speak,
    wait_engine_idle,
)

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "grafana" / "prometheus"


@pytest.fixture(scope="module")
def live(make_server, tmp_path_factory):
    """A server of its own and a Prometheus scraping it every second (the shipped config with
    its target and interval replaced, and the shipped rules)."""
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is needed: run `make test` as root, or apt-get install prometheus"
    server = make_server()
    target = server.http.removeprefix("http://")
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROM / "alerts.yml")]
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "prometheus.log").open("w"),
    )
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(api + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        # ready is not scraping yet: the load must come after the first scrapes, or its
        # counters start inside the window and their rates read 0
        scraped = f'count_over_time(up{{job="{job["job_name"]}"}}[10s]) >= 2'
        while not _query(api, scraped):
            assert time.monotonic() < deadline, "Prometheus did not scrape the server"
            time.sleep(0.2)
        yield server, api, job["job_name"], target
    finally:
        process.terminate()
        process.wait(timeout=30)


def _query(api: str, expr: str) -> list[dict]:
    r = httpx.get(api + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _load(server) -> None:
    """What an operator's panels show: utterances over both transports (one cancelled, one
    left by its client), a voice encoded and later served from the cache, refused input."""
    voice = reference_audio(1.5, f0=190.0)
    url = server.http + "/v1/voices"
    created = httpx.post(url, json={"audio_b64": b64(voice)}, timeout=60).json()
    httpx.delete(f"{url}/{created['voice_id']}", timeout=30)
    httpx.post(url, json={"audio_b64": b64(voice)}, timeout=60)  # the engine's cache: a hit

    def speech(**body):
        body = {"input": "Hello from the HTTP API.", "max_duration_s": 1, "seed": 1, **body}
        return httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60)

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("a", dur=2.0, seed=1, voice_id=created["voice_id"]))
            await ws.send(speak("b", "A second sentence. And a third.", dur=2.0, seed=2))
            both = asyncio.gather(collect(ws, ["a", "b"]), asyncio.to_thread(speech))
            await both
            await ws.send(speak("c", dur=3.0, seed=3))
            await recv_until(ws, "audio", id="c")
            await ws.send('{"type": "cancel", "id": "c"}')
            await recv_until(ws, "cancelled", id="c")
        async with open_ws(server.ws) as ws:
            await ws.send(speak("d", dur=3.0, seed=4))
            await recv_until(ws, "audio", id="d")
            ws.transport.abort()

    run(main())
    assert speech(speed=3.0).status_code == 400
    wait_engine_idle(server)


def _expand(expr: str, job: str, instance: str, window: str) -> str:
    """Grafana's substitutions: the variables (one value each here) and the interval macros
    (a window that covers the load, as a dashboard's interval would)."""
    for name, value in (
        ("$__rate_interval", window),
        ("$__range", window),
        ("$job", job),
        ("$instance", instance.replace(".", r"\\.")),
    ):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_every_panel_query_returns_data_and_every_rule_evaluates(live):
    server, api, job, target = live
    started = time.monotonic()
    _load(server)
    time.sleep(3)  # a few scrapes after the load
    window = f"{math.ceil(time.monotonic() - started) + 10}s"
    up = _query(api, f'up{{job="{job}"}}')
    assert [s["value"][1] for s in up] == ["1"], up

    board = json.loads((ROOT / "grafana" / "dashboards" / "clonecast.json").read_text())
    empty, evaluated = [], 0
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            expr = _expand(t["expr"], job, target, window)
            result = _query(api, expr)
            values = [float(s["value"][1]) for s in result]
            evaluated += 1
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{panel['title']}: {expr} -> {result}")
    assert evaluated >= 40
    assert empty == [], "\n".join(empty)

    # the variables: label_values(clonecast_engine_up, job) and its instance
    for label, wanted in (("job", job), ("instance", target)):
        r = httpx.get(
            f"{api}/api/v1/label/{label}/values", params={"match[]": "clonecast_engine_up"}
        )
        assert wanted in r.json()["data"], r.json()

    rules = httpx.get(api + "/api/v1/rules", timeout=30).json()["data"]["groups"]
    [group] = rules
    written = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"][0]["rules"]
    assert [r["name"] for r in group["rules"]] == [r["alert"] for r in written]  # all loaded
    deadline = time.monotonic() + 10
    while any(rule.get("lastEvaluation", "").startswith("0001") for rule in group["rules"]):
        assert time.monotonic() < deadline
        time.sleep(0.5)
        group = httpx.get(api + "/api/v1/rules", timeout=30).json()["data"]["groups"][0]
    assert [r["name"] for r in group["rules"] if r["health"] != "ok"] == [], group["rules"]
