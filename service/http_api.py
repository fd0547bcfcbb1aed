"""HTTP endpoints: voice registration, browser tokens, the model list, health, readiness,
Prometheus metrics and the API's description; the error shape `{"error": {"code",
"message"}}` and the helpers every endpoint shares (speech: service/speech_api.py)."""

from __future__ import annotations

import asyncio
import base64
import binascii
from urllib.parse import unquote_to_bytes

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from engine import ConfigError
from service.auth import Caller, caller_for, extract_key
from service.key_limits import RateLimited
from service.openapi import document as openapi_document
from service.openapi import page as openapi_page
from service.protocol import ProtocolError, check_transcript, loads_json
from service.tokens import DEFAULT_TTL_S, MAX_TTL_S

STATUS = {
    "unauthorized": 401,
    "forbidden_origin": 403,
    "rate_limited": 429,
    "unknown_voice": 404,
    "message_too_large": 413,
    "over_capacity": 503,
    "not_ready": 503,
    "draining": 503,
    "name_conflict": 409,
    "voice_store_full": 507,
    "voice_store_error": 507,
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


def rate_limited(request: Request, exc: RateLimited) -> JSONResponse:
    """429 `rate_limited` with when to retry: the `Retry-After` header (whole seconds) and
    `retry_after_s` in the error, as the WebSocket's error message carries it."""
    services_of(request).metrics.errors.labels("rate_limited", "http").inc()
    wait = exc.retry_after_s
    body = {"error": {"code": "rate_limited", "message": str(exc), "retry_after_s": wait}}
    return JSONResponse(body, status_code=429, headers={"Retry-After": str(wait)})


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (no such path, a method the path does not take) in the API's JSON
    error shape, like every other HTTP error."""
    if exc.status_code == 404:
        return error(request, "not_found", f"no endpoint {request.url.path}", 404)
    if exc.status_code == 405:
        return error(request, "method_not_allowed", f"{request.method} is not allowed here", 405)
    if exc.status_code == 408:  # the rest of its body may never come: the connection ends
        response = error(request, "request_timeout", str(exc.detail), 408)
        response.headers["connection"] = "close"
        return response
    return error(request, "bad_request", str(exc.detail), exc.status_code)


def services_of(request: Request):
    return request.app.state.services


def caller_of(request: Request) -> Caller | None:
    """Who is asking (service/auth.py), or None when the key is missing or wrong."""
    key = extract_key(request.headers, request.query_params, [])
    return caller_for(key, services_of(request).keys)


async def health(request: Request) -> Response:
    """Liveness: 200 while the server can serve, is still loading (`loading`), drains
    (`draining`) or restarts its engine (`restarting`: it heals itself); 503 once it cannot
    serve (loading failed, or the engine kept failing: the server then exits) or its engine
    has exited with restarts off (a restart is the only cure, so a liveness probe should
    act)."""
    services = services_of(request)
    if services.load_error is not None:
        return JSONResponse({"status": "failed", "error": services.load_error}, status_code=503)
    if services.draining:
        return JSONResponse({"status": "draining"})
    engines = services.engines
    if services.loaded and engines.num_ready == 0:  # every engine died
        if not engines.restarts_enabled:
            return JSONResponse({"status": "engine_exited"}, status_code=503)
        return JSONResponse({"status": "restarting", "progress": services.progress})
    return JSONResponse({"status": "ok" if services.is_ready else "loading"})


def not_ready(request: Request, engine: bool = False) -> Response | None:
    """The answer of an endpoint that cannot serve now (`not_ready` or `draining`), else
    None. `engine`: the endpoint needs the engine now (speech, a voice to encode)."""
    refusal = services_of(request).refusal(engine)
    return None if refusal is None else error(request, *refusal)


async def ready(request: Request) -> Response:
    """Readiness (not counted as an error: a probe asks it all along): 200 with the model and
    the plan, or 503 with what the server is doing (loading, restarting its engine,
    draining): a balancer sends it nothing new until it is ready again."""
    services = services_of(request)
    refusal = services.refusal(engine=True)
    if refusal is not None:
        body = {"code": refusal[0], "message": refusal[1]}
        return JSONResponse({"error": body, "progress": services.progress}, status_code=503)
    plan = services.worker.info.plan  # how the engine runs on its device
    engines = {"ready": services.engines.num_ready, "total": len(services.engines.slots)}
    return JSONResponse(
        {"status": "ready", "model": services.model_info(), "plan": plan, "engines": engines}
    )


async def metrics(request: Request) -> Response:
    services = services_of(request)
    for slot in services.engines.slots:
        series, client = services.metrics.engine(slot.index), slot.client
        if client is not None and client.stats is not None:
            series.update(client.stats)
        series.up.set(int(client is not None and client.alive))
    return Response(services.metrics.render(), media_type="text/plain; version=0.0.4")


async def voice_create(request: Request) -> Response:
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request, engine=True)) is not None:
        return answer
    services = services_of(request)
    limit = services.settings.limits.max_upload_bytes
    body = await read_body(request, limit * 4 // 3 + 4096)  # base64 in JSON, or raw
    if body is None:
        return error(
            request, "message_too_large", f"reference uploads are limited to {limit} bytes"
        )
    try:
        transcript, name = query_text(request, "transcript"), query_text(request, "name")
    except BadInput as exc:
        return error(request, exc.code, str(exc))
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
    token = services_of(request).tokens.mint(ttl, origin, caller.owner, caller.name)
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
    try:
        deleted = services_of(request).voices.delete(request.path_params["voice_id"], caller)
    except ConfigError as exc:  # the store could not be written: the voice stays
        return error(request, exc.code, str(exc))
    if not deleted:
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
    it is never read whole beyond the limit). A body not all there `body_timeout_s` after
    its head is HTTPException 408 (`request_timeout`, and the connection is closed)."""
    try:
        if int(request.headers.get("content-length") or 0) > limit:
            return None
    except ValueError:
        pass  # the server has already rejected a malformed length
    timeout_s = services_of(request).settings.limits.body_timeout_s
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    return None
                parts.append(part)
    except TimeoutError:
        raise HTTPException(
            408, f"the request body did not arrive within {timeout_s:g} s of its headers"
        ) from None
    return b"".join(parts)


def query_text(request: Request, name: str) -> str | None:
    """A query parameter as text (its last occurrence, as Starlette's query_params), or None
    when absent. Bytes that are not UTF-8 are `bad_request` (BadInput): query_params would
    replace them with U+FFFD, and a transcript would then silently say something else."""
    found = None
    for pair in request.scope.get("query_string", b"").split(b"&"):
        key, _, value = pair.partition(b"=")
        if unquote_to_bytes(key.replace(b"+", b" ")) == name.encode():
            found = value
    if found is None:
        return None
    try:
        return unquote_to_bytes(found.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(
            "bad_request", f"?{name}= is not UTF-8 text: percent-encode its UTF-8 bytes"
        ) from None


class BadInput(ConfigError):
    """A request's input refused, or its utterance failed: with the error code to answer."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
