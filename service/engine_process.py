"""The engine in a process of its own, behind the same interface as `EngineWorker`.

Why: the engine's step is Python as much as GPU work (scheduling, graph launches, reading
rows back), and in one process it shares the interpreter lock with the server's event loop
(WebSocket frames, audio encoding, JSON). On the H200 a second thread holding the lock 30% of
the time made the batch-64 step 6% slower, and the served step was 8-10% slower than the
engine alone (docs/PERFORMANCE.md). Here the engine process runs an `EngineWorker` and
nothing else; the server process keeps the sockets.

Two `multiprocessing` queues carry the traffic (spawned process: CUDA does not survive a
fork). To the engine: add, abort, encode (a reference recording), stop. From it: ready (or
failed, with the load error), added (or the request's ConfigError), outs (one step's audio
chunks and finishes, the only events the service reads), fail, encoded, and step statistics
(batched: every 50 ms while busy, at once when it goes idle). A queue's feeder thread writes
each message, so the engine thread never blocks on a slow reader.

Exceptions cross as (type name, message, code) and are rebuilt as ConfigError /
ReferenceAudioError / RuntimeError, so the service maps them to the same client errors as
in one process. If the engine process dies, every request in flight fails with an error
naming its exit code, `alive` turns false (`/ready` answers 503) and new requests fail at once.
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine import (
    ConfigError,
    EngineConfig,
    EngineStats,
    ReferenceAudioError,
    RequestOutput,
    StepProfiler,
    TextChecker,
    VoiceReference,
)
from service.worker import EngineInfo, EngineWorker, Sink, settle_garbage_collector

log = logging.getLogger("clonecast.engine_process")

STATS_INTERVAL_S = 0.05  # step statistics go to the server at most this often while busy
IDLE_POLL_S = 0.1  # the engine process's command wait; an idle engine's stats are re-sent


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: `Engine.from_pretrained(model, config, codec=codec,
    cache_dir=cache_dir)`."""

    model: str | None
    config: EngineConfig
    codec: str | None = None
    cache_dir: Path | None = None
    gil_switch_ms: float = 0.5
    log_level: int = logging.WARNING
    profile: tuple[int, int, str, str, int] | None = None  # ServiceSettings.profile


def _portable(exc: BaseException) -> tuple[str, str, str | None, bool]:
    """An exception as plain data (ReferenceAudioError, for one, cannot be unpickled)."""
    return type(exc).__name__, str(exc), getattr(exc, "code", None), isinstance(exc, ConfigError)


def _rebuild(data: tuple[str, str, str | None, bool]) -> Exception:
    name, message, code, is_config = data
    if name == "ReferenceAudioError" and code is not None:
        return ReferenceAudioError(code, message)
    if is_config:
        return ConfigError(message)
    return RuntimeError(f"{name} in the engine process: {message}")


