"""Per-key limits on the real server: utterances at once and audio seconds a minute, shared by
a key's WebSocket connections, its HTTP speech requests and its browser tokens; refused with
`rate_limited` and when to retry (HTTP 429 with Retry-After, `retry_after_s` on the socket);
other keys go on; the refusals counted by key name. And API keys from a key file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import (
    check_complete,
    collect,
    expect_error,
    open_ws,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
)

ROOT = Path(__file__).resolve().parents[2]
SPEECH = {"input": "Hi.", "max_duration_s": 0.4, "response_format": "pcm"}


def _owner(key: str) -> str:
    return "k_" + hashlib.sha256(key.encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def one_at_a_time(make_server):
    return make_server(api_keys=("ka", "kb"), max_utterances_per_key=1)


def _speech(server, key: str) -> httpx.Response:
    return httpx.post(
        server.http + "/v1/audio/speech", json=SPEECH, headers={"X-API-Key": key}, timeout=60
    )


def test_a_key_at_its_utterance_limit_is_refused_everywhere_and_others_go_on(one_at_a_time):
    server = one_at_a_time
    token = httpx.post(
        server.http + "/v1/tokens", headers={"X-API-Key": "ka"}, json={}, timeout=30
    ).json()["token"]

    async def main():
        async with open_ws(server.ws + "?api_key=ka") as busy:
            await busy.send(speak("long", dur=20.0))
            await recv_until(busy, "started", id="long")
            async with open_ws(server.ws, additional_headers={"X-API-Key": "ka"}) as second:
                await second.send(speak("two", dur=0.4))
                refused = await expect_error(second, "rate_limited")
            async with open_ws(server.ws + f"?token={token}") as page:  # ka's token: ka's limit
                await page.send(speak("page", dur=0.4))
                from_token = await expect_error(page, "rate_limited")
            http = await _in_thread(_speech, server, "ka")
            other = await _in_thread(_speech, server, "kb")
            await busy.send(json.dumps({"type": "cancel", "id": "long"}))
            await recv_until(busy, "cancelled", id="long")
            await busy.send(speak("again", dur=0.4))  # the cancel freed its slot
            again = (await collect(busy, ["again"]))["again"]
        return refused, from_token, http, other, again

    refused, from_token, http, other, again = run(main())
    assert refused["id"] == "two" and refused["retry_after_s"] == 1
    assert "ka" not in refused["message"] and _owner("ka") in refused["message"]  # its name
    assert from_token["id"] == "page"
    assert http.status_code == 429 and http.headers["retry-after"] == "1"
    body = http.json()["error"]
    assert body["code"] == "rate_limited" and body["retry_after_s"] == 1
    assert other.status_code == 200 and len(other.content) > 0  # kb has its own limit
    check_complete(again)
    m = scrape(server)
    series = f'clonecast_key_rate_limited_total{{key="{_owner("ka")}",limit="utterances"}}'
    assert m[series] == 3
    assert m['clonecast_errors_total{code="rate_limited",transport="http"}'] >= 1


async def _in_thread(fn, *args):
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_every_http_ending_frees_the_keys_slot(one_at_a_time):
    """Whole, streamed, SSE, and a streamed response its client leaves early: after each the
    key runs nothing, so the next request is admitted."""
    server, owner = one_at_a_time, _owner("kb")
    limits = server.services.key_limits
    for extra in ({}, {"stream": True}, {"stream_format": "sse"}):
        r = httpx.post(
            server.http + "/v1/audio/speech",
            json={**SPEECH, **extra},
            headers={"X-API-Key": "kb"},
            timeout=60,
        )
        assert r.status_code == 200 and r.content
        assert limits.running(owner) == 0
    long = {**SPEECH, "max_duration_s": 20.0, "stream": True}
    with httpx.stream(
        "POST", server.http + "/v1/audio/speech", json=long, headers={"X-API-Key": "kb"}
    ) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the first audio, then the client goes
    deadline = time.monotonic() + 10
    while limits.running(owner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert limits.running(owner) == 0
    assert _speech(server, "kb").status_code == 200


def test_a_key_past_its_audio_seconds_a_minute_waits_for_them_to_age_out(make_server):
    server = make_server(api_keys=("ka", "kb"), max_audio_s_per_minute_per_key=1.0)
    ok = _speech(server, "ka")  # 0.4 s
    assert ok.status_code == 200

    async def main():
        async with open_ws(server.ws + "?api_key=ka") as ws:
            await ws.send(speak("one", dur=0.8))  # admitted at 0.4 s: runs to its end (1.2 s)
            first = (await collect(ws, ["one"]))["one"]
            await ws.send(speak("two", dur=0.4))
            refused = await expect_error(ws, "rate_limited")
        return first, refused

    first, refused = run(main())
    check_complete(first)
    assert refused["id"] == "two" and 1 <= refused["retry_after_s"] <= 60
    http = _speech(server, "ka")
    assert http.status_code == 429 and 1 <= int(http.headers["retry-after"]) <= 60
    assert "audio" in http.json()["error"]["message"]
    assert _speech(server, "kb").status_code == 200
    m = scrape(server)
    assert m[f'clonecast_key_rate_limited_total{{key="{_owner("ka")}",limit="audio_seconds"}}'] == 2
    assert m[f'clonecast_key_audio_seconds_total{{key="{_owner("ka")}"}}'] == pytest.approx(1.2)


def test_keys_from_a_key_file_are_known_by_name_and_the_admin_marker_counts(
    make_server, tmp_path_factory
):
    path = tmp_path_factory.mktemp("keys") / "keys"
    digest = {k: hashlib.sha256(k.encode()).hexdigest() for k in ("alice-key", "ops-key")}
    path.write_text(f"alice {digest['alice-key']}\nops {digest['ops-key']} admin\n")
    server = make_server(extra={"api_key_file": path}, max_utterances_per_key=1)
    assert _speech(server, "alice-key").status_code == 200
    assert _speech(server, digest["alice-key"]).status_code == 401  # the hash is no key

    async def main():
        async with open_ws(server.ws, subprotocols=["clonecast.v1", "bearer.alice-key"]) as a:
            await a.send(speak("long", dur=20.0))
            await recv_until(a, "started", id="long")
            async with open_ws(server.ws + "?api_key=ops-key") as ops:
                await ops.send(speak("ops", dur=0.4))  # another key: admitted
                ops_done = (await collect(ops, ["ops"]))["ops"]
            async with open_ws(server.ws + "?api_key=alice-key") as again:
                await again.send(speak("x", dur=0.4))
                refused = await expect_error(again, "rate_limited")
            await a.send(json.dumps({"type": "cancel", "id": "long"}))
            await recv_until(a, "cancelled", id="long")
        return ops_done, refused

    ops_done, refused = run(main())
    check_complete(ops_done)
    assert "'alice'" in refused["message"]  # the key's name, never the key
    created = httpx.post(
        server.http + "/v1/voices?transcript=Hello.",
        content=reference_audio(),
        headers={"X-API-Key": "alice-key"},
        timeout=60,
    )
    assert created.status_code == 201, created.text
    voice_id = created.json()["voice_id"]

    def listed(key: str) -> list[str]:
        r = httpx.get(server.http + "/v1/voices", headers={"X-API-Key": key}, timeout=30)
        return [v["voice_id"] for v in r.json()["voices"]]

    assert listed("alice-key") == [voice_id] and listed("ops-key") == [voice_id]  # an admin
    r = httpx.delete(
        server.http + f"/v1/voices/{voice_id}", headers={"X-API-Key": "ops-key"}, timeout=30
    )
    assert r.status_code == 204 and listed("alice-key") == []
    assert 'clonecast_key_audio_seconds_total{key="ops"}' in scrape(server)


def test_a_bad_key_file_stops_serve_in_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ok\nalice not-a-hash\n")
    r = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--api-key-file", str(path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert str(path) in line and "line 2" in line and "64 hex digits" in line
