"""The Starlette application: starts the engines (service/engines.py: one per device, each in
its own process by default) while the port is already bound, warms them up before `/ready`,
and serves the WebSocket protocol and the HTTP API; a dead engine is started again by its
supervisor (service/engine_supervisor.py), a SIGTERM drains (service/drain.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route, WebSocketRoute

from engine import (
    NUM_CODEBOOKS,
    UNTRAINED_NOTICE,
    ConfigError,
    Engine,
    EngineConfig,
    VoiceReference,
    default_device,
)
from service import VERSION
from service.api_keys import KeyRing, read_key_file
from service.auth import Caller
from service.config import ServiceSettings
from service.engine_client import EngineClient, EngineExited
from service.engine_host import EngineSpec, settle_garbage_collector
from service.engines import Engines
from service.http_api import (
    api_page,
    health,
    http_error,
    list_models,
    list_voices,
    metrics,
    openapi,
    ready,
    token_create,
    voice_create,
    voice_delete,
    voice_get,
)
from service.key_limits import KeyLimits
from service.logs import redact_secrets
from service.metrics import Metrics
from service.origin_check import OriginCheck
from service.speech_api import speech
from service.tokens import TokenIssuer
from service.transport_guards import guarded_protocols
from service.voice_db import open_voice_database
from service.voices import Voice, VoiceError, VoiceStore, check_name, voice_id_for
from service.web_files import WEB_DIR, WebMount
from service.ws import stream_endpoint

log = logging.getLogger("clonecast.app")
UNTRAINED_DEFAULT_MAX_S = 4.0  # see Services.default_max_s


class Services:
    """Everything the handlers share: settings, the engine (through its client), voices,
    metrics. The handlers reach the engines only through `engines` (service/engines.py: an
    `EngineClient` per engine, to an engine process by default, to a thread of this process
    when an engine object is given or `settings.engine_process` is off): `engines.pick(voice)`
    for an utterance, `worker` for what any engine answers alike."""

    def __init__(self, settings: ServiceSettings, engine: Engine | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.voices = VoiceStore(settings.limits.max_voices)  # with its database at start()
        secret = settings.token_secret.encode() if settings.token_secret else None
        self.tokens = TokenIssuer(secret)
        self.keys = _key_ring(settings)  # names and SHA-256 digests only (service/api_keys.py)
        limits = settings.limits
        self.key_limits = KeyLimits(
            limits.max_utterances_per_key,
            limits.max_audio_s_per_minute_per_key,
            on_refused=self.metrics.key_refused,
        )
        self.engines = Engines(
            self, _devices(settings), self._engine_config, self._engine_spec, engine
        )
        self.loaded = False  # was ready once (voices and models answer from then on)
        self._progress = "starting"  # what loading is doing (/ready while not ready)
        # why the server cannot serve: loading failed or the engine kept failing (it exits)
        self.load_error: str | None = None
        self.on_load_failed = None  # called once, with load_error set (the CLI stops the server)
        self.stopping = False
        self.draining = False  # shutting down: running utterances finish, new ones are refused
        self.loop: asyncio.AbstractEventLoop | None = None
        self.utterances: set = set()  # running, of every transport (a drain waits for them)
        self.sessions: set = set()  # open WebSocket sessions
        self.connections = 0
        self.started = int(time.time())  # when this server started (GET /v1/models)

    def start(self) -> None:
        if self.settings.voice_store is not None:  # ConfigError: one line naming it
            db = open_voice_database(self.settings.voice_store)
            self.voices = VoiceStore(self.settings.limits.max_voices, db)
        self.engines.start_all()
        self.metrics.set_build(VERSION, self.worker.info, self.model_info()["name"])

    @property
    def worker(self) -> EngineClient | None:
        """An engine's client for what every engine answers alike (text checks, model)."""
        return self.engines.primary

    @property
    def engine(self) -> Engine | None:
        """The first engine's object when it runs in a thread of this process."""
        return self.engines.slots[0].engine

    @property
    def is_ready(self) -> bool:
        """Serving: loaded, not draining, and at least one engine ready."""
        return (
            self.loaded
            and not self.draining
            and self.load_error is None
            and self.engines.num_ready > 0
        )

    @property
    def progress(self) -> str:
        """What the server is doing, for /ready and /health while it is not ready. Between an
        engine's death and its supervisor's first word (the client notices within
        engine_client.EXIT_POLL_S of the engine's last events) the last word is still "ready"."""
        stale = self._progress == "ready" and self.loaded and self.load_error is None
        if stale and not self.draining and not self.is_ready:
            if self.engines.restarts_enabled:
                return "restarting the engine (it has just exited)"
            return "the engine has just exited; restarts are off (CLONECAST_ENGINE_RESTARTS=0)"
        return self._progress

    @progress.setter
    def progress(self, text: str) -> None:
        self._progress = text

    def give_up(self, reason: str) -> None:
        """The server cannot serve any more: say why once and stop (the CLI exits 1)."""
        self.load_error = reason
        log.error("clonecast cannot serve: %s", reason)
        if self.on_load_failed is not None:
            self.on_load_failed()

    def refusal(self, engine: bool = True) -> tuple[str, str] | None:
        """(code, message) when a request cannot be taken now, else None. `engine`: it needs
        the engine now (an utterance, a voice to encode): refused also while the engine
        restarts or the server drains; else only before the server was first ready."""
        if not self.loaded:
            if self.load_error is not None:
                return "not_ready", f"the server could not start: {self.load_error}"
            return "not_ready", f"the server is starting: {self.progress}"
        if not engine:
            return None
        if self.draining:
            return "draining", "the server is shutting down: connect again (to another server)"
        if self.load_error is not None:
            return "not_ready", f"the server cannot serve: {self.load_error}"
        if not self.is_ready:
            if not self.engines.restarts_enabled:
                return (
                    "not_ready",
                    "the engine has stopped and restarts are off: restart the server",
                )
            return "not_ready", "the engine is restarting: retry shortly"
        return None

    def _engine_spec(self, device: str) -> EngineSpec:
        return EngineSpec(
            self.settings.model,
            self._engine_config(device),
            self.settings.codec,
            self.settings.cache_dir,
            self.settings.gil_switch_ms,
            logging.getLogger("clonecast").getEffectiveLevel(),
            self.settings.profile,
        )

    def _engine_config(self, device: str) -> EngineConfig:
        backend = self.settings.attention_backend
        return EngineConfig(
            device=device,
            max_num_seqs=self.settings.max_num_seqs,
            max_num_batched_tokens=self.settings.max_batched_tokens
            or max(512, self.settings.max_num_seqs),
            enforce_eager=not self.settings.cuda_graphs,
            kv_cache_dtype=self.settings.kv_cache_dtype,
            quantization=self.settings.quantization,
            enable_prefix_caching=self.settings.prefix_caching,
            row_events=False,  # sessions stream audio chunks and finishes only
            plan_overrides=(
                self.settings.plan | ({} if backend == "auto" else {"attention_backend": backend})
            ),
        )

    async def load(self) -> None:
        """Everything before /ready: the engines (from a worker thread), the preloaded voices,
        one warm-up request. A failure is kept in `load_error` and reported once."""
        self.loop = asyncio.get_running_loop()
        try:
            self.progress = "loading the model and capturing graphs"
            await asyncio.get_running_loop().run_in_executor(None, self.start)
            if self.stopping:
                return
            self.progress = "registering the preloaded voices"
            await self.preload_voices()
            self.progress = "warming up"
            await self.engines.warm_up_all()
            self._settle()
            self.loaded, self.progress = True, "ready"
            log.info("clonecast ready: %s", self.model_info()["name"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.load_error = str(exc) if isinstance(exc, ConfigError) else repr(exc)
            if not isinstance(exc, ConfigError):
                log.exception("loading failed")
            log.error("clonecast could not start: %s", self.load_error)
            self.stop()
            if self.on_load_failed is not None:
                self.on_load_failed()

    def _settle(self) -> None:
        settle_garbage_collector()
        # The event loop shares the interpreter lock with this process's other threads (the
        # engines' events readers, or an engine thread itself when it runs in-process): with
        # Python's 5 ms switch interval every socket operation could wait up to 5 ms behind
        # them (a convoy that delays requests and audio).
        sys.setswitchinterval(self.settings.gil_switch_ms / 1000)

    async def create_voice(
        self,
        data: bytes,
        transcript: str | None,
        name: str | None = None,
        keep: bool = True,
        owner: str | None = None,
    ) -> tuple[Voice, bool]:
        """Registers a voice from reference audio bytes; (voice, was already registered).
        `keep`: created on purpose, kept (persisted) until deleted; False for an inline voice
        (service/voices.py). A transcript the prompt cannot hold (structural tokens, or too
        long for the model with even one frame of audio) is refused before any encoding: the
        voice would be unusable."""
        name = check_name(name)
        if transcript:
            one_frame = VoiceReference(codes=((0,) * NUM_CODEBOOKS,), text=transcript)
            self.worker.check_text(".", one_frame)  # ConfigError: bad_request
        voice_id = voice_id_for(data, transcript, owner)
        existing = self.voices.get(voice_id, Caller(owner))
        if existing is not None:
            if (name and existing.name != name) or (keep and not existing.kept):
                existing = self.voices.put(voice_id, existing.reference, name, keep, owner)
            return existing, True
        encoder = self.engines.least_loaded() or self.worker
        try:
            reference = await asyncio.wrap_future(encoder.encode_reference(data, transcript))
        except EngineExited as exc:  # its engine died meanwhile: another will serve a retry
            raise VoiceError("not_ready", f"the engine stopped while encoding: {exc}") from exc
        return self.voices.put(voice_id, reference, name, keep, owner), False

    async def preload_voices(self) -> None:
        """CLONECAST_VOICES_DIR: NAME.wav (.flac, .ogg, .mp3) with NAME.txt, registered under
        NAME before /ready; an unusable file stops the start, naming it."""
        folder = self.settings.voices_dir
        if folder is None:
            return
        if not folder.is_dir():
            raise ConfigError(f"CLONECAST_VOICES_DIR {str(folder)!r} is not a directory")
        for path in sorted(folder.iterdir()):
            if path.suffix.lower() not in (".wav", ".flac", ".ogg", ".mp3"):
                continue
            text_file = path.with_suffix(".txt")
            transcript = text_file.read_text().strip() if text_file.exists() else None
            try:
                await self.create_voice(path.read_bytes(), transcript or None, path.stem)
            except ConfigError as exc:
                raise ConfigError(f"voice {path.name} in CLONECAST_VOICES_DIR: {exc}") from exc

    @property
    def default_max_s(self) -> float | None:
        """The length cap of a request that sets none: the untrained embedded model never
        chooses to stop, so without this every short text would run to the 81.6 s cap."""
        return UNTRAINED_DEFAULT_MAX_S if self.worker.info.is_default_model else None

    def model_info(self) -> dict:
        info = self.worker.info
        untrained = info.is_default_model
        return {
            # what OpenAI-style clients pass as `model` (GET /v1/models lists it)
            "id": "clonecast-default" if untrained else Path(info.checkpoint).name,
            "name": "embedded-default (untrained)" if untrained else info.checkpoint,
            "untrained": untrained,
            "notice": UNTRAINED_NOTICE if untrained else None,
            "default_max_duration_s": UNTRAINED_DEFAULT_MAX_S if untrained else None,
        }

    def stop(self) -> None:
        self.engines.stop()
        if self.voices.db is not None:
            self.voices.db.close()


def _key_ring(settings: ServiceSettings) -> KeyRing:
    """The keys given in plaintext and those of the key file; a bad file stops the start in
    one line naming it."""
    try:
        listed = read_key_file(settings.api_key_file) if settings.api_key_file else ()
        return KeyRing.of(settings.api_keys, settings.admin_keys, listed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _devices(settings: ServiceSettings) -> list[str]:
    """One engine per device of CLONECAST_DEVICES, else CLONECAST_ENGINES on one device."""
    if settings.devices:
        return list(settings.devices)
    return [settings.device or default_device()] * settings.engines


def create_app(settings: ServiceSettings | None = None, engine: Engine | None = None) -> Starlette:
    settings = settings or ServiceSettings.from_env()
    redact_secrets()  # no key or token in any log record of this process
    services = Services(settings, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # The port is bound while the model loads: /health answers 200 (loading) and /ready
        # 503 with what is being done, instead of refused connections.
        loading = asyncio.create_task(services.load())
        try:
            yield
        finally:  # also while loading: no engine process left behind
            services.stopping = True
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loading
            await services.engines.stop_supervisors()
            services.stop()

    routes = [
        WebSocketRoute("/v1/stream", stream_endpoint),
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/docs", api_page, methods=["GET"]),
        Route("/v1/tokens", token_create, methods=["POST"]),
        Route("/v1/voices", voice_create, methods=["POST"]),
        Route("/v1/voices", list_voices, methods=["GET"]),
        Route("/v1/voices/{voice_id}", voice_get, methods=["GET"]),
        Route("/v1/voices/{voice_id}", voice_delete, methods=["DELETE"]),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
    ]
    if WEB_DIR.is_dir():  # the JavaScript SDK and the demo page, below every API route
        routes.append(WebMount())
    middleware = []
    if settings.allowed_origins:
        middleware.append(Middleware(OriginCheck, allowed_origins=settings.allowed_origins))
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.allowed_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["*"],
            )
        )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.services = services
    return app


def uvicorn_options(settings: ServiceSettings) -> dict:
    """How the server runs under uvicorn (the CLI, the benchmarks and the tests use this).
    WebSocket compression is off: PCM and mu-law barely compress, and deflating every audio
    frame cost the server's event loop about half a second per request at 256 streams
    (docs/perf-log/). The protocols are uvicorn's with the guards of
    service/transport_guards.py (a deadline for request heads, a rate for ping frames)."""
    return {
        **guarded_protocols(settings.limits),
        "host": settings.host,
        "port": settings.port,
        "ws_max_size": 2 * settings.limits.max_message_bytes,
        "ws_per_message_deflate": False,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
    }