class EngineProcess:
    """`EngineWorker`'s interface with the engine in a spawned process. `start()` blocks until
    the engine is loaded, captured and ready (the service calls it from a thread pool)."""

    def __init__(
        self, spec: EngineSpec, on_step: Callable[[float, EngineStats], None] | None = None
    ):
        ctx = multiprocessing.get_context("spawn")
        self._commands = ctx.Queue()
        self._events = ctx.Queue()
        self._process = ctx.Process(
            target=_engine_main,
            args=(spec, self._commands, self._events),
            name="clonecast-engine",
            daemon=True,
        )
        self._on_step = on_step
        self._lock = threading.Lock()
        # Requests cross the queues under a wire id of their own (`{request_id}#{n}`): events
        # still in the pipe for an aborted request can never reach a later one of that id.
        self._wire: dict[str, str] = {}  # request id -> its live wire id
        self._sinks: dict[str, Sink] = {}  # by wire id
        self._added: dict[str, concurrent.futures.Future] = {}  # by wire id
        self._encodes: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._reader = threading.Thread(target=self._read, name="clonecast-events", daemon=True)
        self._stopping = False
        self._exit_reason: str | None = None
        self._stats: EngineStats | None = None
        self.info: EngineInfo | None = None
        self._check = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._process.start()
        while True:
            try:
                message = self._events.get(timeout=1.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the engine process exited with code {self._process.exitcode} while "
                        "loading the model (its log says why)"
                    ) from None
                continue
            if message[0] == "failed":
                self._process.join(timeout=10)
                raise _rebuild(message[1])
            _, self.info, self._stats = message  # "ready"
            break
        info = self.info
        self._check = TextChecker.from_checkpoint(Path(info.checkpoint), info.max_model_len)
        self._reader.start()

    def stop(self) -> None:
        if self._commands is None:
            return  # stopped already
        self._stopping = True
        if self._process.is_alive():
            self._commands.put(("stop",))
            self._process.join(timeout=15)
            if self._process.is_alive():
                log.warning("the engine process did not stop in 15 s: terminating it")
                self._process.terminate()
                self._process.join(timeout=5)
        if self._reader.is_alive():
            self._reader.join(timeout=5)
        with self._lock:
            self._exit_reason = self._exit_reason or "the engine has stopped"
            queues, self._commands = (self._commands, self._events), None
        self._events = None  # the reader, if still running, holds its own reference
        for q in queues:
            q.cancel_join_thread()  # never wait forever on a pipe the engine no longer reads
            q.close()
            feeder = getattr(q, "_thread", None)  # writes what was put, then ends; until
            if feeder is not None:  # then it holds two of the queue's semaphores
                feeder.join(timeout=5)
        # Collected here, the queues' semaphores are unlinked. Left for the interpreter's
        # exit they are not when the server ends by SIGTERM: uvicorn re-raises it after its
        # graceful shutdown, the default action skips exit handlers, and multiprocessing's
        # resource tracker reports them as leaked. They sit in reference cycles, so dropping
        # them is not enough: a collection (once, at shutdown) frees them.
        del queues, q
        gc.collect()

    @property
    def alive(self) -> bool:
        return self._exit_reason is None and self._process.is_alive()

    # -- the EngineWorker interface ----------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._stats.num_waiting if self._stats else 0

    @property
    def num_running(self) -> int:
        return self._stats.num_running if self._stats else 0

    def has_unfinished(self) -> bool:
        """As of the last statistics (at most `IDLE_POLL_S` old when idle)."""
        return bool(self._stats and (self._stats.num_running or self._stats.num_waiting))

    def check_text(self, text: str, reference: VoiceReference | None = None) -> None:
        self._check(text, reference)

    def submit(self, request_id, text, reference, params, sink: Sink) -> concurrent.futures.Future:
        """Queues a request; the future resolves once the engine added it (or with its
        ConfigError). A future cancelled before that: the request is aborted, its sink unused."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._exit_reason is not None:
                done.set_exception(RuntimeError(self._exit_reason))
                return done
            if request_id in self._wire:
                done.set_exception(ConfigError(f"request id {request_id!r} is already in use"))
                return done
            wire = self._wire[request_id] = f"{request_id}#{next(self._tokens)}"
            self._sinks[wire] = sink
            self._added[wire] = done
            self._commands.put(("add", wire, text, reference, params))
        return done

    def abort(self, request_id: str) -> None:
        with self._lock:
            wire = self._wire.pop(request_id, None)
            if wire is None or self._exit_reason is not None:
                return
            self._sinks.pop(wire, None)
            self._commands.put(("abort", wire))

    def _send(self, message: tuple) -> None:
        """A command to the engine process, unless it has stopped (then there is no one to
        tell)."""
        with self._lock:
            if self._exit_reason is None:
                self._commands.put(message)

    def _forget(self, wire: str) -> Sink | None:
        """Drops a request's sink and id (under the lock); returns the sink."""
        request_id = wire.rpartition("#")[0]
        if self._wire.get(request_id) == wire:  # not a later request of the same id
            del self._wire[request_id]
        return self._sinks.pop(wire, None)

    def encode_reference(self, data: bytes, transcript: str | None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            if self._exit_reason is not None:
                future.set_exception(RuntimeError(self._exit_reason))
                return future
            self._encodes[token] = future
            self._commands.put(("encode", token, data, transcript))
        return future

    # -- the server's reader thread ----------------------------------------------------------

    def _read(self) -> None:
        events = self._events  # stop() drops the attribute
        while True:
            try:
                message = events.get(timeout=0.5)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                break
            except (EOFError, OSError):
                break
            try:
                self._dispatch(message)
            except Exception:  # a bug in a sink: keep reading
                log.exception("handling an engine event failed")
        self._exited()

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "outs":
            for wire, out in message[1]:
                with self._lock:
                    sink = self._forget(wire) if out.finished else self._sinks.get(wire)
                if sink is not None:
                    try:
                        sink(out)
                    except Exception:
                        log.exception("delivering an output failed")
        elif kind == "steps":
            _, seconds, self._stats = message
            if self._on_step is not None:
                for s in seconds:
                    self._on_step(s, self._stats)
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "added":
            _, wire, error, self._stats = message
            with self._lock:
                done = self._added.pop(wire, None)
                if error is not None:
                    self._forget(wire)
            if done is None:
                return
            if not done.set_running_or_notify_cancel():  # the caller stopped waiting
                with self._lock:
                    self._forget(wire)
                if error is None:
                    self._send(("abort", wire))
            elif error is not None:
                done.set_exception(_rebuild(error))
            else:
                done.set_result(None)
        elif kind == "fail":
            _, wire, error = message
            with self._lock:
                sink = self._forget(wire)
            if sink is not None:
                sink(_rebuild(error))
        elif kind == "encoded":
            _, token, result, error, self._stats = message
            with self._lock:
                future = self._encodes.pop(token, None)
            if future is not None and future.set_running_or_notify_cancel():  # not cancelled
                future.set_exception(_rebuild(error)) if error else future.set_result(result)

    def _exited(self) -> None:
        """The engine process is gone: everything waiting on it fails with the reason."""
        self._process.join(timeout=5)
        reason = f"the engine process exited (code {self._process.exitcode})"
        if not self._stopping:
            log.error("%s: failing the requests in flight", reason)
        with self._lock:
            self._exit_reason = reason
            sinks, self._sinks, self._wire = self._sinks, {}, {}
            waiting = [*self._added.values(), *self._encodes.values()]
            self._added, self._encodes = {}, {}
        for future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(reason))
        for sink in sinks.values():
            try:
                sink(RuntimeError(reason))
            except Exception:
                log.exception("delivering the engine's exit failed")


