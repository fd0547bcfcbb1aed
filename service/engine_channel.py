"""The messages between the server and its engine (service/engine_client.py on the server's
side, service/engine_host.py on the engine's), one dataclass each. They cross a
`multiprocessing` queue (pickled) to an engine process, or a plain queue to an engine thread:
the same messages either way. Requests cross under a wire id of their own (`{request_id}#n`),
so events still in the pipe for an aborted request can never reach a later one of that id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine import (
    ConfigError,
    Engine,
    EngineStats,
    Observations,
    ReferenceAudioError,
    RequestOutput,
    SamplingParams,
    VoiceReference,
)

Sink = Callable[[RequestOutput | BaseException], None]  # a request's audio, finish or error


@dataclass(frozen=True)
class PortableError:
    """An exception as plain data (ReferenceAudioError, for one, cannot be unpickled), rebuilt
    as ConfigError / ReferenceAudioError / RuntimeError, so the service maps it to the same
    client errors whichever side raised it."""

    name: str
    message: str
    code: str | None
    is_config: bool

    @classmethod
    def of(cls, exc: BaseException) -> PortableError:
        code = getattr(exc, "code", None)
        return cls(type(exc).__name__, str(exc), code, isinstance(exc, ConfigError))

    def rebuild(self) -> Exception:
        if self.name == "ReferenceAudioError" and self.code is not None:
            return ReferenceAudioError(self.code, self.message)
        if self.is_config:
            return ConfigError(self.message)
        return RuntimeError(f"{self.name} in the engine: {self.message}")


@dataclass(frozen=True)
class EngineInfo:
    """What the service shows of its engine (`/ready`, capture gauges)."""

    checkpoint: str
    is_default_model: bool
    has_codec: bool
    max_model_len: int
    capture_reports: tuple = ()
    plan: dict | None = None  # the engine's execution plan, described
    device: str = "cpu"  # e.g. "cuda:0"
    dtype: str = "float32"  # the model's weights

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(
            str(engine.checkpoint),
            engine.is_default_model,
            engine.codec is not None,
            engine.config.max_model_len,
            tuple(engine.capture_reports),
            engine.plan.describe(),
            str(engine.device),
            str(engine.dtype).removeprefix("torch."),
        )


# -- to the engine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    wire_id: str
    text: str
    reference: VoiceReference | None
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    wire_id: str


@dataclass(frozen=True)
class EncodeVoice:
    token: int
    audio: bytes
    transcript: str | None


@dataclass(frozen=True)
class CancelEncode:
    """Its asker gave up (its client left): dropped if not begun (one begun runs out)."""

    token: int


@dataclass(frozen=True)
class Stop:
    pass


# -- from the engine --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True)
class LoadFailed:
    error: PortableError


@dataclass(frozen=True)
class Added:
    """The request was added (error None) or refused; sent before any event of it."""

    wire_id: str
    error: PortableError | None
    stats: EngineStats


@dataclass(frozen=True)
class Outputs:
    """One step's audio chunks and finishes (rows stay on the engine's side), in order."""

    items: list[tuple[str, RequestOutput]]


@dataclass(frozen=True)
class RequestFailed:
    wire_id: str
    error: PortableError


@dataclass(frozen=True)
class Encoded:
    token: int
    reference: VoiceReference | None
    error: PortableError | None
    stats: EngineStats


@dataclass(frozen=True)
class Steps:
    """The observations since the last report (each step's time and shape, queue times, codec
    batch latencies), with the statistics after the last step."""

    observed: Observations
    stats: EngineStats


@dataclass(frozen=True)
class Stats:
    """Statistics that changed without a step (an abort, an encode, going idle)."""

    stats: EngineStats
