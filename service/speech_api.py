"""OpenAI's `POST /v1/audio/speech`: the fields it takes (and refuses by name), the response
formats (PCM, WAV, and FLAC / MP3 / Opus through service/audio_containers.py), whole or
streamed bodies or SSE events, over the same utterance runner as the WebSocket's."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
import weakref

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine import ConfigError
from service.audio_containers import CONTAINERS, ContainerEncoder, check_rate
from service.audio_format import wav_header
from service.auth import Caller
from service.http_api import (
    BadInput,
    caller_of,
    error,
    not_ready,
    rate_limited,
    read_body,
    services_of,
)
from service.key_limits import RateLimited
from service.protocol import ProtocolError, loads_json, parse_params
from service.text_segments import split_text
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


async def speech(request: Request) -> Response:
    """OpenAI-style speech: `{"input", "voice", "response_format", "stream"}` plus our extras."""
    caller = caller_of(request)
    if caller is None:
        return error(request, "unauthorized", "a valid API key is required")
    if (answer := not_ready(request, engine=True)) is not None:
        return answer
    services = services_of(request)
    raw = await read_body(request, services.settings.limits.max_message_bytes)
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
    if services.engines.num_waiting >= services.settings.limits.max_waiting_requests:
        return error(request, "over_capacity", "the server is at capacity: retry shortly")
    if (answer := not_ready(request, engine=True)) is not None:  # again: the body took time
        return answer
    try:
        job["lease"] = services.key_limits.admit(caller.name)
    except RateLimited as exc:
        return rate_limited(request, exc)
    job["engine"] = services.engines.pick(job["voice_id"])
    if job["engine"] is None:  # every engine died since the check above
        job["lease"].release()
        return error(request, "not_ready", "no engine is ready: retry shortly")
    job["key"] = caller.name
    fmt, container = job["format"], job["container"]
    media = MEDIA_TYPES[job["response_format"]]
    encoder = ContainerEncoder(container, fmt.sample_rate) if container else None
    chunks = _generate(services, job, encoder)
    # released when the utterance ends, or with a response that never started (its client
    # left before the body began: the generator's own clean-up never runs)
    weakref.finalize(chunks, job["lease"].release)
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
    except BadInput as exc:
        # the server shut down first, or the engine died before the request reached it
        status = 503 if exc.code in ("draining", "not_ready") else 500
        return error(request, exc.code, f"generation failed: {exc}", status, count=False)
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
    except BadInput as exc:
        yield event({"type": "error", "error": {"code": exc.code, "message": str(exc)}})
        return
    yield event({"type": "speech.audio.done"})


DISCONNECT_POLL_S = 0.25  # a non-streamed speech request checks this often for its client


async def _collect(chunks) -> bytes:
    return b"".join([part async for part in chunks])


def _speech_job(body: dict, services, caller: Caller) -> dict:
    unknown = sorted(set(body) - set(SPEECH_FIELDS))
    for name in unknown:
        if name in NOT_SUPPORTED:
            raise BadInput("bad_parameter", NOT_SUPPORTED[name])
    if unknown:
        raise BadInput(
            "unknown_field", f"unknown field(s) {unknown}; known: {', '.join(SPEECH_FIELDS)}"
        )
    served = services.model_info()["id"]
    model = body.get("model", served)
    if model != served:
        raise BadInput(
            "unknown_model", f"'model' must be {served!r} (GET /v1/models), got {model!r}"
        )
    text = body.get("input")
    limits = services.settings.limits
    if not isinstance(text, str):
        raise BadInput("bad_request", "'input' must be a string")
    if not text.strip():
        raise BadInput("empty_text", "'input' must be a non-empty string")
    if len(text) > limits.max_text_chars:
        raise BadInput("text_too_long", f"'input' is limited to {limits.max_text_chars} characters")
    if body.get("speed", 1.0) != 1.0:
        raise BadInput("bad_parameter", "'speed' is not supported (only 1.0)")
    voice_name = body.get("voice", "default")
    if isinstance(voice_name, dict) and set(voice_name) == {"id"}:  # OpenAI's {"id": ...}
        voice_name = voice_name["id"]
    if voice_name is not None and not isinstance(voice_name, str):
        raise BadInput("bad_request", "'voice' must be a voice_id string or \"default\"")
    reference = None
    if voice_name not in (None, "default"):
        voice = services.voices.get(voice_name, caller)
        if voice is None:
            raise BadInput(
                "unknown_voice", f"no voice {voice_name!r}: create it with POST /v1/voices"
            )
        reference = voice.reference
    fmt_name = body.get("response_format", "wav")
    if fmt_name == "aac":
        raise BadInput(
            "bad_parameter", "response_format 'aac' has no encoder here: use mp3, opus or flac"
        )
    if not isinstance(fmt_name, str) or fmt_name not in FORMAT_ALIASES:
        raise BadInput("bad_parameter", f"response_format must be one of {sorted(FORMAT_ALIASES)}")
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
        raise BadInput(exc.code, str(exc)) from exc
    except ConfigError as exc:
        raise BadInput("bad_request", str(exc)) from exc
    container = fmt_name if fmt_name in CONTAINERS else None
    if container:
        try:
            check_rate(container, fmt.sample_rate)
        except ValueError as exc:
            raise BadInput("bad_parameter", str(exc)) from exc
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
        raise BadInput("bad_request", "'stream' must be true or false")
    mode = body.get("stream_format")
    if mode is None:
        return "audio" if stream else None
    if mode not in STREAM_FORMATS:
        raise BadInput("bad_parameter", f"stream_format must be one of {list(STREAM_FORMATS)}")
    if "stream" in body and not stream:
        raise BadInput("bad_request", "'stream': false contradicts 'stream_format'")
    return mode


class _Collector:
    """The listener of an HTTP speech request's utterance: its audio into a queue, then None
    (done) or the failure (a BadInput with the utterance's error code)."""

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
        self.queue.put_nowait(BadInput(code, message))


async def _generate(services, job: dict, container: ContainerEncoder | None = None):
    """The request's utterance (the same runner as the WebSocket's: two segments in flight,
    audio in order); yields encoded audio as it is produced (through `container` when the
    response is FLAC, MP3 or Opus). Closing the generator (the client went away) aborts the
    running requests."""
    collector = _Collector()
    uid = f"http-{uuid.uuid4().hex[:12]}"
    loop = asyncio.get_running_loop()
    utt = Utterance(
        uid, job["reference"], job["params"], job["format"], True, job["engine"], loop,
        collector, uid, services.utterances,
    )  # fmt: skip
    utt.voice_id = job["voice_id"]
    utt.pick_engine = lambda: services.engines.pick(utt.voice_id)
    utt.report = report = UtteranceReport(
        services.metrics, "http", uid, services.settings.log_format, job["key"], job["lease"]
    )
    try:
        try:
            utt.add_segments(job["segments"])  # checked in _speech_job: refused only by a bug
        except ConfigError as exc:
            services.metrics.errors.labels("bad_request", "http").inc()
            report.stopped(utt, "error", "bad_request")
            raise BadInput("bad_request", str(exc)) from exc
        utt.pump()
        while (item := await collector.queue.get()) is not None:
            if isinstance(item, BadInput):
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
        job["lease"].release()
        report.stopped(utt, "disconnected")  # the client left (nothing if reported already)
