"""API keys and allowed browser origins, on the WebSocket (error, then close 4401 / 4403)
and on HTTP (401 JSON errors)."""

from __future__ import annotations

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from service.web_files import WEB_DIR

from .conftest import (
    FRAME_BYTES,
    assert_alive,
    check_complete,
    collect,
    frames_for,
    recv_json,
    run,
    scrape,
    speak,
)


@pytest.fixture(scope="module")
def keyed(make_server):
    return make_server(api_keys=("k1", "k2"))


@pytest.fixture(scope="module")
def origins(make_server):
    return make_server(allowed_origins=("https://ok.example",))


def _refused(uri: str, **kwargs) -> tuple[dict, int | None, list]:
    async def main():
        async with connect(uri, open_timeout=30, **kwargs) as ws:
            first = await recv_json(ws)
            rest = []
            with pytest.raises(ConnectionClosed):
                while True:
                    rest.append(await ws.recv())
            return first, ws.close_code, rest

    return run(main())


def _accepted(uri: str, speak_too: bool = False, **kwargs):
    async def main():
        async with connect(uri, open_timeout=30, **kwargs) as ws:
            ready = await recv_json(ws)
            assert ready["type"] == "ready", ready
            await assert_alive(ws)
            u = None
            if speak_too:
                await ws.send(speak("auth", dur=1.0, seed=1))
                u = (await collect(ws, ["auth"]))["auth"]
            return ws.subprotocol, u

    return run(main())


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"additional_headers": {"Authorization": "Bearer wrong"}},
        {"additional_headers": {"X-API-Key": "k3"}},
        {"query": "?api_key=k"},
        {"subprotocols": ["clonecast.v1", "bearer.nope"]},
        {"additional_headers": {"Authorization": "Basic azE6"}},
    ],
    ids=["none", "bearer-wrong", "x-api-key-wrong", "query-prefix", "subprotocol-wrong", "basic"],
)
def test_ws_without_a_valid_key_is_refused_with_4401(keyed, kwargs):
    kwargs = dict(kwargs)
    uri = keyed.ws + kwargs.pop("query", "")
    err, code, rest = _refused(uri, **kwargs)
    assert err["type"] == "error" and err["code"] == "unauthorized"
    assert code == 4401
    assert rest == []


def test_ws_bearer_header(keyed):
    _, u = _accepted(keyed.ws, speak_too=True, additional_headers={"Authorization": "Bearer k2"})
    check_complete(u)
    assert len(u.payload) == frames_for(1.0) * FRAME_BYTES


def test_ws_x_api_key_header(keyed):
    _accepted(keyed.ws, additional_headers={"X-API-Key": "k1"})


def test_ws_query_parameter(keyed):
    _accepted(keyed.ws + "?api_key=k1")


def test_ws_bearer_subprotocol_negotiates_clonecast_v1(keyed):
    subprotocol, _ = _accepted(keyed.ws, subprotocols=["clonecast.v1", "bearer.k1"])
    assert subprotocol == "clonecast.v1"


