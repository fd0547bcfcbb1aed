"""HTTP endpoints: OpenAI-style `POST /v1/audio/speech`, voice registration, health,
readiness and Prometheus metrics. Errors are `{"error": {"code", "message"}}`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import uuid

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from engine import ConfigError
from service.audio_containers import CONTAINERS, ContainerEncoder, check_rate
from service.audio_format import wav_header
from service.auth import Caller, caller_for, extract_key
from service.openapi import document as openapi_document
from service.openapi import page as openapi_page
from service.protocol import ProtocolError, check_transcript, loads_json, parse_params
from service.text_segments import split_text
from service.tokens import DEFAULT_TTL_S, MAX_TTL_S
from service.utterance import State, Utterance
from service.utterance_report import UtteranceReport

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm16": "audio/pcm",
    "f32": "audio/x-f32le",
    "mulaw": "audio/basic",
    **{name: media for name, (_, _, media) in CONTAINERS.items()},
}
# response_format -> the utterance's output format (containers encode its PCM16 here)
FORMAT_ALIASES = {
    "wav": "wav",
    "pcm": "pcm16",
    "pcm16": "pcm16",
    "f32": "f32",
    "mulaw": "mulaw",
    **{name: "pcm16" for name in CONTAINERS},
}
# The body of POST /v1/audio/speech: OpenAI's fields, then the project's own. Anything else
# is refused by name, never ignored.
SPEECH_FIELDS = (
    "model",
    "input",
    "voice",
    "response_format",
    "speed",
    "stream_format",
    "stream",
    "sample_rate",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "max_duration_s",
)
NOT_SUPPORTED = {
    "instructions": "'instructions' is not supported: the voice comes from the reference "
    "recording (voice), not from a description",
}
STREAM_FORMATS = ("audio", "sse")
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
        _services(request).metrics.errors.labels(code, "http").inc()
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


def _services(request: Request):
    return request.app.state.services


def _caller(request: Request) -> Caller | None:
    """Who is asking (service/auth.py), or None when the key is missing or wrong."""
    settings = _services(request).settings
    key = extract_key(request.headers, request.query_params, [])
    return caller_for(key, settings.api_keys, settings.admin_keys)


async def health(request: Request) -> Response:
    """Liveness: 200 while the server can serve, or is still loading (`loading`); 503 once
    loading has failed or its engine has exited (a restart is the only cure, so an
    orchestrator's liveness probe should act)."""
    services = _services(request)
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
    services = _services(request)
    if services.is_ready:
        return None
    return error(request, "not_ready", _not_ready_message(services))


async def ready(request: Request) -> Response:
    """Readiness (not counted as an error: a probe asks it all along): 200 with the model and
    the plan, or 503 with what loading is doing."""
    services = _services(request)
    if not services.is_ready:
        body = {"code": "not_ready", "message": _not_ready_message(services)}
        return JSONResponse({"error": body, "progress": services.progress}, status_code=503)
    if not services.worker.alive:
        msg = "the engine stopped; the server needs a restart"
        return error(request, "not_ready", msg, count=False)
    plan = services.worker.info.plan  # how the engine runs on its device
    return JSONResponse({"status": "ready", "model": services.model_info(), "plan": plan})


async def metrics(request: Request) -> Response:
    services = _services(request)
    worker = services.worker
    if worker is not None and worker.stats is not None:
        services.metrics.update_engine(worker.stats)
    services.metrics.engine_up.set(int(worker is not None and worker.alive))
    return Response(services.metrics.render(), media_type="text/plain; version=0.0.4")


async def voice_create(request: Request) -> Response:
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    services = _services(request)
    limit = services.settings.limits.max_upload_bytes
    body = await _read_body(request, limit * 4 // 3 + 4096)  # base64 in JSON, or raw
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
        except _BadInput as exc:
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
        raise _BadInput("bad_request", f"not a valid multipart upload: {exc.message}") from exc
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise _BadInput("bad_request", "a multipart upload needs its audio in a 'file' part")
    data = await upload.read()
    await form.close()
    fields = {k: form.get(k) for k in ("transcript", "name")}
    if any(v is not None and not isinstance(v, str) for v in fields.values()):
        raise _BadInput("bad_request", "'transcript' and 'name' must be text fields")
    return data, fields["transcript"], fields["name"]


async def token_create(request: Request) -> Response:
    """A short-lived browser token (service/tokens.py) for a backend that holds an API key:
    body `{"ttl_s": 1..3600 (600), "origin": "https://..." (optional binding)}`."""
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    raw = await _read_body(request, 4096)
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
    token = _services(request).tokens.mint(ttl, origin, caller.owner)
    return JSONResponse(
        {"token": token.token, "expires_at": token.expires_at, "ttl_s": ttl, "origin": origin},
        status_code=201,
        headers={"Cache-Control": "no-store"},
    )


async def list_voices(request: Request) -> Response:
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    voices = _services(request).voices.list(caller)
    return JSONResponse({"voices": [v.describe() for v in voices]})


async def voice_get(request: Request) -> Response:
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    voice = _services(request).voices.get(request.path_params["voice_id"], caller)
    if voice is None:
        return error(request, "unknown_voice", f"no voice {request.path_params['voice_id']!r}")
    return JSONResponse(voice.describe())


async def voice_delete(request: Request) -> Response:
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    if not _services(request).voices.delete(request.path_params["voice_id"], caller):
        return error(request, "unknown_voice", f"no voice {request.path_params['voice_id']!r}")
    return Response(status_code=204)


async def openapi(request: Request) -> Response:
    """The HTTP API as OpenAPI 3.1 (open, like /health: it holds no secret)."""
    return JSONResponse(openapi_document())


async def api_page(request: Request) -> Response:
    return HTMLResponse(openapi_page(openapi_document()))


async def list_models(request: Request) -> Response:
    """OpenAI's model list: the one model this server serves (its id is `model` in speech)."""
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    services = _services(request)
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


async def speech(request: Request) -> Response:
    """OpenAI-style speech: `{"input", "voice", "response_format", "stream"}` plus our extras."""
    caller = _caller(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request)) is not None:
        return answer
    services = _services(request)
    raw = await _read_body(request, services.settings.limits.max_message_bytes)
    if raw is None:
        limit = services.settings.limits.max_message_bytes
        return error(request, "message_too_large", f"the body is limited to {limit} bytes")
    try:
        body = loads_json(raw)
    except ProtocolError as exc:
        return error(request, exc.code, str(exc))
    if not isinstance(body, dict):
        return error(request, "bad_json", "the body must be a JSON object")
    try:
        job = _speech_job(body, services, caller)
    except ConfigError as exc:
        return error(request, getattr(exc, "code", "bad_parameter"), str(exc))
    if services.worker.num_waiting >= services.settings.limits.max_waiting_requests:
        return error(request, "over_capacity", "the server is at capacity: retry shortly")
    fmt, container = job["format"], job["container"]
    media = MEDIA_TYPES[job["response_format"]]
    encoder = ContainerEncoder(container, fmt.sample_rate) if container else None
    chunks = _generate(services, job, encoder)
    if job["stream"] == "sse":
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")
    if job["stream"] == "audio":
        return StreamingResponse(chunks, media_type=media)
    collecting = asyncio.ensure_future(_collect(chunks))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
        if not collecting.done() and await request.is_disconnected():
            collecting.cancel()  # the generator's cleanup aborts the running request
            await asyncio.gather(collecting, return_exceptions=True)
            return Response(status_code=499)  # nobody reads it: "client closed request"
    try:
        audio = collecting.result()
    except _BadInput as exc:
        return error(request, exc.code, f"generation failed: {exc}", 500, count=False)
    if encoder is not None:  # the complete file, with what its encoder filled in at the end
        audio = encoder.whole()
    elif fmt.format == "wav":  # a proper header with sizes for a complete file
        audio = wav_header(fmt.sample_rate, len(audio) - 44) + audio[44:]
    return Response(audio, media_type=media)


async def _sse(chunks):
    """OpenAI's `stream_format: "sse"`: each piece of audio as a `speech.audio.delta` event
    (base64 of the response format's bytes), then `speech.audio.done`; a failure after the
    start is an `error` event in the API's error shape (the status is already sent)."""

    def event(payload: dict) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    try:
        async for data in chunks:
            if data:
                yield event(
                    {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                )
    except _BadInput as exc:
        yield event({"type": "error", "error": {"code": exc.code, "message": str(exc)}})
        return
    yield event({"type": "speech.audio.done"})


DISCONNECT_POLL_S = 0.25  # a non-streamed speech request checks this often for its client


async def _collect(chunks) -> bytes:
    return b"".join([part async for part in chunks])


async def _read_body(request: Request, limit: int) -> bytes | None:
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


class _BadInput(ConfigError):
    """A request's input refused, or its utterance failed: with the error code to answer."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _speech_job(body: dict, services, caller: Caller) -> dict:
    unknown = sorted(set(body) - set(SPEECH_FIELDS))
    for name in unknown:
        if name in NOT_SUPPORTED:
            raise _BadInput("bad_parameter", NOT_SUPPORTED[name])
    if unknown:
        raise _BadInput(
            "unknown_field", f"unknown field(s) {unknown}; known: {', '.join(SPEECH_FIELDS)}"
        )
    served = services.model_info()["id"]
    model = body.get("model", served)
    if model != served:
        raise _BadInput(
            "unknown_model", f"'model' must be {served!r} (GET /v1/models), got {model!r}"
        )
    text = body.get("input")
    limits = services.settings.limits
    if not isinstance(text, str):
        raise _BadInput("bad_request", "'input' must be a string")
    if not text.strip():
        raise _BadInput("empty_text", "'input' must be a non-empty string")
    if len(text) > limits.max_text_chars:
        raise _BadInput(
            "text_too_long", f"'input' is limited to {limits.max_text_chars} characters"
        )
    if body.get("speed", 1.0) != 1.0:
        raise _BadInput("bad_parameter", "'speed' is not supported (only 1.0)")
    voice_name = body.get("voice", "default")
    if isinstance(voice_name, dict) and set(voice_name) == {"id"}:  # OpenAI's {"id": ...}
        voice_name = voice_name["id"]
    if voice_name is not None and not isinstance(voice_name, str):
        raise _BadInput("bad_request", "'voice' must be a voice_id string or \"default\"")
    reference = None
    if voice_name not in (None, "default"):
        voice = services.voices.get(voice_name, caller)
        if voice is None:
            raise _BadInput(
                "unknown_voice", f"no voice {voice_name!r}: create it with POST /v1/voices"
            )
        reference = voice.reference
    fmt_name = body.get("response_format", "wav")
    if fmt_name == "aac":
        raise _BadInput(
            "bad_parameter", "response_format 'aac' has no encoder here: use mp3, opus or flac"
        )
    if not isinstance(fmt_name, str) or fmt_name not in FORMAT_ALIASES:
        raise _BadInput("bad_parameter", f"response_format must be one of {sorted(FORMAT_ALIASES)}")
    output = {"format": FORMAT_ALIASES[fmt_name]}
    if "sample_rate" in body:
        output["sample_rate"] = body["sample_rate"]
    sampling = {
        k: body[k] for k in ("temperature", "top_k", "top_p", "seed", "max_duration_s") if k in body
    }
    try:
        params, fmt = parse_params(sampling, output, default_max_s=services.default_max_s)
        segments = split_text(text, limits.max_segment_chars)
        for segment in segments:
            services.worker.check_text(segment, reference)
    except ProtocolError as exc:
        raise _BadInput(exc.code, str(exc)) from exc
    except ConfigError as exc:
        raise _BadInput("bad_request", str(exc)) from exc
    container = fmt_name if fmt_name in CONTAINERS else None
    if container:
        try:
            check_rate(container, fmt.sample_rate)
        except ValueError as exc:
            raise _BadInput("bad_parameter", str(exc)) from exc
    voice_id = voice_name if reference is not None else None
    return {
        "segments": segments,
        "reference": reference,
        "voice_id": voice_id,
        "params": params,
        "format": fmt,
        "response_format": fmt_name if container else fmt.format,
        "container": container,
        "stream": _stream_mode(body),
    }


def _stream_mode(body: dict) -> str | None:
    """None (one complete body), "audio" (bytes as they are made) or "sse" (events):
    OpenAI's `stream_format`, or the project's `stream: true` (the same as "audio")."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _BadInput("bad_request", "'stream' must be true or false")
    mode = body.get("stream_format")
    if mode is None:
        return "audio" if stream else None
    if mode not in STREAM_FORMATS:
        raise _BadInput("bad_parameter", f"stream_format must be one of {list(STREAM_FORMATS)}")
    if "stream" in body and not stream:
        raise _BadInput("bad_request", "'stream': false contradicts 'stream_format'")
    return mode


class _Collector:
    """The listener of an HTTP speech request's utterance: its audio into a queue, then None
    (done) or the failure (a _BadInput with the utterance's error code)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_segment(self, utt, start) -> None:
        pass  # HTTP audio carries no captions

    def on_audio(self, utt, data: bytes, start_frame: int, end_frame: int) -> None:
        self.queue.put_nowait((data, len(data) - utt.encoder.header_bytes))

    def on_done(self, utt, tail: bytes) -> None:
        self.queue.put_nowait((tail, len(tail) - utt.encoder.header_bytes))
        self.queue.put_nowait(None)

    def on_failed(self, utt, code: str, message: str) -> None:
        self.queue.put_nowait(_BadInput(code, message))


async def _generate(services, job: dict, container: ContainerEncoder | None = None):
    """The request's utterance (the same runner as the WebSocket's: two segments in flight,
    audio in order); yields encoded audio as it is produced (through `container` when the
    response is FLAC, MP3 or Opus). Closing the generator (the client went away) aborts the
    running requests."""
    collector = _Collector()
    uid = f"http-{uuid.uuid4().hex[:12]}"
    loop = asyncio.get_running_loop()
    utt = Utterance(
        uid, job["reference"], job["params"], job["format"], True, services.worker, loop,
        collector, uid,
    )  # fmt: skip
    utt.voice_id = job["voice_id"]
    utt.report = report = UtteranceReport(
        services.metrics, "http", uid, services.settings.log_format
    )
    try:
        try:
            utt.add_segments(job["segments"])  # checked in _speech_job: refused only by a bug
        except ConfigError as exc:
            services.metrics.errors.labels("bad_request", "http").inc()
            report.stopped(utt, "error", "bad_request")
            raise _BadInput("bad_request", str(exc)) from exc
        utt.pump()
        while (item := await collector.queue.get()) is not None:
            if isinstance(item, _BadInput):
                services.metrics.errors.labels(item.code, "http").inc()
                report.stopped(utt, "error", item.code)
                raise item
            data, audio_bytes = item
            if container is not None:
                data = container.encode(data)
            report.audio_sent(utt, audio_bytes, len(data))  # handed to the response now
            yield data
        if container is not None:
            yield container.finish()
        report.done(utt)
    finally:
        if utt.state is State.RUNNING:
            utt.end(State.CANCELLED)
        report.stopped(utt, "disconnected")  # the client left (nothing if reported already)
