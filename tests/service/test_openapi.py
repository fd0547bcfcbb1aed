"""The HTTP API's OpenAPI 3.1 document (`/openapi.json`, checked by openapi-spec-validator)
covers every HTTP route the app serves and exactly the fields speech takes; `/docs` shows
it to people."""

from __future__ import annotations

import httpx
from openapi_spec_validator import validate
from starlette.routing import Route

from service.speech_api import SPEECH_FIELDS


def test_the_document_is_valid_openapi_3_1(server):
    spec = httpx.get(server.http + "/openapi.json", timeout=30).json()
    validate(spec)  # raises on any violation of the OpenAPI 3.1 schema
    assert spec["openapi"] == "3.1.0" and spec["info"]["version"] == "0.1.0"


def test_it_covers_every_route_and_the_speech_fields(server):
    spec = httpx.get(server.http + "/openapi.json", timeout=30).json()
    routes = {}
    for route in server.app.routes:
        if isinstance(route, Route) and route.path not in ("/openapi.json", "/docs"):
            routes.setdefault(route.path, set()).update(m.lower() for m in route.methods - {"HEAD"})
    documented = {path: set(item) - {"parameters"} for path, item in spec["paths"].items()}
    assert documented == routes
    speech = spec["components"]["schemas"]["SpeechRequest"]
    assert set(speech["properties"]) == set(SPEECH_FIELDS)
    assert speech["additionalProperties"] is False  # unknown fields are refused, as served


def test_the_page_lists_every_endpoint(server):
    r = httpx.get(server.http + "/docs", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    spec = httpx.get(server.http + "/openapi.json", timeout=30).json()
    for path in spec["paths"]:
        assert path in r.text
    assert "response_format" in r.text and "/openapi.json" in r.text
