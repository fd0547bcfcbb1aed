"""The service's one interface to its engine: submit, abort, encode_reference, check_text,
stats, info, alive. Behind it the engine runs in a process of its own (the default) or in a
thread of the server's process; both speak the messages of service/engine_channel.py to
service/engine_host.py, and only the transport differs.

Why a process: the engine's step is Python as much as GPU work (scheduling, graph launches,
reading rows back), and in one process it shares the interpreter lock with the server's event
loop (WebSocket frames, audio encoding, JSON). On the H200 a second thread holding the lock
30% of the time made the batch-64 step 6% slower, and the served step was 8-10% slower than
the engine alone (docs/perf-log/). The process is spawned (CUDA does not survive a fork).

This is the one place that maps a request to its sink: requests cross under a wire id of
their own, events are dispatched by it on a reader thread (sinks must only schedule work
elsewhere). If the engine dies, every request in flight fails with an error naming its exit
code, `alive` turns false and new requests fail at once; `on_exit` then tells the service
(service/engine_supervisor.py starts a new engine).
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from engine import ConfigError, Engine, EngineStats, Observations, TextChecker, VoiceReference
from service.engine_channel import (
    AbortRequest,
    Added,
    AddRequest,
    CancelEncode,
    Encoded,
    EncodeVoice,
    EngineInfo,
    LoadFailed,
    Outputs,
    Ready,
    RequestFailed,
    Sink,
    Stats,
    Steps,
    Stop,
)
from service.engine_host import EngineSpec, process_main, thread_main

log = logging.getLogger("clonecast.engine_client")
# How soon the reader notices a dead engine once its last events are read: the streams in
# flight fail and the restart begins that much after a crash (a wake of an idle thread).
EXIT_POLL_S = 0.1


class EngineExited(RuntimeError):
    """What every request waiting on an engine that died (or was stopped) fails with."""


class _ProcessTransport:
    """Two `multiprocessing` queues and the spawned engine process."""

    def __init__(self, spec: EngineSpec):
        ctx = multiprocessing.get_context("spawn")
        self.commands = ctx.Queue()
        self.events = ctx.Queue()
        self.process = ctx.Process(
            target=process_main,
            args=(spec, self.commands, self.events),
            name="clonecast-engine",
            daemon=True,
        )

    def start(self) -> None:
        self.process.start()

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self) -> str:
        return f"the engine process exited (code {self.process.exitcode})"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)

    def terminate(self) -> None:
        self.process.terminate()
        self.process.join(timeout=5)

    def release(self) -> None:
        """Closes both queues. Collected here, their semaphores are unlinked; left for the
        interpreter's exit they are not when the server ends by SIGTERM (uvicorn re-raises it
        after its graceful shutdown, the default action skips exit handlers, and
        multiprocessing's resource tracker reports them as leaked). They sit in reference
        cycles, so dropping them is not enough: a collection (once, at shutdown) frees them."""
        queues, self.commands, self.events = (self.commands, self.events), None, None
        for q in queues:
            q.cancel_join_thread()  # never wait forever on a pipe the engine no longer reads
            q.close()
            feeder = getattr(q, "_thread", None)  # writes what was put, then ends; until
            if feeder is not None:  # then it holds two of the queue's semaphores
                feeder.join(timeout=5)
        del queues, q
        gc.collect()


class _ThreadTransport:
    """Two plain queues and a thread of this process serving the given engine."""

    def __init__(self, engine: Engine, profile=None):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        args = (engine, self.commands, self.events, profile)  # profile: ServiceSettings'
        self.thread = threading.Thread(target=thread_main, args=args, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def exit_reason(self) -> str:
        return "the engine thread has stopped"

    pid = None  # the server's own process

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)

    def terminate(self) -> None:
        pass  # a thread cannot be stopped from outside; it is a daemon

    def release(self) -> None:
        self.commands = self.events = None


class EngineClient:
    """`start()` blocks until the engine is loaded, captured and ready (the service calls it
    from a thread pool)."""

    def __init__(
        self,
        transport,
        on_steps: Callable[[Observations, EngineStats], None] | None = None,
        on_exit: Callable[[str], None] | None = None,
    ):
        """`on_steps(observed, stats)`: called on the reader thread with each report of steps;
        `on_exit(reason)`: on the reader thread once a started engine has died (not after
        `stop()`), when everything that waited on it has failed."""
        self._transport = transport
        self._on_steps = on_steps
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._wire: dict[str, str] = {}  # request id -> its live wire id
        self._sinks: dict[str, Sink] = {}  # by wire id
        self._added: dict[str, concurrent.futures.Future] = {}  # by wire id
        self._encodes: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._reader = threading.Thread(target=self._read, name="clonecast-events", daemon=True)
        self._stopping = False
        self._stopped = False
        self._exit_reason: str | None = None
        self._stats: EngineStats | None = None
        self.info: EngineInfo | None = None
        self._check = None

    @classmethod
    def in_process(cls, spec: EngineSpec, on_steps=None, on_exit=None) -> EngineClient:
        return cls(_ProcessTransport(spec), on_steps, on_exit)

    @classmethod
    def in_thread(cls, engine: Engine, on_steps=None, on_exit=None, profile=None) -> EngineClient:
        return cls(_ThreadTransport(engine, profile), on_steps, on_exit)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        transport = self._transport
        transport.start()
        while True:
            try:
                message = transport.events.get(timeout=1.0)
            except queue.Empty:
                if not transport.is_alive():
                    raise RuntimeError(
                        f"{transport.exit_reason()} while loading the model (its log says why)"
                    ) from None
                continue
            if isinstance(message, LoadFailed):
                transport.join(timeout=10)
                raise message.error.rebuild()
            assert isinstance(message, Ready), message
            self.info, self._stats = message.info, message.stats
            break
        self._check = TextChecker.from_checkpoint(
            Path(self.info.checkpoint), self.info.max_model_len
        )
        self._reader.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = self._stopping = True
        transport = self._transport
        if transport.is_alive():
            transport.commands.put(Stop())
            transport.join(timeout=15)
            if transport.is_alive():
                log.warning("the engine did not stop in 15 s: terminating it")
                transport.terminate()
        if self._reader.is_alive():
            self._reader.join(timeout=5)
        if self._reader.is_alive():  # the engine did not go: nobody waits on it forever
            self._fail_everything("the engine did not stop")
        with self._lock:  # from here on no command touches the queues
            self._exit_reason = self._exit_reason or "the engine has stopped"
        transport.release()

    @property
    def alive(self) -> bool:
        return self._exit_reason is None and self._transport.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id (None: the engine runs in this process)."""
        return self._transport.pid

    # -- the service's interface -------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._stats.num_waiting if self._stats else 0

    @property
    def num_running(self) -> int:
        return self._stats.num_running if self._stats else 0

    @property
    def in_flight(self) -> int:
        """Requests submitted through this client and not ended yet (counted at once, not
        from the engine's statistics)."""
        return len(self._wire)

    def has_unfinished(self) -> bool:
        """As of the last statistics (at most a poll interval old when idle)."""
        return bool(self._stats and (self._stats.num_running or self._stats.num_waiting))

    def check_text(self, text: str, reference: VoiceReference | None = None) -> None:
        self._check(text, reference)

    def submit(self, request_id, text, reference, params, sink: Sink) -> concurrent.futures.Future:
        """Queues a request; the future resolves once the engine added it (or with its
        ConfigError). A future cancelled before that: the request is aborted, its sink unused."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._exit_reason is not None:
                done.set_exception(EngineExited(self._exit_reason))
                return done
            if request_id in self._wire:
                done.set_exception(ConfigError(f"request id {request_id!r} is already in use"))
                return done
            wire = self._wire[request_id] = f"{request_id}#{next(self._tokens)}"
            self._sinks[wire] = sink
            self._added[wire] = done
            self._transport.commands.put(AddRequest(wire, text, reference, params))
        done.add_done_callback(lambda f: f.cancelled() and self._drop_sink(wire))
        return done

    def _drop_sink(self, wire: str) -> None:
        """The caller stopped waiting: its sink is never called (the request is aborted when
        the engine's answer comes, `_on_added`)."""
        with self._lock:
            self._sinks.pop(wire, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            wire = self._wire.pop(request_id, None)
            if wire is None or self._exit_reason is not None:
                return
            self._sinks.pop(wire, None)
            self._transport.commands.put(AbortRequest(wire))

    def encode_reference(self, data: bytes, transcript: str | None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            if self._exit_reason is not None:
                future.set_exception(EngineExited(self._exit_reason))
                return future
            self._encodes[token] = future
            self._transport.commands.put(EncodeVoice(token, data, transcript))
        future.add_done_callback(lambda f: f.cancelled() and self._encode_cancelled(token))
        return future

    def _encode_cancelled(self, token: int) -> None:
        """Its asker gave up (asyncio.wrap_future cancels it when its task is cancelled):
        a queued encode is dropped, not run for no one."""
        with self._lock:
            self._encodes.pop(token, None)
        self._send(CancelEncode(token))

    def _send(self, command) -> None:
        """A command to the engine, unless it has stopped (then there is no one to tell)."""
        with self._lock:
            if self._exit_reason is None:
                self._transport.commands.put(command)

    def _forget(self, wire: str) -> Sink | None:
        """Drops a request's sink and id (under the lock); returns the sink."""
        request_id = wire.rpartition("#")[0]
        if self._wire.get(request_id) == wire:  # not a later request of the same id
            del self._wire[request_id]
        return self._sinks.pop(wire, None)

    # -- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        events = self._transport.events  # stop() releases the transport's
        while True:
            try:
                message = events.get(timeout=EXIT_POLL_S)
            except queue.Empty:
                if self._transport.is_alive():
                    continue
                break
            except (EOFError, OSError, ValueError):  # ValueError: stop() closed the queue
                break
            try:
                self._dispatch(message)
            except Exception:  # a bug in a sink: keep reading
                log.exception("handling an engine event failed")
        self._exited()

    def _dispatch(self, message) -> None:
        if isinstance(message, Outputs):
            for wire, out in message.items:
                with self._lock:
                    sink = self._forget(wire) if out.finished else self._sinks.get(wire)
                if sink is not None:
                    _call(sink, out)
        elif isinstance(message, Steps):
            self._stats = message.stats
            if self._on_steps is not None:
                self._on_steps(message.observed, message.stats)
        elif isinstance(message, Stats):
            self._stats = message.stats
        elif isinstance(message, Added):
            self._stats = message.stats
            self._on_added(message)
        elif isinstance(message, RequestFailed):
            with self._lock:
                sink = self._forget(message.wire_id)
            if sink is not None:
                _call(sink, message.error.rebuild())
        elif isinstance(message, Encoded):
            self._stats = message.stats
            with self._lock:
                future = self._encodes.pop(message.token, None)
            if future is not None and future.set_running_or_notify_cancel():  # not cancelled
                if message.error is not None:
                    future.set_exception(message.error.rebuild())
                else:
                    future.set_result(message.reference)

    def _on_added(self, message: Added) -> None:
        wire, error = message.wire_id, message.error
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
                self._send(AbortRequest(wire))
        elif error is not None:
            done.set_exception(error.rebuild())
        else:
            done.set_result(None)

    def _exited(self) -> None:
        """The engine is gone: everything waiting on it fails with the reason."""
        self._transport.join(timeout=5)
        reason = self._transport.exit_reason()
        if not self._stopping:
            log.error("%s: failing the requests in flight", reason)
        self._fail_everything(reason)
        if not self._stopping and self._on_exit is not None:
            try:
                self._on_exit(reason)
            except Exception:  # the service's reaction must not hide the exit itself
                log.exception("reporting the engine's exit failed")

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            self._exit_reason = reason
            sinks, self._sinks, self._wire = self._sinks, {}, {}
            waiting = [*self._added.values(), *self._encodes.values()]
            self._added, self._encodes = {}, {}
        for future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineExited(reason))
        for sink in sinks.values():
            _call(sink, EngineExited(reason))


def _call(sink: Sink, out) -> None:
    try:
        sink(out)
    except Exception:
        log.exception("delivering an output failed")
