"""The engine's own thread: it owns the Engine, takes commands from the event loop (add,
abort) through a queue, steps while there is work, and hands each request's audio chunks and
its finish to the sink registered with it (row-only events stay here: at 64 streams they are
64 cross-thread calls a step that nobody reads). The event loop never waits on the GPU.

Sinks are called on the engine thread; they must only schedule work elsewhere (the service
passes `loop.call_soon_threadsafe`-wrapped callbacks). Reference encoding runs in a separate
small thread pool, so a long HuBERT pass never stalls the step loop.

The service talks to the engine only through this interface (submit, abort,
encode_reference, check_text, stats, info); `service/engine_process.py` offers the same with
the engine in a process of its own, the default of the server.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine import (
    ConfigError,
    Engine,
    EngineStats,
    RequestOutput,
    SamplingParams,
    VoiceReference,
)

log = logging.getLogger("clonecast.worker")


@dataclass(frozen=True)
class EngineInfo:
    """What the service shows of its engine (`/ready`, capture gauges)."""

    checkpoint: str
    is_default_model: bool
    has_codec: bool
    max_model_len: int
    capture_reports: tuple = ()
    plan: dict | None = None  # the engine's execution plan, described

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(
            str(engine.checkpoint),
            engine.is_default_model,
            engine.codec is not None,
            engine.config.max_model_len,
            tuple(engine.capture_reports),
            engine.plan.describe(),
        )


def settle_garbage_collector() -> None:
    """Once everything is loaded: the start-up objects (model, tokenizer, graphs) move to
    the permanent generation, and young collections run less often. Without this, a full
    collection now and then scans every request's rows and stalls one engine step by several
    milliseconds (measured on the CPU: a step's row bookkeeping at 256 streams took 7.9 ms
    with a full collection in it, 0.9 ms without; docs/PERFORMANCE.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


Sink = Callable[[RequestOutput | BaseException], None]


@dataclass
class _Add:
    request_id: str
    text: str
    reference: VoiceReference | None
    params: SamplingParams
    sink: Sink
    done: concurrent.futures.Future


class EngineWorker:
    def __init__(self, engine: Engine, on_step: Callable[[float, EngineStats], None] | None = None):
        """`on_step(seconds, stats)` after every step, on the engine thread."""
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clonecast-engine", daemon=True)
        self.encoder_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="encode")
        self.num_waiting = 0
        self.num_running = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def check_text(self, text: str, reference: VoiceReference | None = None) -> None:
        self.engine.check_text(text, reference)

    def encode_reference(self, data: bytes, transcript: str | None) -> concurrent.futures.Future:
        """The voice of an uploaded recording, encoded in the encoder pool."""
        return self.encoder_pool.submit(self.engine.encode_reference, data, transcript)

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        self.encoder_pool.shutdown(wait=False, cancel_futures=True)

    # -- called from any thread --------------------------------------------------------------

    def submit(
        self, request_id, text, reference, params, sink: Sink, done=None
    ) -> concurrent.futures.Future:
        """Queues a request; the future resolves once it is added (or with its ConfigError).
        `done`: a future of the caller's to resolve instead (callbacks attached before the
        engine thread can see it run there, before the request's first step)."""
        done = done if done is not None else concurrent.futures.Future()
        self._commands.put(_Add(request_id, text, reference, params, sink, done))
        return done

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished())
            except Exception:  # a bug in a command: report it, keep the engine thread alive
                log.exception("engine command failed")
            if not self.engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            try:
                # audio read back early in the step goes out at once (emit), the rest after it
                self._deliver(self.engine.step(emit=self._deliver))
            except Exception as exc:  # a bug: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            stats = self.engine.stats
            self.num_waiting, self.num_running = stats.num_waiting, stats.num_running
            if self._on_step is not None:
                self._on_step(time.perf_counter() - t0, stats)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        delivered = []
        for out in outputs:
            if out.audio is None and not out.finished:
                continue
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                delivered.append((sink, out))
        if delivered:
            self._send(delivered)

    def _send(self, delivered: list[tuple[Sink, RequestOutput]]) -> None:
        """Hands one step's (or one early batch's) events to their sinks; the engine process
        overrides it to send them in one message."""
        for sink, out in delivered:
            try:
                sink(out)
            except Exception:
                log.exception("delivering an output failed")

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            if not command.done.set_running_or_notify_cancel():
                return  # the caller stopped waiting (client gone): never start it
            try:
                self.engine.add_request(
                    command.request_id,
                    command.text,
                    reference=command.reference,
                    params=command.params,
                    audio=True,
                )
            except ConfigError as exc:
                command.done.set_exception(exc)
                return
            except Exception as exc:  # a bug: the caller must not wait forever
                log.exception("adding request %s failed", command.request_id)
                command.done.set_exception(exc)
                return
            self._sinks[command.request_id] = command.sink
            command.done.set_result(None)
        else:
            _, request_id = command
            if self.engine.abort(request_id):
                self._sinks.pop(request_id, None)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink(exc)
        self._sinks.clear()
