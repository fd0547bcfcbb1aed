"""HTTP endpoints: voice registration, browser tokens, the model list, health, readiness,
Prometheus metrics and the API's description; the error shape `{"error": {"code",
"message"}}` and the helpers every endpoint shares (speech: service/speech_api.py)."""

from __future__ import annotations

import base64
import binascii

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from engine import ConfigError
from service.auth import Caller, caller_for, extract_key
from service.openapi import document as openapi_document
from service.openapi import page as openapi_page
from service.protocol import ProtocolError, check_transcript, loads_json
from service.tokens import DEFAULT_TTL_S, MAX_TTL_S

STATUS = {
    "unauthorized": 401,
    "unknown_voice": 404,
    "message_too_large": 413,
    "over_capacity": 503,
    "not_ready": 503,
    "name_conflict": 409,
    "voice_store_full": 507,
}


def error(
    request: Request, code: str, message: str, status: int | None = None, count: bool = True
) -> JSONResponse:
    """An HTTP error in the API's shape, counted in errors_total{code, transport="http"}
    unless `count` is False (counted where it happened, or a readiness answer)."""
    if count:
        services_of(request).metrics.errors.labels(code, "http").inc()
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status or STATUS.get(code, 400)
    )


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (no such path, a method the path does not take) in the API's JSON
    error shape, like every other HTTP error."""
    if exc.status_code == 404:
        return error(request, "not_found", f"no endpoint {request.url.path}", 404)
    if exc.status_code == 405:
        return error(request, "method_not_allowed", f"{request.method} is not allowed here", 405)
    return error(request, "bad_request", str(exc.detail), exc.status_code)


def services_of(request: Request):
    return request.app.state.services


def caller_of(request: Request) -> Caller | None:
    """Who is asking (service/auth.py), or None when the key is missing or wrong."""
    settings = services_of(request).settings
    key = extract_key(request.headers, request.query_params, [])
    return caller_for(key, settings.api_keys, settings.admin_keys)


async def health(request: Request) -> Response:
    """Liveness: 200 while the server can serve, or is still loading (`loading`); 503 once
    loading has failed or its engine has exited (a restart is the only cure, so an
    orchestrator's liveness probe should act)."""
    services = services_of(request)
    if services.load_error is not None:
        return JSONResponse({"status": "failed", "error": services.load_error}, status_code=503)
    worker = services.worker
    if worker is not None and worker.alive is False and services.is_ready:
        return JSONResponse({"status": "engine_exited"}, status_code=503)
    return JSONResponse({"status": "ok" if services.is_ready else "loading"})


def _not_ready_message(services) -> str:
    if services.load_error is not None:
        return f"the server could not start: {services.load_error}"
    return f"the server is starting: {services.progress}"


def not_ready(request: Request) -> Response | None:
    """The answer of an endpoint that needs the engine while it is not ready, else None."""
    services = services_of(request)
    if services.is_ready:
        return None
    return error(request, "not_ready", _not_ready_message(services))


async def ready(request: Request) -> Response:
    """Readiness (not counted as an error: a probe asks it all along): 200 with the model and
    the plan, or 503 with what loading is doing."""
    services = services_of(request)
    if not services.is_ready:
        body = {"code": "not_ready", "message": _not_ready_message(services)}
        return JSONResponse({"error": body, "progress": services.progress}, status_code=503)
    if not services.worker.alive:
        msg = "the engine stopped; the server needs a restart"
        return error(request, "not_ready", msg, count=False)
    plan = services.worker.info.plan  # how the engine runs on its device
    return JSONResponse({"status": "ready", "model": services.model_info(), "plan": plan})


async def metrics(request: Request) -> Response:
    services = services_of(request)
    worker = services.worker
    if worker is not None and worker.stats is not None:
        services.metrics.update_engine(worker.stats)
    services.metrics.engine_up.set(int(worker is not None and worker.alive))
    return Response(services.metrics.render(), media_type="text/plain; version=0.0.4")


async def voice_create(request: Request) -> Response:
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    services = services_of(request)
    limit = services.settings.limits.max_upload_bytes
    body = await read_body(request, limit * 4 // 3 + 4096)  # base64 in JSON, or raw
    if body is None:
        return error(
            request, "message_too_large", f"reference uploads are limited to {limit} bytes"
        )
    transcript = request.query_params.get("transcript")
    name = request.query_params.get("name")
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            payload = loads_json(body)
            data = base64.b64decode(payload["audio_b64"], validate=True)
            transcript = payload.get("transcript", transcript)
            name = payload.get("name", name)
        except ProtocolError as exc:
            return error(request, exc.code, str(exc))
        except (KeyError, TypeError, binascii.Error, ValueError):
            return error(
                request,
                "bad_request",
                'send JSON {"audio_b64": ..., "transcript": ...} or a raw audio body',
            )
    elif request.headers.get("content-type", "").startswith("multipart/form-data"):
        try:
            data, form_transcript, form_name = await _voice_form(request, body, limit)
        except BadInput as exc:
            return error(request, exc.code, str(exc))
        transcript, name = form_transcript or transcript, form_name or name
    else:
        data = body
    if len(data) > limit:
        return error(
            request, "message_too_large", f"reference uploads are limited to {limit} bytes"
        )
    try:
        transcript = check_transcript(transcript)
    except ProtocolError as exc:
        return error(request, exc.code, str(exc))
    try:
        voice, cached = await services.create_voice(data, transcript, name, owner=caller.owner)
    except ConfigError as exc:
        return error(request, getattr(exc, "code", "bad_request"), str(exc))
    return JSONResponse({**voice.describe(), "cached": cached}, status_code=200 if cached else 201)


async def _voice_form(request: Request, body: bytes, limit: int) -> tuple[bytes, str, str]:
    """A multipart upload (what browsers' FormData and most HTTP clients send): the audio in
    a `file` part, optional `transcript` and `name` fields. Parsed from the body already read
    within the limit."""

    async def once():
        yield body

    parser = MultiPartParser(
        request.headers, once(), max_files=1, max_fields=4, max_part_size=limit
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadInput("bad_request", f"not a valid multipart upload: {exc.message}") from exc
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise BadInput("bad_request", "a multipart upload needs its audio in a 'file' part")
    data = await upload.read()
    await form.close()
    fields = {k: form.get(k) for k in ("transcript", "name")}
    if any(v is not None and not isinstance(v, str) for v in fields.values()):
        raise BadInput("bad_request", "'transcript' and 'name' must be text fields")
    return data, fields["transcript"], fields["name"]


async def token_create(request: Request) -> Response:
    """A short-lived browser token (service/tokens.py) for a backend that holds an API key:
    body `{"ttl_s": 1..3600 (600), "origin": "https://..." (optional binding)}`."""
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    raw = await read_body(request, 4096)
    if raw is None:
        return error(request, "message_too_large", "the body is limited to 4096 bytes")
    try:
        body = loads_json(raw) if raw.strip() else {}
    except ProtocolError as exc:
        return error(request, exc.code, str(exc))
    if not isinstance(body, dict):
        return error(request, "bad_json", "the body must be a JSON object")
    ttl = body.get("ttl_s", DEFAULT_TTL_S)
    if type(ttl) is not int or not 1 <= ttl <= MAX_TTL_S:
        return error(
            request, "bad_parameter", f"ttl_s must be an integer in 1..{MAX_TTL_S}, got {ttl!r}"
        )
    origin = body.get("origin")
    if origin is not None and (not isinstance(origin, str) or "://" not in origin):
        return error(
            request, "bad_parameter", "origin must be a page origin such as https://app.example"
        )
    unknown = sorted(set(body) - {"ttl_s", "origin"})
    if unknown:
        return error(request, "bad_parameter", f"unknown field(s) {unknown}; known: ttl_s, origin")
    token = services_of(request).tokens.mint(ttl, origin, caller.owner)
    return JSONResponse(
        {"token": token.token, "expires_at": token.expires_at, "ttl_s": ttl, "origin": origin},
        status_code=201,
        headers={"Cache-Control": "no-store"},
    )


async def list_voices(request: Request) -> Response:
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    voices = services_of(request).voices.list(caller)
    return JSONResponse({"voices": [v.describe() for v in voices]})


async def voice_get(request: Request) -> Response:
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    voice = services_of(request).voices.get(request.path_params["voice_id"], caller)
    if voice is None:
        return error(request, "unknown_voice", f"no voice {request.path_params['voice_id']!r}")
    return JSONResponse(voice.describe())


async def voice_delete(request: Request) -> Response:
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    if not services_of(request).voices.delete(request.path_params["voice_id"], caller):
        return error(request, "unknown_voice", f"no voice {request.path_params['voice_id']!r}")
    return Response(status_code=204)


async def openapi(request: Request) -> Response:
    """The HTTP API as OpenAPI 3.1 (open, like /health: it holds no secret)."""
    return JSONResponse(openapi_document())


async def api_page(request: Request) -> Response:
    return HTMLResponse(openapi_page(openapi_document()))


async def list_models(request: Request) -> Response:
    """OpenAI's model list: the one model this server serves (its id is `model` in speech)."""
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    services = services_of(request)
    if (answer := not_ready(request)) is not None:
        return answer
    info = services.model_info()
    model = {
        "id": info["id"],
        "object": "model",
        "created": services.started,
        "owned_by": "clonecast",
    }
    return JSONResponse({"object": "list", "data": [model]})


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it exceeds `limit` bytes (announced or chunked alike:
    it is never read whole beyond the limit)."""
    try:
        if int(request.headers.get("content-length") or 0) > limit:
            return None
    except ValueError:
        pass  # the server has already rejected a malformed length
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


class BadInput(ConfigError):
    """A request's input refused, or its utterance failed: with the error code to answer."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
