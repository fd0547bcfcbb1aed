"""The operator's series over a real server: what each utterance, step, codec batch, voice
and connection adds to /metrics, whichever way it came (WebSocket or HTTP), and the build's
info. Each test reads the series before and after what it does (the server is shared)."""

from __future__ import annotations

import asyncio

import httpx

from .conftest import (
    b64,
    collect,
    open_ws,
    recv_until,
    reference_audio,
    run,
    scrape,
    speak,
    summed,
    wait_engine_idle,
)


def _grew(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _speech(server, **body):
    body = {"input": "Hello from the HTTP API.", "max_duration_s": 1, "seed": 1, **body}
    return httpx.post(server.http + "/v1/audio/speech", json=body, timeout=60)


def test_the_build_is_an_info_series(server):
    m = scrape(server)
    [key] = [k for k in m if k.startswith("clonecast_build_info{")]
    assert m[key] == 1
    assert 'version="0.1.0"' in key and 'device="cpu"' in key and 'dtype="float32"' in key
    assert 'untrained="true"' in key and 'model="embedded-default (untrained)"' in key
    assert m["process_resident_memory_bytes"] > 0 and m["process_open_fds"] > 0


def test_steps_queue_prefill_and_codec_batches_are_observed(server):
    """Two utterances at once over two transports: their requests queued and were scheduled
    (one queue time each), their prompts were prefilled, the engine's steps are observed by
    kind with their batch sizes, and every chunk window came from a timed codec batch."""
    before = wait_engine_idle(server)

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("w", dur=1.0, seed=3))
            http = asyncio.to_thread(_speech, server)
            u, r = await asyncio.gather(collect(ws, ["w"]), http)
            return u["w"], r

    u, r = run(main())
    assert r.status_code == 200 and u.done is not None
    after = wait_engine_idle(server)
    assert _grew(before, after, "clonecast_queue_time_seconds_count") >= 2
    assert _grew(before, after, "clonecast_prefill_tokens_total") > 20  # two whole prompts
    decode = 'clonecast_engine_step_seconds_count{engine="0",kind="decode"}'
    assert _grew(before, after, decode) >= 25  # 1 s of audio: at least 25 one-row steps
    launched = sum(
        _grew(before, after, f'clonecast_engine_step_seconds_count{{engine="0",kind="{kind}"}}')
        for kind in ("prefill", "decode", "mixed")
    )
    assert _grew(before, after, "clonecast_engine_batch_size_count") == launched
    # every launched step had at least one request and none more than the two
    batch_sum = _grew(before, after, "clonecast_engine_batch_size_sum")
    assert launched <= batch_sum <= 2 * launched
    assert _grew(before, after, 'clonecast_engine_batch_size_bucket{le="2.0"}') == launched
    windows = _grew(before, after, "clonecast_codec_windows_total")
    assert windows >= 2 * 2  # at least a first chunk and a last one each
    batches = _grew(before, after, "clonecast_codec_batch_seconds_count")
    assert 1 <= batches <= windows
    assert _grew(before, after, "clonecast_codec_batch_seconds_sum") > 0
    # leads: one per chunk of audio after the first (the last frame may be empty), per transport
    ws_lead = 'clonecast_chunk_lead_seconds_count{transport="websocket"}'
    assert _grew(before, after, ws_lead) == sum(1 for f in u.frames if f.payload) - 1


def test_voice_cache_misses_then_hits(server):
    """A recording the engine has not seen is encoded (a miss); the same recording again,
    after its voice was deleted, comes from the engine's voice cache (a hit)."""
    data = reference_audio(1.5, f0=173.0)
    before = scrape(server)
    url = server.http + "/v1/voices"
    created = httpx.post(url, json={"audio_b64": b64(data)}, timeout=60)
    assert created.status_code == 201, created.text
    mid = scrape(server)
    assert _grew(before, mid, "clonecast_voice_cache_misses_total") == 1
    assert _grew(before, mid, "clonecast_voice_cache_hits_total") == 0
    voice_id = created.json()["voice_id"]
    assert httpx.delete(f"{url}/{voice_id}", timeout=30).status_code == 204
    again = httpx.post(url, json={"audio_b64": b64(data)}, timeout=60)
    assert again.status_code == 201 and again.json()["voice_id"] == voice_id
    after = scrape(server)
    assert _grew(mid, after, "clonecast_voice_cache_hits_total") == 1
    assert _grew(mid, after, "clonecast_voice_cache_misses_total") == 0


def test_connection_ends_and_disconnected_utterances_are_counted(server):
    """A client that closes properly, one that vanishes mid-utterance (its utterance counts as
    disconnected, not cancelled), and an explicit cancel."""
    before = scrape(server)

    async def main():
        async with open_ws(server.ws) as ws:
            await ws.send(speak("c", dur=3.0, seed=4))
            await recv_until(ws, "audio", id="c")
            await ws.send('{"type": "cancel", "id": "c"}')
            await recv_until(ws, "cancelled", id="c")
        async with open_ws(server.ws) as ws:
            await ws.send(speak("v", dur=3.0, seed=5))
            await recv_until(ws, "audio", id="v")
            ws.transport.abort()  # no close frame: the TCP connection just ends

    run(main())
    after = wait_engine_idle(server)
    closes = "clonecast_websocket_closes_total"
    assert _grew(before, after, closes + '{reason="client_closed"}') == 1
    assert _grew(before, after, closes + '{reason="client_lost"}') == 1
    outcome = 'clonecast_request_success_total{{finished_reason="{}",transport="websocket"}}'
    assert _grew(before, after, outcome.format("cancelled")) == 1
    assert _grew(before, after, outcome.format("disconnected")) == 1


def test_http_errors_outside_speech_are_counted(server):
    """Every HTTP error answer counts under its code, not only the speech endpoint's; a
    readiness probe's answer is not an error."""
    before = scrape(server)
    assert httpx.get(server.http + "/v1/voices/v_nope", timeout=30).status_code == 404
    assert httpx.get(server.http + "/v1/nothing-here", timeout=30).status_code == 404
    r = httpx.post(server.http + "/v1/voices", content=b"not audio at all", timeout=30)
    assert r.status_code == 400
    code = r.json()["error"]["code"]
    assert _speech(server, speed=2.0).status_code == 400
    after = scrape(server)
    errors = 'clonecast_errors_total{{code="{}",transport="http"}}'
    assert _grew(before, after, errors.format("unknown_voice")) == 1
    assert _grew(before, after, errors.format("not_found")) == 1
    assert _grew(before, after, errors.format(code)) == 1
    assert _grew(before, after, errors.format("bad_parameter")) == 1
    grown = summed(after, "clonecast_errors_total") - summed(before, "clonecast_errors_total")
    assert grown == 4