def test_ws_subprotocol_is_negotiated_without_keys_too(server):
    subprotocol, _ = _accepted(server.ws, subprotocols=["clonecast.v1"])
    assert subprotocol == "clonecast.v1"
    subprotocol, _ = _accepted(server.ws)
    assert subprotocol is None


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/voices"),
        ("GET", "/v1/voices/v_x"),
        ("DELETE", "/v1/voices/v_x"),
        ("POST", "/v1/voices"),
        ("POST", "/v1/audio/speech"),
    ],
)
def test_http_without_key_is_401(keyed, method, path):
    for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer k1x"}):
        r = httpx.request(method, keyed.http + path, headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.json()["error"]["message"]


def test_http_with_key(keyed):
    r = httpx.get(keyed.http + "/v1/voices", headers={"X-API-Key": "k1"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"voices": []}
    r = httpx.get(keyed.http + "/v1/voices", headers={"Authorization": "Bearer k2"}, timeout=30)
    assert r.status_code == 200
    r = httpx.get(keyed.http + "/v1/voices?api_key=k2", timeout=30)
    assert r.status_code == 200
    body = {"input": "Hi there.", "response_format": "pcm", "max_duration_s": 1, "seed": 1}
    r = httpx.post(
        keyed.http + "/v1/audio/speech", json=body, headers={"X-API-Key": "k2"}, timeout=60
    )
    assert r.status_code == 200 and len(r.content) == frames_for(1.0) * FRAME_BYTES
    # liveness needs no key
    assert httpx.get(keyed.http + "/health", timeout=30).status_code == 200


def test_ws_forbidden_origin_is_refused_with_4403(origins):
    err, code, rest = _refused(origins.ws, origin="https://evil.example")
    assert err["type"] == "error" and err["code"] == "forbidden_origin"
    assert code == 4403 and rest == []


def test_ws_allowed_origin_and_no_origin(origins):
    _accepted(origins.ws, origin="https://ok.example")
    _, u = _accepted(origins.ws, speak_too=True)  # a non-browser client sends no Origin
    check_complete(u)


def test_http_cors_preflight(origins):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    r = httpx.options(
        origins.http + "/v1/audio/speech",
        headers={"Origin": "https://ok.example", **preflight},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://ok.example"
    r = httpx.options(
        origins.http + "/v1/audio/speech",
        headers={"Origin": "https://evil.example", **preflight},
        timeout=30,
    )
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/audio/speech"),
        ("GET", "/v1/voices"),
        ("POST", "/v1/voices"),
        ("DELETE", "/v1/voices/v_x"),
        ("POST", "/v1/tokens"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("GET", "/openapi.json"),
        ("OPTIONS", "/v1/audio/speech"),  # a CORS preflight too
    ],
)
def test_http_from_a_forbidden_origin_is_403_like_the_websocket(origins, method, path):
    before = scrape(origins)['clonecast_errors_total{code="forbidden_origin",transport="http"}']
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.request(method, origins.http + path, headers=headers, timeout=30)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden_origin"
    assert "access-control-allow-origin" not in r.headers
    after = scrape(origins)['clonecast_errors_total{code="forbidden_origin",transport="http"}']
    assert after == before + 1


def test_http_from_an_allowed_origin_or_none_is_served(origins):
    body = {"input": "Hi.", "response_format": "pcm", "max_duration_s": 0.4, "seed": 1}
    for headers in ({"Origin": "https://ok.example"}, {}):
        r = httpx.post(origins.http + "/v1/audio/speech", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and len(r.content) == frames_for(0.4) * FRAME_BYTES
        assert (
            httpx.get(origins.http + "/v1/voices", headers=headers, timeout=30).status_code == 200
        )
    r = httpx.get(origins.http + "/v1/voices", headers={"Origin": "https://ok.example"})
    assert r.headers["access-control-allow-origin"] == "https://ok.example"


@pytest.mark.skipif(not WEB_DIR.is_dir(), reason="no web/ folder")
def test_the_demo_files_are_not_origin_checked(origins):
    """They hold no data and do nothing (a page elsewhere may link the SDK file)."""
    r = httpx.get(origins.http + "/clonecast.js", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200


def test_without_an_allow_list_any_origin_is_served(server):
    r = httpx.get(server.http + "/v1/voices", headers={"Origin": "https://any.example"})
    assert r.status_code == 200


# -- short-lived browser tokens (POST /v1/tokens, ?token=) ------------------------------------


def _mint(server, key: str | None = "k1", **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.http + "/v1/tokens", json=body, headers=headers, timeout=30)


def test_a_token_minted_with_an_api_key_opens_the_socket_without_the_key(keyed):
    r = _mint(keyed, ttl_s=120)
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["token"].startswith("cct1.") and body["ttl_s"] == 120 and body["origin"] is None
    assert 100 < body["expires_at"] - __import__("time").time() <= 120
    _, u = _accepted(f"{keyed.ws}?token={body['token']}", speak_too=True)
    check_complete(u)
    assert len(u.payload) == frames_for(1.0) * FRAME_BYTES


@pytest.mark.parametrize(
    "key, body, code, status",
    [
        (None, {}, "unauthorized", 401),
        ("nope", {}, "unauthorized", 401),
        ("k1", {"ttl_s": 0}, "bad_parameter", 400),
        ("k1", {"ttl_s": 3601}, "bad_parameter", 400),
        ("k1", {"ttl_s": "60"}, "bad_parameter", 400),
        ("k1", {"origin": "app.example"}, "bad_parameter", 400),
        ("k1", {"scope": "all"}, "bad_parameter", 400),
    ],
    ids=[
        "no-key",
        "wrong-key",
        "ttl-0",
        "ttl-too-long",
        "ttl-string",
        "origin-no-scheme",
        "unknown",
    ],
)
def test_minting_needs_an_api_key_and_sane_fields(keyed, key, body, code, status):
    r = _mint(keyed, key, **body)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_expired_forged_and_foreign_tokens_are_unauthorized(keyed, make_server):
    import time

    token = _mint(keyed, ttl_s=1).json()["token"]
    prefix, claims, signature = token.split(".")
    forged = f"{prefix}.{claims}.{signature[:-2]}{'AA' if signature[-2:] != 'AA' else 'BB'}"
    other = make_server(api_keys=("k1",))  # another server: another secret
    foreign = _mint(other, ttl_s=120).json()["token"]
    for bad, why in ((forged, "signature"), (foreign, "signature"), ("cct1.x", "not a")):
        err, code, _ = _refused(f"{keyed.ws}?token={bad}")
        assert (err["code"], code) == ("unauthorized", 4401) and why in err["message"], err
    time.sleep(1.2)
    err, code, _ = _refused(f"{keyed.ws}?token={token}")
    assert (err["code"], code) == ("unauthorized", 4401) and "expired" in err["message"]


def test_a_token_bound_to_an_origin_opens_only_from_that_origin(keyed):
    token = _mint(keyed, ttl_s=120, origin="https://app.example").json()["token"]
    uri = f"{keyed.ws}?token={token}"
    _accepted(uri, origin="https://app.example")
    err, code, _ = _refused(uri, origin="https://evil.example")
    assert (err["code"], code) == ("unauthorized", 4401) and "origin" in err["message"]
    err, code, _ = _refused(uri)  # no Origin at all: not the bound page either
    assert code == 4401


def test_servers_sharing_a_token_secret_accept_each_others_tokens(make_server):
    a = make_server(api_keys=("k1",), token_secret="shared-secret")
    b = make_server(api_keys=("k1",), token_secret="shared-secret")
    token = _mint(a, ttl_s=120).json()["token"]
    _accepted(f"{b.ws}?token={token}")


def test_a_token_request_that_is_not_json_or_too_large_is_refused(keyed):
    headers = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
    url = keyed.http + "/v1/tokens"
    r = httpx.post(url, content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
    r = httpx.post(url, content=b"[1]", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
    r = httpx.post(url, content=b" " * 5000, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "message_too_large"
    r = httpx.post(url, headers={"Authorization": "Bearer k1"}, timeout=30)  # no body: defaults
    assert r.status_code == 201 and r.json()["ttl_s"] == 600
