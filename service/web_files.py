"""The browser side (web/): the JavaScript SDK and the demo page, served at `/` by the app.
Static files only; what is not for browsers (Node's packages, the SDK's tests, the npm
manifest) is never served. Every answer must be revalidated (the files change with the
server they belong to) and is never sniffed as another type."""

from __future__ import annotations

from pathlib import Path

from starlette.routing import Match, Mount
from starlette.staticfiles import StaticFiles

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
_NOT_SERVED = ("node_modules", "test", "package.json", "package-lock.json")
API_PREFIXES = ("/v1/", "/health", "/ready", "/metrics", "/openapi.json", "/docs")


class WebFiles(StaticFiles):
    def lookup_path(self, path: str):
        first = path.strip("/").split("/")[0]  # "." is the folder itself (its index.html)
        if first in _NOT_SERVED or (first.startswith(".") and first != "."):
            return "", None
        return super().lookup_path(path)

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


class WebMount(Mount):
    """The web files at `/`, below the API: a path of the API is never theirs, so a wrong
    method on an API path stays a 405 and an unknown API path a 404 of the API."""

    def __init__(self):
        super().__init__("/", app=WebFiles(directory=WEB_DIR, html=True), name="web")

    def matches(self, scope):
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIXES):
            return Match.NONE, {}
        return super().matches(scope)
