"""No secret in the logs of `clonecast serve` (a subprocess at the most verbose level, trace:
uvicorn's access log, the WebSocket handshake's headers, ASGI scopes): after a run that used
every way of giving a key and a token, over HTTP and the WebSocket (right and wrong keys, an
admin key, a key of the key file, a browser token), no key and no token appears anywhere in
its stdout and stderr, and the key names the utterance lines show do."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time

import httpx
from websockets.asyncio.client import connect

from tests.serve_process import start_serve, stop_serve

from .conftest import recv_json, recv_until, speak


async def _ws_session(uri: str, uid: str, **kwargs) -> None:
    """Connects, speaks a short utterance to its end, closes."""
    async with connect(uri, open_timeout=30, **kwargs) as ws:
        assert (await recv_json(ws))["type"] == "ready"
        await ws.send(speak(uid, "Hi.", dur=0.3))
        await recv_until(ws, "done", 60, id=uid)


async def _ws_refused(uri: str, **kwargs) -> None:
    async with connect(uri, open_timeout=30, **kwargs) as ws:
        err = await recv_json(ws)
        assert err["code"] == "unauthorized", err
        assert all(s not in err["message"] for s in kwargs.get("subprotocols", []))


def test_no_key_or_token_is_logged_by_a_run_using_every_auth_method(tmp_path):
    plain, admin, filed = (f"{name}-{secrets.token_hex(12)}" for name in ("plain", "adm", "file"))
    wrong = [f"wrong{i}-{secrets.token_hex(12)}" for i in range(5)]
    key_file = tmp_path / "keys"
    key_file.write_text(f"# tenants\nalice-tenant {hashlib.sha256(filed.encode()).hexdigest()}\n")
    server, url, log = start_serve(
        tmp_path,
        "--log-level",
        "trace",
        "--api-key-file",
        str(key_file),
        CLONECAST_API_KEYS=plain,
        CLONECAST_ADMIN_KEYS=admin,
        CLONECAST_VOICE_STORE="memory",
    )
    ws_url = url.replace("http", "ws") + "/v1/stream"
    speech = {"input": "Hi.", "max_duration_s": 0.3, "response_format": "pcm"}
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            ok = [
                http.post(
                    "/v1/audio/speech", json=speech, headers={"Authorization": "Bearer " + filed}
                ),
                http.post("/v1/audio/speech", json=speech, headers={"X-API-Key": plain}),
                http.post(f"/v1/audio/speech?api_key={admin}", json=speech),
                http.get(f"/v1/voices?api_key={filed}"),
                http.get("/v1/models", headers={"Authorization": "Bearer " + admin}),
            ]
            assert [r.status_code for r in ok] == [200] * 5, [r.text for r in ok]
            refused = [
                http.post(
                    "/v1/audio/speech", json=speech, headers={"Authorization": "Bearer " + wrong[0]}
                ),
                http.get("/v1/voices", headers={"X-API-Key": wrong[1]}),
                http.get(f"/v1/voices?api_key={wrong[2]}"),
            ]
            assert [r.status_code for r in refused] == [401] * 3
            for r in refused:
                assert all(w not in r.text for w in wrong)  # nor in the error messages
            minted = http.post("/v1/tokens", headers={"X-API-Key": filed}, json={"ttl_s": 60})
            token = minted.json()["token"]

        async def sockets():
            await _ws_session(ws_url, "a", additional_headers={"Authorization": "Bearer " + filed})
            await _ws_session(ws_url, "b", additional_headers={"X-API-Key": plain})
            await _ws_session(ws_url + f"?api_key={admin}", "c")
            await _ws_session(ws_url, "d", subprotocols=["clonecast.v1", "bearer." + filed])
            await _ws_session(ws_url + f"?token={token}", "e")
            await _ws_refused(ws_url, additional_headers={"Authorization": "Bearer " + wrong[3]})
            await _ws_refused(ws_url, subprotocols=["clonecast.v1", "bearer." + wrong[4]])
            await _ws_refused(ws_url + f"?api_key={wrong[0]}")
            await _ws_refused(ws_url + f"?token={token[:-4]}AAAA")  # a forged signature

        asyncio.run(sockets())
        time.sleep(0.5)  # the last utterance lines
    finally:
        stop_serve(server)
    text = log.read_text()
    assert "WebSocket /v1/stream" in text and "POST /v1/audio/speech" in text  # logged at all
    assert "authorization" in text.lower()  # the handshake's headers were logged, redacted
    for secret in (plain, admin, filed, *wrong, token, *token.split(".")[1:]):
        assert secret not in text, f"{secret[:8]}... is in the log: {_around(text, secret)}"
    utterances = [line for line in text.splitlines() if "outcome=" in line]
    assert len(utterances) >= 8, utterances
    named = {json.loads(line.split("key=")[1].split()[0]) for line in utterances}
    owner = "k_" + hashlib.sha256(plain.encode()).hexdigest()[:12]
    admin_owner = "k_" + hashlib.sha256(admin.encode()).hexdigest()[:12]
    assert named == {"alice-tenant", owner, admin_owner}  # the token counts as alice-tenant's


def _around(text: str, secret: str) -> str:
    at = text.find(secret)
    return text[max(0, at - 200) : at + 50]