# -- the engine process -----------------------------------------------------------------------


class _StatsSender:
    """Step statistics to the server: batched while busy, at once when the engine goes idle
    or when they changed without a step (an abort, a voice encode)."""

    def __init__(self, events, engine):
        self.events, self.engine = events, engine
        self.lock = threading.Lock()
        self.seconds: list[float] = []
        self.last_sent = 0.0
        self.last_stats: EngineStats | None = None

    def on_step(self, seconds: float, stats: EngineStats) -> None:  # the engine thread
        with self.lock:
            self.seconds.append(seconds)
            now = time.monotonic()
            idle = not (stats.num_running or stats.num_waiting)
            if idle or now - self.last_sent >= STATS_INTERVAL_S:
                self.events.put(("steps", self.seconds, stats))
                self.seconds, self.last_sent, self.last_stats = [], now, stats

    def refresh(self) -> None:  # the command thread, when no command came for a while
        stats = self.engine.stats
        with self.lock:
            if self.seconds:  # steps not sent yet (the last ones came within the interval)
                self.events.put(("steps", self.seconds, stats))
                self.seconds = []
            elif stats != self.last_stats:
                self.events.put(("stats", stats))
            self.last_sent, self.last_stats = time.monotonic(), stats


class _ProcessWorker(EngineWorker):
    """The engine process's worker: a step's events leave in one message ("outs"), so the
    queue's feeder thread wakes (and takes the interpreter lock) once per step, not per
    chunk. Exceptions for a sink still go one by one ("fail")."""

    def __init__(self, engine, events, on_step):
        super().__init__(engine, on_step=on_step)
        self._events = events

    def _send(self, delivered) -> None:
        # without the rows (the service reads only audio and finishes)
        self._events.put(
            (
                "outs",
                [
                    (
                        sink.request_id,
                        RequestOutput(
                            out.request_id, [], out.finished, out.finish_reason, None, out.audio
                        ),
                    )
                    for sink, out in delivered
                ],
            )
        )


