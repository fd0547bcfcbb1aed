"""The browser origin allow-list (CLONECAST_ALLOWED_ORIGINS) on HTTP, as on the WebSocket: a
request to the API whose `Origin` is not in the list is refused 403 `forbidden_origin`
before any endpoint (or CORS preflight) sees it. A request without an `Origin` (curl, SDKs,
balancers, Prometheus) is never refused here; the web demo's static files are not checked
(they hold no data and do nothing). The WebSocket refuses with its own close code (ws.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.auth import origin_allowed
from service.web_files import API_PREFIXES


class OriginCheck:
    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]):
        self.app = app
        self.allowed = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIXES):
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin_allowed(origin, self.allowed):
            return await self.app(scope, receive, send)
        scope["app"].state.services.metrics.errors.labels("forbidden_origin", "http").inc()
        body = {"error": {"code": "forbidden_origin", "message": "this origin is not allowed"}}
        await JSONResponse(body, status_code=403)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
