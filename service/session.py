"""One WebSocket connection speaking `clonecast.v1` (docs/protocol.md): reads client
messages (parsed and checked by service/protocol.py), opens utterances (service/utterance.py
runs them through the engine) and writes their audio with one sender task whose queue is
bounded per utterance (a slow reader ends its own utterance, not the server). A disconnect
cancels everything the connection started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from starlette.websockets import WebSocket

from clonecast_client.wire import pack_audio
from engine import FRAME_MS, ConfigError
from service.auth import OPEN, Caller
from service.key_limits import RateLimited
from service.protocol import (
    ProtocolError,
    as_object,
    check_transcript,
    decode_b64,
    parse_id,
    parse_inline_voice,
    parse_message,
    parse_params,
    parse_text,
    parse_upload,
    parse_voice_id,
)
from service.text_segments import SegmentBuffer, split_text
from service.utterance import SegmentStart, State, Utterance
from service.utterance_report import UtteranceReport

log = logging.getLogger("clonecast.session")
MAX_ENDED_IDS = 256  # per connection: remembered to refuse late appends after an end


class Session:
    def __init__(self, ws: WebSocket, services, caller: Caller = OPEN):
        self.ws = ws
        self.services = services
        self.caller = caller  # whose voices this connection sees and creates
        self.limits = services.settings.limits
        self.id = "s_" + uuid.uuid4().hex[:12]
        self.utterances: dict[str, Utterance] = {}
        self.buffers: dict[str, SegmentBuffer] = {}
        # ids of utterances that ended on this connection (the latest MAX_ENDED_IDS) and how
        # (done, cancelled, failed): a late `append` to one is refused rather than opening a
        # new utterance that would speak the tail of text the client barged in on, or text
        # after the end; a `speak` may reuse the id
        self.ended_ids: dict[str, str] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.pending_upload: dict | None = None
        self.tasks: set[asyncio.Task] = set()  # voice encodes running for this connection

    # -- outgoing ----------------------------------------------------------------------------

    def send_json(self, message: dict) -> None:
        self.outbox.put_nowait(("json", None, message, b"", 0))

    def send_error(self, code: str, message: str, uid: str | None = None, **extra) -> None:
        self.services.metrics.errors.labels(code, "websocket").inc()
        payload = {"type": "error", "code": code, "message": message, **extra}
        if uid is not None:
            payload["id"] = uid
        self.send_json(payload)

    def _queue_audio(self, utt: Utterance, data: bytes, last: bool, start_ms, end_ms) -> None:
        header = {
            "type": "audio",
            "id": utt.id,
            "seq": utt.seq,
            "bytes": len(data),
            "start_ms": start_ms,
            "end_ms": end_ms,
            "format": utt.format.format,
            "sample_rate": utt.format.sample_rate,
            "last": last,
        }
        audio_bytes = len(data) - utt.encoder.header_bytes  # a WAV header is not audio
        frame = pack_audio(utt.id, utt.seq, last, data)
        utt.seq += 1
        already_waiting = utt.buffered_bytes  # one chunk alone never counts as slow reading
        utt.buffered_bytes += len(frame)
        self.outbox.put_nowait(("audio", utt, header, frame, audio_bytes))
        if already_waiting > self.limits.max_buffered_audio_bytes:
            self._end(utt, State.FAILED, "slow_consumer")
            self.send_error(
                "slow_consumer",
                f"more than {self.limits.max_buffered_audio_bytes} "
                "bytes of audio waited for this client; the utterance was ended",
                utt.id,
            )

    async def sender(self) -> None:
        """The only writer of the socket: JSON, then each audio frame after its header."""
        while True:
            kind, utt, message, frame, audio_bytes = await self.outbox.get()
            if kind == "json":
                await self.ws.send_text(json.dumps(message))
                continue
            if kind == "segment":  # as its audio: never after a cancel or a failure
                if utt.state not in (State.CANCELLED, State.FAILED):
                    await self.ws.send_text(json.dumps(message))
                continue
            utt.buffered_bytes -= len(frame)
            if utt.state in (State.CANCELLED, State.FAILED):
                continue  # never send audio after a cancel acknowledgement or a failure
            await self.ws.send_text(json.dumps(message))
            await self.ws.send_bytes(frame)
            utt.report.audio_sent(utt, audio_bytes, message["bytes"])
            if message["last"]:
                self._send_done(utt)

    def _send_done(self, utt: Utterance) -> None:
        stats = utt.report.done(utt)
        self.send_json({"type": "done", "id": utt.id, "reason": utt.finish_reason, "stats": stats})

    # -- incoming ----------------------------------------------------------------------------

    async def on_text(self, text: str) -> None:
        if len(text.encode()) > self.limits.max_message_bytes:
            self.send_error(
                "message_too_large",
                f"text frames are limited to {self.limits.max_message_bytes} bytes",
            )
            return
        message: dict = {}
        try:
            message = parse_message(text)
            await getattr(self, "_on_" + message["type"].replace(".", "_"))(message)
        except ProtocolError as exc:
            # the message that caused it, even when refused before it was read (unknown_type)
            message = message or as_object(text)
            extra = {"request_id": message["request_id"]} if "request_id" in message else {}
            self.send_error(exc.code, str(exc), exc.uid, **extra, **exc.extra)
        except Exception:  # a bug: report it, keep the connection and its other utterances
            log.exception("handling %s failed", message.get("type"))
            self.send_error("internal", "the server failed to handle this message")

    async def on_bytes(self, data: bytes) -> None:
        upload, self.pending_upload = self.pending_upload, None
        if upload is None:
            self.send_error(
                "unexpected_binary", "binary frames are only accepted after voice.upload"
            )
            return
        if len(data) != upload["bytes"]:
            self.send_error(
                "bad_request",
                f"voice.upload announced {upload['bytes']} bytes, got {len(data)}",
                request_id=upload.get("request_id"),
            )
            return
        self._spawn(
            self._create_voice(
                data, upload.get("transcript"), upload.get("request_id"), upload.get("name")
            )
        )

    async def _on_ping(self, message: dict) -> None:
        pong = {"type": "pong", "t": time.time()}
        if "request_id" in message:  # a client matches its pongs (some pings may be refused)
            pong["request_id"] = message["request_id"]
        self.send_json(pong)

    async def _on_voice_create(self, message: dict) -> None:
        transcript = check_transcript(message.get("transcript"))
        data = decode_b64(message.get("audio_b64"), "audio_b64", self.limits.max_upload_bytes)
        self._spawn(
            self._create_voice(data, transcript, message.get("request_id"), message.get("name"))
        )

    async def _on_voice_upload(self, message: dict) -> None:
        parse_upload(message, self.limits.max_upload_bytes)
        self.pending_upload = message

    async def _create_voice(
        self, data: bytes, transcript: str | None, request_id, name=None
    ) -> None:
        try:
            voice, cached = await self.services.create_voice(
                data, transcript, name, owner=self.caller.owner
            )
        except ConfigError as exc:
            self.send_error(getattr(exc, "code", "bad_request"), str(exc), request_id=request_id)
            return
        except Exception:
            log.exception("voice creation failed")
            self.send_error(
                "internal", "the server failed to encode this voice", request_id=request_id
            )
            return
        self.send_json(
            {
                "type": "voice.created",
                **voice.describe(),
                "cached": cached,
                "request_id": request_id,
            }
        )

    async def _on_speak(self, message: dict) -> None:
        text = parse_text(message, self.limits.max_text_chars)
        utt = await self._open(message, flushed=True)
        self.ended_ids.pop(utt.id, None)  # a new utterance under an ended one's id
        utt.text_chars = len(text)
        self._add_checked(utt, split_text(text, self.limits.max_segment_chars))
        self.send_json({"type": "started", "id": utt.id, "segments": len(utt.segments)})
        await self._start_when_voiced(utt, message)

    async def _on_append(self, message: dict) -> None:
        uid = message.get("id")
        text = message.get("text")
        if not isinstance(text, str):
            raise ProtocolError("bad_request", "append needs 'text' (a string)", uid)
        utt = self.utterances.get(uid) if isinstance(uid, str) else None
        if utt is None and uid in self.ended_ids:
            raise ProtocolError(
                "unknown_id",
                f"utterance {uid!r} has ended ({self.ended_ids[uid]}): open a new one (another id)",
            )
        if utt is None:
            utt = await self._open(message, flushed=False)
            self.buffers[utt.id] = SegmentBuffer(self.limits.max_segment_chars)
            self.send_json({"type": "started", "id": utt.id, "segments": 0})
            first = True
        else:
            if utt.flushed:  # no id: the error does not end the running utterance
                raise ProtocolError("unknown_id", f"utterance {uid!r} was flushed: open a new one")
            first = False
        utt.text_chars += len(text)
        if utt.text_chars > self.limits.max_text_chars:
            self._end(utt, State.FAILED, "text_too_long")
            raise ProtocolError(
                "text_too_long",
                f"an utterance is limited to {self.limits.max_text_chars} characters",
                uid,
            )
        self._add_checked(utt, self.buffers[utt.id].append(text))
        if first:
            await self._start_when_voiced(utt, message)
        else:
            utt.pump()

    async def _on_flush(self, message: dict) -> None:
        uid = message.get("id")
        utt = self.utterances.get(uid) if isinstance(uid, str) else None
        if utt is not None and utt.flushed:  # no id: the running utterance goes on
            raise ProtocolError("unknown_id", f"utterance {uid!r} was flushed already")
        if utt is None:
            raise ProtocolError(
                "unknown_id",
                f"no open utterance {uid!r} to flush",
                uid if isinstance(uid, str) else None,
            )
        self._add_checked(utt, self.buffers.pop(utt.id).flush())
        utt.flushed = True
        if not utt.segments:
            self._end(utt, State.FAILED, "empty_text")
            raise ProtocolError("empty_text", "nothing to speak: the utterance has no words", uid)
        self.send_json({"type": "flushed", "id": uid})
        utt.pump()

    async def _on_cancel(self, message: dict) -> None:
        uid = message.get("id")
        utt = self.utterances.get(uid) if isinstance(uid, str) else None
        if utt is None:
            raise ProtocolError(
                "unknown_id",
                f"no running utterance {uid!r} to cancel",
                uid if isinstance(uid, str) else None,
            )
        self._end(utt, State.CANCELLED)
        self.send_json({"type": "cancelled", "id": uid})

    # -- utterances --------------------------------------------------------------------------

    def _add_checked(self, utt: Utterance, segments: list[str]) -> None:
        """Queues complete segments after the engine's text check."""
        self._checked(utt, utt.add_segments, segments)

    def _checked(self, utt: Utterance, check, texts: list[str]) -> None:
        """`check(texts)`; a text the engine refuses ends the utterance with `bad_request`,
        and any other failure ends it too before it propagates (never left running)."""
        try:
            check(texts)
        except ConfigError as exc:
            self._end(utt, State.FAILED, "bad_request")
            raise ProtocolError("bad_request", str(exc), utt.id) from exc
        except BaseException:
            self._end(utt, State.FAILED)
            raise

    async def _open(self, message: dict, flushed: bool) -> Utterance:
        uid = parse_id(message)
        if uid in self.utterances:  # no id: the running one goes on
            raise ProtocolError("duplicate_id", f"utterance {uid!r} is already running")
        if len(self.utterances) >= self.limits.max_utterances:
            raise ProtocolError(
                "too_many_utterances",
                f"at most {self.limits.max_utterances} utterances may run at once",
                uid,
            )
        if (refusal := self.services.refusal()) is not None:  # draining, engine restarting
            raise ProtocolError(*refusal, uid)
        if self.services.engines.num_waiting >= self.limits.max_waiting_requests:
            raise ProtocolError("over_capacity", "the server is at capacity: retry shortly", uid)
        params, fmt = parse_params(
            message.get("params"), message.get("output"), uid, self.services.default_max_s
        )
        voice = None
        voice_id = parse_voice_id(message, uid)
        if voice_id is not None:
            found = self.services.voices.get(voice_id, self.caller)
            if found is None:
                raise ProtocolError("unknown_voice", f"no voice {voice_id!r}: create it first", uid)
            voice = found.reference
        try:  # every end releases it (_forget)
            lease = self.services.key_limits.admit(self.caller.name)
        except RateLimited as exc:
            raise ProtocolError(
                "rate_limited", str(exc), uid, retry_after_s=exc.retry_after_s
            ) from exc
        # an inline voice's engine is chosen once the voice is known (_voice_then_start)
        inline = voice_id is None and message.get("voice") is not None
        engine = self.services.worker if inline else self.services.engines.pick(voice_id)
        if engine is None:  # every engine died since the refusal check: nothing below refuses
            lease.release()
            raise ProtocolError("not_ready", "no engine is ready: retry shortly", uid)
        tag, registry = f"{self.id}/{uid}", self.services.utterances
        utt = Utterance(uid, voice, params, fmt, flushed, engine, self.loop, self, tag, registry)
        utt.voice_id = voice_id
        utt.pick_engine = lambda: self.services.engines.pick(utt.voice_id)
        log_format = self.services.settings.log_format
        utt.report = UtteranceReport(
            self.services.metrics, "websocket", utt.tag, log_format, self.caller.name, lease
        )
        self.utterances[uid] = utt
        return utt

    async def _start_when_voiced(self, utt: Utterance, message: dict) -> None:
        try:
            inline = parse_inline_voice(message, self.limits.max_upload_bytes, utt.id)
        except ProtocolError as exc:
            self._end(utt, State.FAILED, exc.code)
            raise
        if inline is None:
            utt.pump()
            return
        # Encoding takes a while: the connection keeps reading (a cancel must get through).
        utt.ready = False
        self._spawn(self._voice_then_start(utt, *inline, message.get("request_id")))

    async def _voice_then_start(
        self, utt: Utterance, data: bytes, transcript, request_id=None
    ) -> None:
        try:
            voice, _ = await self.services.create_voice(
                data, transcript, keep=False, owner=self.caller.owner
            )
        except Exception as exc:
            if not isinstance(exc, ConfigError):
                log.exception("inline voice encoding failed")
            if utt.state is State.RUNNING:
                code = (
                    getattr(exc, "code", "bad_request")
                    if isinstance(exc, ConfigError)
                    else "internal"
                )
                self._end(utt, State.FAILED, code)
                extra = {"request_id": request_id} if request_id is not None else {}
                self.send_error(
                    code,
                    str(exc) if isinstance(exc, ConfigError) else "voice encoding failed",
                    utt.id,
                    **extra,
                )
            return
        if utt.state is not State.RUNNING:
            return  # cancelled while the voice was encoding
        # nothing was submitted yet: the engine that holds this voice's prefix, if any
        engine = self.services.engines.pick(voice.voice_id)
        if engine is None:
            self._end(utt, State.FAILED, "not_ready")
            self.send_error("not_ready", "no engine is ready: retry shortly", utt.id)
            return
        utt.voice, utt.voice_id, utt.ready = voice.reference, voice.voice_id, True
        utt.engine = engine
        try:  # the segments so far were checked without the voice (prompt length with it)
            self._checked(utt, utt.check_texts, [seg.text for seg in utt.segments])
        except ProtocolError as exc:
            self.send_error(exc.code, str(exc), exc.uid)
            return
        utt.pump()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- the utterances' listener (service/utterance.py) ------------------------------------

    def on_segment(self, utt: Utterance, start: SegmentStart) -> None:
        message = {
            "type": "segment",
            "id": utt.id,
            "index": start.index,
            "text": start.text,
            "start_ms": start.start_frame * FRAME_MS,
        }
        self.outbox.put_nowait(("segment", utt, message, b"", 0))

    def on_audio(self, utt: Utterance, data: bytes, start_frame: int, end_frame: int) -> None:
        self._queue_audio(utt, data, False, start_frame * FRAME_MS, end_frame * FRAME_MS)

    def on_done(self, utt: Utterance, tail: bytes) -> None:
        self._queue_audio(utt, tail, True, None, None)
        self._forget(utt)

    def on_failed(self, utt: Utterance, code: str, message: str) -> None:
        utt.report.stopped(utt, "error", code)
        self._forget(utt)
        self.send_error(code, message, utt.id)

    def _end(
        self, utt: Utterance, state: State, code: str | None = None, outcome: str | None = None
    ) -> None:
        """Cancels or fails (with the error's `code`) an utterance: aborts its engine
        requests, sends nothing more. `outcome`: what its report says, if not "error" or
        "cancelled" by its state."""
        utt.end(state)
        outcome = outcome or ("error" if state is State.FAILED else "cancelled")
        utt.report.stopped(utt, outcome, code)
        self._forget(utt)

    def _forget(self, utt: Utterance) -> None:
        if self.utterances.get(utt.id) is not utt:
            return  # already forgotten (a failure reported after its end)
        del self.utterances[utt.id]
        utt.report.lease.release()  # no longer generating: its key may run another
        self.buffers.pop(utt.id, None)
        self.ended_ids.pop(utt.id, None)  # the latest end goes last
        self.ended_ids[utt.id] = utt.state.value
        if len(self.ended_ids) > MAX_ENDED_IDS:
            del self.ended_ids[next(iter(self.ended_ids))]

    def close(self) -> None:
        """The client is gone: abort everything it started."""
        for task in list(self.tasks):
            task.cancel()
        for utt in list(self.utterances.values()):
            self._end(utt, State.CANCELLED, outcome="disconnected")