def _sink_for(events, request_id: str) -> Sink:
    """A request's sink in the engine process; `_ProcessWorker` batches its events by
    `request_id` and only exceptions come through the call itself."""

    def sink(out) -> None:  # the engine thread
        if isinstance(out, BaseException):
            events.put(("fail", request_id, _portable(out)))
        else:
            events.put(("outs", [(request_id, out)]))

    sink.request_id = request_id
    return sink


def _engine_main(spec: EngineSpec, commands, events) -> None:
    # Ctrl-C in a terminal, or a SIGTERM to the whole process group, must not stop the engine
    # under requests the server is still draining: it stops on "stop" or when the server dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s clonecast-engine %(levelname)s %(message)s"
    )
    try:
        from engine import Engine

        engine = Engine.from_pretrained(
            spec.model, spec.config, codec=spec.codec, cache_dir=spec.cache_dir
        )
    except BaseException as exc:  # the server reports it and exits
        logging.getLogger("clonecast.engine_process").exception("loading the engine failed")
        events.put(("failed", _portable(exc)))
        return
    sender = _StatsSender(events, engine)
    on_step = sender.on_step
    if spec.profile is not None:
        skip, steps, path, mode, min_running = spec.profile
        on_step = StepProfiler(skip, steps, path, on_step, mode, min_running).on_step
    worker = _ProcessWorker(engine, events, on_step=on_step)
    worker.start()
    events.put(("ready", worker.info, engine.stats))
    settle_garbage_collector()
    sys.setswitchinterval(spec.gil_switch_ms / 1000)
    try:
        orphaned = _serve(worker, engine, commands, events, sender)
    finally:
        worker.stop()
    if orphaned:
        # Nobody reads the events any more: the queue's feeder thread may block on a full
        # pipe forever, and a normal exit would wait for it (holding the GPU). Leave now.
        os._exit(0)


def _serve(worker: EngineWorker, engine, commands, events, sender: _StatsSender) -> bool:
    """Applies the server's commands until "stop" (False) or until the server is gone (True)."""

    def added(request_id: str, future: concurrent.futures.Future) -> None:  # engine thread
        if future.cancelled():  # the worker is shutting down: nobody waits for the answer
            return
        error = future.exception()
        events.put(("added", request_id, _portable(error) if error else None, engine.stats))

    def encoded(token: int, future: concurrent.futures.Future) -> None:
        if future.cancelled():  # queued encodes dropped at shutdown
            return
        error = future.exception()
        result = None if error else future.result()
        error = _portable(error) if error else None
        events.put(("encoded", token, result, error, engine.stats))

    parent = multiprocessing.parent_process()
    while True:
        try:
            command = commands.get(timeout=IDLE_POLL_S)
        except queue.Empty:
            if not parent.is_alive():  # the server was killed: do not outlive it
                log.warning("the server process is gone: the engine process exits")
                return True
            sender.refresh()
            continue
        kind = command[0]
        if kind == "add":
            _, request_id, text, reference, params = command
            # "added" goes out from the engine thread as it adds the request, before any
            # event of that request (the callback is attached before the thread sees it)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.add_done_callback(lambda f, rid=request_id: added(rid, f))
            worker.submit(request_id, text, reference, params, _sink_for(events, request_id), done)
        elif kind == "abort":
            worker.abort(command[1])
        elif kind == "encode":
            _, token, data, transcript = command
            future = worker.encode_reference(data, transcript)
            future.add_done_callback(lambda f, t=token: encoded(t, f))
        elif kind == "stop":
            return False
