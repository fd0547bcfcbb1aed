"""Service settings: defaults in one place, and the only module that reads environment
variables (all named CLONECAST_*).

| variable | meaning |
|---|---|
| CLONECAST_MODEL | checkpoint dir or hub id (unset: the embedded default model) |
| CLONECAST_CODEC | standalone Higgs audio tokenizer dir (unset: the checkpoint's bundled codec) |
| CLONECAST_DEVICE | cpu / cuda (unset: cuda when available) |
| CLONECAST_DEVICES | comma-separated devices, one engine on each (`cuda:0,cuda:1`): the |
|  | server routes utterances between them (unset: one engine on CLONECAST_DEVICE) |
| CLONECAST_ENGINES | engines on CLONECAST_DEVICE when CLONECAST_DEVICES is unset (1; several |
|  | on the CPU, or to share one large GPU) |
| CLONECAST_AFFINITY_SLACK | an utterance goes to the engine that served its voice last (its |
|  | prompt prefix is cached there) unless it runs this many more requests than the least |
|  | loaded (4) |
| CLONECAST_VOICE_AFFINITY | 1 (default): route by voice as above; 0: always the least loaded |
|  | engine (a measure of what affinity brings) |
| CLONECAST_CACHE_DIR | where the default model is written (unset: ~/.cache/clonecast) |
| CLONECAST_HOST, CLONECAST_PORT | bind address (127.0.0.1, 8737) |
| CLONECAST_API_KEYS | comma-separated keys; unset: no authentication. Each key sees only |
|  | its own voices (and the preloaded ones) |
| CLONECAST_ADMIN_KEYS | comma-separated keys that may also see and delete every voice |
| CLONECAST_API_KEY_FILE | a file of `NAME SHA256HEX [admin]` lines: keys by name and hash, |
|  | no plaintext at rest (`clonecast key new NAME` makes a line); with the keys above |
| CLONECAST_MAX_UTTERANCES_PER_KEY | utterances one key runs at once, over every connection |
|  | and HTTP (0, the default: no per-key cap); over it: 429 / `rate_limited` |
| CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY | audio seconds one key may have made in the last |
|  | 60 s before its next utterance is refused (0, the default: no cap) |
| CLONECAST_TOKEN_SECRET | signs browser tokens (POST /v1/tokens); share it between servers |
|  | behind one balancer; unset: random per start |
| CLONECAST_ALLOWED_ORIGINS | comma-separated browser origins; unset: any |
| CLONECAST_MAX_CONNECTIONS, CLONECAST_MAX_NUM_SEQS | capacity |
| CLONECAST_MAX_BATCHED_TOKENS | token positions one engine step may run, decodes and prompt |
|  | chunks together (0, the default: max(512, CLONECAST_MAX_NUM_SEQS)); more admits more new |
|  | prompts a step beside many decodes, each such step taking longer |
| CLONECAST_MAX_MESSAGES_PER_S, CLONECAST_MESSAGE_BURST | per WebSocket connection: messages |
|  | (and ping frames) a second sustained (50), and at once (100); over it: `rate_limited` |
| CLONECAST_HEADER_TIMEOUT_S | an HTTP request's head must arrive within this (10 s) |
| CLONECAST_BODY_TIMEOUT_S | and its body within this of the head (60 s); else 408 |
| CLONECAST_EAGER | 1: no CUDA graphs (debugging, comparison; the codec is then fp32, untimed) |
| CLONECAST_ATTENTION_BACKEND | auto (Triton on CUDA, else torch), or a FlashAttention backend |
| CLONECAST_KV_CACHE_DTYPE | auto (the model's dtype) or fp8: a float8 KV cache, twice the |
|  | blocks and half the attention reads, lossy (EngineConfig.kv_cache_dtype) |
| CLONECAST_QUANTIZATION | none (default) or fp8: the decoder's projection weights in float8, |
|  | about half the bytes a step reads, lossy (EngineConfig.quantization) |
| CLONECAST_PREFIX_CACHING | 1 (default): prompts reuse the KV blocks of an earlier prompt's |
|  | prefix (a voice used again); 0: every prompt computed in full (a worst-case measure) |
| CLONECAST_PLAN | a JSON object of execution-plan overrides (engine/plan.py's fields), e.g. |
|  | `{"graph_buckets": [1, 2, 4, 8]}`: how the engine runs, never what it computes |
| CLONECAST_VOICE_STORE | where registered voices persist: a SQLite file (unset: voices.sqlite3 |
|  | in the cache dir, ~/.cache/clonecast), or a `postgresql://USER:PASSWORD@HOST/DB` URL that |
|  | several servers share (a voice created through one is usable through all); `memory`: |
|  | none, lost at exit |
| CLONECAST_VOICES_DIR | voices to register at start: NAME.wav (or .flac, .ogg, .mp3) with |
|  | NAME.txt beside it for its transcript; each usable as `NAME` |
| CLONECAST_GIL_SWITCH_MS | thread switch interval once ready, ms (0.5; Python's own: 5) |
| CLONECAST_LOG_FORMAT | plain (default) or json: the one line logged per ended utterance |
| CLONECAST_ENGINE_PROCESS | 1 (default): the engine in its own process; 0: a server thread |
| CLONECAST_ENGINE_RESTARTS | restarts of a dead engine in a row before the server gives up and |
|  | exits 1 (5; 0: never restart); waits 1, 2, 4... s (at most 30) before each |
| CLONECAST_DRAIN_TIMEOUT_S | on SIGTERM / SIGINT, how long running utterances may take to finish |
|  | before they are cancelled and the server exits (30) |
| CLONECAST_PROFILE | `SKIP,STEPS,FILE[,MODE[,MIN_RUNNING]]`: the engine process profiles |
|  | STEPS steps after SKIP with MIN_RUNNING (1) requests running (MODE torch: operators, |
|  | kernels; python: functions, threads) |
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_PORT = 8737


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 8 * 1024 * 1024  # one JSON text frame (base64 audio inside)
    max_upload_bytes: int = 10 * 1024 * 1024  # one reference recording
    max_text_chars: int = 5000  # one utterance, all appends together
    max_utterances: int = 8  # running at once on one connection
    max_connections: int = 256
    max_waiting_requests: int = 1024  # engine queue depth before over_capacity
    idle_timeout_s: float = 60.0
    max_buffered_audio_bytes: int = 4 * 1024 * 1024  # unsent audio per utterance
    max_voices: int = 1000
    max_segment_chars: int = 300
    # per API key (service/key_limits.py; 0: off, the default: what is fair depends on the
    # tenants and the GPU, and the server-wide limits already protect the server)
    max_utterances_per_key: int = 0
    max_audio_s_per_minute_per_key: float = 0.0
    # per WebSocket connection, a token bucket: `max_messages_per_s` sustained, bursts of
    # `message_burst` (messages and ping frames, each counted on its own)
    max_messages_per_s: float = 50.0
    message_burst: int = 100
    header_timeout_s: float = 10.0  # an HTTP request's head, from its connection or last answer
    body_timeout_s: float = 60.0  # its body, from the head (10 MB at 1.4 Mbit/s)

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "max_upload_bytes",
            "max_text_chars",
            "max_utterances",
            "max_connections",
            "max_buffered_audio_bytes",
            "max_voices",
            "message_burst",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("idle_timeout_s", "max_messages_per_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:  # also NaN
                raise ValueError(f"{name} must be > 0")
        for name in ("max_utterances_per_key", "max_audio_s_per_minute_per_key"):
            if not getattr(self, name) >= 0:  # also NaN
                raise ValueError(f"{name} must be >= 0 (0: no per-key limit)")


@dataclass(frozen=True)
class ServiceSettings:
    model: str | None = None
    codec: str | None = None
    device: str | None = None
    devices: tuple[str, ...] = ()  # one engine per device (service/engines.py)
    engines: int = 1  # engines on `device` when `devices` is empty
    affinity_slack: int = 4  # service/engine_router.py RoutingPolicy
    voice_affinity: bool = True
    cache_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in a log
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: Path | None = None  # NAME SHA256HEX [admin] lines (service/api_keys.py)
    token_secret: str | None = field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    max_num_seqs: int = 64
    max_batched_tokens: int = 0  # EngineConfig.max_num_batched_tokens; 0: max(512, max_num_seqs)
    cuda_graphs: bool = True
    attention_backend: str = "auto"  # the execution plan's (auto: Triton on CUDA, else torch)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype (fp8: float8 e4m3, lossy)
    quantization: str = "none"  # EngineConfig.quantization (fp8 weights: opt-in, lossy)
    prefix_caching: bool = True  # EngineConfig.enable_prefix_caching
    plan: dict = field(default_factory=dict)  # ExecutionPlan overrides (checked by the engine)
    # registered voices: a SQLite file, a postgresql:// URL (str; its password: never in a log)
    # or None: memory only
    voice_store: Path | str | None = field(default=None, repr=False)
    voices_dir: Path | None = None  # voices registered at start (NAME.wav + NAME.txt)
    gil_switch_ms: float = 0.5
    log_format: str = "plain"  # of the per-utterance log line: plain or json
    # The engine in a process of its own (service/engine_client.py): the server's event
    # loop then never holds the interpreter lock the engine's step needs (on the H200 a
    # second thread holding it 30% of the time made the batch-64 step 6% slower).
    engine_process: bool = True
    engine_restarts: int = 5  # RestartPolicy.max_attempts (service/engine_supervisor.py)
    drain_timeout_s: float = 30.0  # service/drain.py
    # (skip, steps, file, mode, min_running): the engine process profiles `steps` steps
    # after `skip` with at least `min_running` requests running
    # (mode torch: torch.profiler; python: cProfile and per-thread CPU time) and writes its
    # tables to `file` (diagnosing the served step on a GPU)
    profile: tuple[int, int, str, str, int] | None = None
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("CLONECAST_ENGINES must be >= 1")
        if self.devices and self.engines != 1 and self.engines != len(self.devices):
            raise ValueError(
                "give CLONECAST_DEVICES (one engine each) or CLONECAST_ENGINES, not both"
            )
        if self.affinity_slack < 0:
            raise ValueError("CLONECAST_AFFINITY_SLACK must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> ServiceSettings:
        """From `env` (default: the process environment); `overrides` that are not None win."""
        env = os.environ if env is None else env
        base = cls(
            model=env.get("CLONECAST_MODEL") or None,
            codec=env.get("CLONECAST_CODEC") or None,
            device=env.get("CLONECAST_DEVICE") or None,
            devices=_split(env.get("CLONECAST_DEVICES")),
            engines=_count("CLONECAST_ENGINES", env.get("CLONECAST_ENGINES", "1")),
            affinity_slack=_count(
                "CLONECAST_AFFINITY_SLACK", env.get("CLONECAST_AFFINITY_SLACK", "4")
            ),
            voice_affinity=env.get("CLONECAST_VOICE_AFFINITY", "1") not in ("0", "false", "no"),
            cache_dir=Path(env["CLONECAST_CACHE_DIR"]) if env.get("CLONECAST_CACHE_DIR") else None,
            host=env.get("CLONECAST_HOST", "127.0.0.1"),
            port=int(env.get("CLONECAST_PORT", DEFAULT_PORT)),
            api_keys=_split(env.get("CLONECAST_API_KEYS")),
            admin_keys=_split(env.get("CLONECAST_ADMIN_KEYS")),
            api_key_file=Path(env["CLONECAST_API_KEY_FILE"])
            if env.get("CLONECAST_API_KEY_FILE")
            else None,
            token_secret=env.get("CLONECAST_TOKEN_SECRET") or None,
            allowed_origins=_split(env.get("CLONECAST_ALLOWED_ORIGINS")),
            max_num_seqs=int(env.get("CLONECAST_MAX_NUM_SEQS", 64)),
            max_batched_tokens=_count(
                "CLONECAST_MAX_BATCHED_TOKENS", env.get("CLONECAST_MAX_BATCHED_TOKENS", "0")
            ),
            cuda_graphs=env.get("CLONECAST_EAGER", "0") not in ("1", "true", "yes"),
            attention_backend=env.get("CLONECAST_ATTENTION_BACKEND", "auto"),
            kv_cache_dtype=env.get("CLONECAST_KV_CACHE_DTYPE", "auto"),
            quantization=env.get("CLONECAST_QUANTIZATION", "none"),
            prefix_caching=env.get("CLONECAST_PREFIX_CACHING", "1") not in ("0", "false", "no"),
            plan=_plan(env.get("CLONECAST_PLAN")),
            voice_store=_voice_store(env),
            voices_dir=Path(env["CLONECAST_VOICES_DIR"])
            if env.get("CLONECAST_VOICES_DIR")
            else None,
            gil_switch_ms=_positive_ms(env.get("CLONECAST_GIL_SWITCH_MS", "0.5")),
            log_format=_log_format(env.get("CLONECAST_LOG_FORMAT", "plain")),
            engine_process=env.get("CLONECAST_ENGINE_PROCESS", "1") not in ("0", "false", "no"),
            engine_restarts=_count(
                "CLONECAST_ENGINE_RESTARTS", env.get("CLONECAST_ENGINE_RESTARTS", "5")
            ),
            drain_timeout_s=_seconds(
                "CLONECAST_DRAIN_TIMEOUT_S", env.get("CLONECAST_DRAIN_TIMEOUT_S", "30")
            ),
            profile=_profile(env.get("CLONECAST_PROFILE")),
            limits=_limits(env),
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


# Every variable this module reads (and the names a --config file may set).
VARIABLES = (
    "CLONECAST_MODEL",
    "CLONECAST_CODEC",
    "CLONECAST_DEVICE",
    "CLONECAST_DEVICES",
    "CLONECAST_ENGINES",
    "CLONECAST_AFFINITY_SLACK",
    "CLONECAST_VOICE_AFFINITY",
    "CLONECAST_CACHE_DIR",
    "CLONECAST_HOST",
    "CLONECAST_PORT",
    "CLONECAST_API_KEYS",
    "CLONECAST_ADMIN_KEYS",
    "CLONECAST_API_KEY_FILE",
    "CLONECAST_MAX_UTTERANCES_PER_KEY",
    "CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY",
    "CLONECAST_TOKEN_SECRET",
    "CLONECAST_ALLOWED_ORIGINS",
    "CLONECAST_MAX_CONNECTIONS",
    "CLONECAST_MAX_NUM_SEQS",
    "CLONECAST_MAX_BATCHED_TOKENS",
    "CLONECAST_MAX_MESSAGES_PER_S",
    "CLONECAST_MESSAGE_BURST",
    "CLONECAST_HEADER_TIMEOUT_S",
    "CLONECAST_BODY_TIMEOUT_S",
    "CLONECAST_EAGER",
    "CLONECAST_ATTENTION_BACKEND",
    "CLONECAST_KV_CACHE_DTYPE",
    "CLONECAST_QUANTIZATION",
    "CLONECAST_PREFIX_CACHING",
    "CLONECAST_PLAN",
    "CLONECAST_VOICE_STORE",
    "CLONECAST_VOICES_DIR",
    "CLONECAST_GIL_SWITCH_MS",
    "CLONECAST_LOG_FORMAT",
    "CLONECAST_ENGINE_PROCESS",
    "CLONECAST_ENGINE_RESTARTS",
    "CLONECAST_DRAIN_TIMEOUT_S",
    "CLONECAST_PROFILE",
)


SECRETS = ("CLONECAST_API_KEYS", "CLONECAST_ADMIN_KEYS", "CLONECAST_TOKEN_SECRET")


def config_file(path: Path) -> dict[str, str]:
    """A TOML file of settings under the environment variables' names (`CLONECAST_PORT =
    8800`; lists for the comma-separated ones, true/false for the flags), as strings the way
    the environment would hold them. ValueError names the file and the bad entry."""
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {str(path)!r}: {exc}") from exc
    out = {}
    for name, value in table.items():
        if name not in VARIABLES:
            raise ValueError(f"--config {str(path)!r}: unknown setting {name!r}")
        if isinstance(value, bool):
            out[name] = "1" if value else "0"
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[name] = ",".join(value)
        elif isinstance(value, str | int | float):
            out[name] = str(value)
        elif isinstance(value, dict) and name == "CLONECAST_PLAN":
            out[name] = json.dumps(value)
        else:
            shown = "that" if name in SECRETS else repr(value)  # an error never shows a key
            raise ValueError(f"--config {str(path)!r}: {name} cannot be {shown}")
    return out


def _limits(env) -> Limits:
    default = Limits()
    return Limits(
        max_connections=int(env.get("CLONECAST_MAX_CONNECTIONS", default.max_connections)),
        max_messages_per_s=float(
            env.get("CLONECAST_MAX_MESSAGES_PER_S", default.max_messages_per_s)
        ),
        message_burst=int(env.get("CLONECAST_MESSAGE_BURST", default.message_burst)),
        header_timeout_s=float(env.get("CLONECAST_HEADER_TIMEOUT_S", default.header_timeout_s)),
        body_timeout_s=float(env.get("CLONECAST_BODY_TIMEOUT_S", default.body_timeout_s)),
        max_utterances_per_key=_per_key(
            "CLONECAST_MAX_UTTERANCES_PER_KEY", env.get("CLONECAST_MAX_UTTERANCES_PER_KEY"), int
        ),
        max_audio_s_per_minute_per_key=_per_key(
            "CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY",
            env.get("CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY"),
            float,
        ),
    )


def _per_key(name: str, value: str | None, kind: type):
    """A per-key limit: a number >= 0 (0, unset: off)."""
    value = value or "0"
    try:
        limit = kind(value)
    except ValueError:
        limit = -1
    if not limit >= 0:
        raise ValueError(f"{name} must be a number >= 0 (0: no per-key limit), got {value!r}")
    return limit


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _count(name: str, value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return count


def _seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return seconds


def _positive_ms(value: str) -> float:
    ms = float(value)
    if not 0 < ms <= 1000:
        raise ValueError(f"CLONECAST_GIL_SWITCH_MS must be in (0, 1000] ms, got {value!r}")
    return ms


def _profile(value: str | None) -> tuple[int, int, str, str, int] | None:
    """SKIP,STEPS,FILE[,MODE[,MIN_RUNNING]] -> (skip, steps, file, mode, min_running)."""
    if not value:
        return None
    parts = value.split(",")
    try:
        skip, steps, path = int(parts[0]), int(parts[1]), parts[2]
        mode = parts[3] if len(parts) > 3 else "torch"
        min_running = int(parts[4]) if len(parts) > 4 else 1
    except (IndexError, ValueError):
        raise ValueError(
            f"CLONECAST_PROFILE must be SKIP,STEPS,FILE[,MODE[,MIN_RUNNING]], got {value!r}"
        ) from None
    if len(parts) > 5 or skip < 0 or steps < 1 or not path or mode not in ("torch", "python"):
        raise ValueError(
            "CLONECAST_PROFILE wants SKIP >= 0, STEPS >= 1, a file, a mode of torch or python "
            f"and a running count: {value!r}"
        )
    return skip, steps, path, mode, min_running


def _voice_store(env) -> Path | str | None:
    value = env.get("CLONECAST_VOICE_STORE")
    if value == "memory":
        return None
    if value and value.startswith(("postgresql://", "postgres://")):
        return value  # a shared database's URL (service/voice_db_postgres.py)
    if value and "://" in value:
        raise ValueError(
            "CLONECAST_VOICE_STORE is a file path, `memory` or a postgresql:// URL; "
            f"{value.split('://')[0]}:// is not supported"
        )
    if value:
        return Path(value)
    cache = Path(env["CLONECAST_CACHE_DIR"]) if env.get("CLONECAST_CACHE_DIR") else None
    return (cache or Path.home() / ".cache" / "clonecast") / "voices.sqlite3"


def _plan(value: str | None) -> dict:
    if not value:
        return {}
    try:
        plan = json.loads(value)
    except ValueError:
        plan = None
    if not isinstance(plan, dict):
        raise ValueError(f"CLONECAST_PLAN must be a JSON object of plan fields, got {value!r}")
    return plan


def _log_format(value: str) -> str:
    if value not in ("plain", "json"):
        raise ValueError(f"CLONECAST_LOG_FORMAT must be plain or json, got {value!r}")
    return value
