"""The engine's side of the channel (service/engine_channel.py): the thread that owns the
Engine and steps it while there is work, the command loop that feeds it, and the entry point
of the engine process. The same code serves an engine in a thread of the server's process;
only the queues differ.

The engine thread hands a step's audio chunks and finishes out in one `Outputs` message (row
events stay here: at 64 streams they are 64 messages a step that nobody reads), so a process
queue's feeder thread wakes once per step. Reference encoding runs in a small thread pool, so
a long HuBERT pass never stalls the step loop. Step statistics are batched: every 50 ms while
busy, at once when the engine goes idle.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine import (
    ConfigError,
    Engine,
    EngineConfig,
    EngineStats,
    Observations,
    RequestOutput,
    StepProfiler,
)
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
    PortableError,
    Ready,
    RequestFailed,
    Stats,
    Steps,
    Stop,
)

log = logging.getLogger("clonecast.engine_host")

STATS_INTERVAL_S = 0.05  # step statistics go to the server at most this often while busy
IDLE_POLL_S = 0.1  # the command loop's wait; an idle engine's stats are re-sent
# Steps failing in a row before the engine gives up: one failure fails its step's requests
# and serving goes on; a run of them means the device is broken (a CUDA error poisons the
# context for good), and only a new process (service/engine_supervisor.py) can recover.
MAX_FAILED_STEPS = 3


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


def settle_garbage_collector() -> None:
    """Once everything is loaded: the start-up objects (model, tokenizer, graphs) move to
    the permanent generation, and young collections run less often. Without this, a full
    collection now and then scans every request's rows and stalls one engine step by several
    milliseconds (docs/perf-log/)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


class _StatsSender:
    """Step statistics and observations to the server: batched while busy, at once when the
    engine goes idle or when they changed without a step (an abort, a voice encode). Steps
    always travel with the statistics taken right after the last of them: its running totals
    (the phases of step time, the rows) then cover exactly the steps reported so far."""

    def __init__(self, events, engine: Engine):
        self.events, self.engine = events, engine
        self.lock = threading.Lock()
        self.observed = Observations()
        self.observed_stats: EngineStats | None = None  # taken after the last step observed
        self.last_sent = 0.0
        self.last_stats: EngineStats | None = None

    def on_step(self, seconds: float, stats: EngineStats) -> None:  # the engine thread
        observed = self.engine.take_observations()
        with self.lock:
            self.observed.extend(observed)
            self.observed_stats = stats
            now = time.monotonic()
            idle = not (stats.num_running or stats.num_waiting)
            if idle or now - self.last_sent >= STATS_INTERVAL_S:
                self._send_steps(now)

    def refresh(self) -> None:  # the command loop, when no command came for a while
        # Read from this thread while the engine may be mid-step: good for the gauges, but
        # its totals may count part of a step whose time is not observed yet, so it never
        # goes with steps. Read under the lock: never sent after a newer report of steps.
        with self.lock:
            stats = self.engine.stats
            now = time.monotonic()
            if self.observed:  # steps not sent yet (the last ones came within the interval)
                self._send_steps(now)
            if stats != self.last_stats:
                self.events.put(Stats(stats))
                self.last_stats = stats
            self.last_sent = now

    def _send_steps(self, now: float) -> None:
        self.events.put(Steps(self.observed, self.observed_stats))
        self.observed, self.last_sent, self.last_stats = Observations(), now, self.observed_stats


class EngineHost:
    """Owns the Engine: its thread applies AddRequest / AbortRequest and steps; EncodeVoice
    runs in the encoder pool; events go to `events.put`."""

    def __init__(self, engine: Engine, events, profile=None):
        self.engine = engine
        self.events = events
        self.stats = _StatsSender(events, engine)
        self._on_step = self.stats.on_step
        if profile is not None:  # ServiceSettings.profile
            skip, steps, path, mode, min_running = profile
            self._on_step = StepProfiler(
                skip, steps, path, self._on_step, mode, min_running
            ).on_step
        self._pending: queue.SimpleQueue = queue.SimpleQueue()  # to the engine thread
        self._live: set[str] = set()  # wire ids whose events go out (the engine thread's)
        self._stop = threading.Event()
        self.broken = False  # the engine thread gave up (MAX_FAILED_STEPS)
        self._thread = threading.Thread(target=self._run, name="clonecast-engine", daemon=True)
        self.encoder_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="encode")
        self._encodes: dict[int, concurrent.futures.Future] = {}  # queued or running, by token

    def start(self) -> None:
        self._thread.start()
        self.events.put(Ready(EngineInfo.of(self.engine), self.engine.stats))

    def stop(self) -> None:
        self._stop.set()
        self._pending.put(None)
        self._thread.join(timeout=10)
        self.encoder_pool.shutdown(wait=False, cancel_futures=True)

    def serve(self, commands, parent_alive=lambda: True) -> bool:
        """Applies the server's commands until Stop (False), until the server is gone (True),
        or until the engine thread has died (True: whoever waits on it learns it from the
        end of this loop, the engine process's exit or the engine thread's)."""
        while True:
            try:
                command = commands.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if not parent_alive():  # the server was killed: do not outlive it
                    log.warning("the server process is gone: the engine exits")
                    return True
                if not self._thread.is_alive():
                    log.error("the engine thread has died: the engine exits")
                    return True
                self.stats.refresh()
                continue
            if isinstance(command, Stop):
                return False
            if not self._thread.is_alive():  # also while commands keep coming
                log.error("the engine thread has died: the engine exits")
                return True
            if isinstance(command, EncodeVoice):
                future = self.encoder_pool.submit(
                    self.engine.encode_reference, command.audio, command.transcript
                )
                self._encodes[command.token] = future
                future.add_done_callback(lambda f, t=command.token: self._encoded(t, f))
            elif isinstance(command, CancelEncode):
                future = self._encodes.get(command.token)
                if future is not None:
                    future.cancel()  # only if still queued
            else:
                self._pending.put(command)

    def _encoded(self, token: int, future: concurrent.futures.Future) -> None:
        self._encodes.pop(token, None)
        if future.cancelled():  # queued encodes dropped at shutdown or by CancelEncode
            return
        error = future.exception()
        reference = None if error else future.result()
        error = PortableError.of(error) if error else None
        self.events.put(Encoded(token, reference, error, self.engine.stats))

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        failed_steps = 0
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
            except Exception as exc:  # fail what is running, keep serving the others
                log.exception("engine step failed")
                self._fail_all(exc)
                failed_steps += 1
                if failed_steps >= MAX_FAILED_STEPS:
                    log.error("%d engine steps failed in a row: the engine exits", failed_steps)
                    self.broken = True
                    return
                continue
            failed_steps = 0
            try:
                self._on_step(time.perf_counter() - t0, self.engine.stats)
            except Exception:  # the statistics or the profiler: never the engine's end
                log.exception("reporting a step failed")

    def _drain(self, block: bool) -> None:
        try:
            command = self._pending.get(timeout=0.5) if block else self._pending.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._pending.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: AddRequest | AbortRequest) -> None:
        if isinstance(command, AbortRequest):
            if self.engine.abort(command.wire_id):
                self._live.discard(command.wire_id)
            return
        error = None
        try:
            self.engine.add_request(
                command.wire_id,
                command.text,
                reference=command.reference,
                params=command.params,
                audio=True,
            )
            self._live.add(command.wire_id)
        except ConfigError as exc:
            error = exc
        except Exception as exc:  # a bug: the caller must not wait forever
            log.exception("adding request %s failed", command.wire_id)
            error = exc
        portable = PortableError.of(error) if error is not None else None
        # sent before any event of the request: those come from a later step of this thread
        self.events.put(Added(command.wire_id, portable, self.engine.stats))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's audio and finishes (without their rows: the service reads neither) in one
        message; row-only events stay here."""
        items = []
        for out in outputs:
            if out.audio is None and not out.finished:
                continue
            wire = out.request_id
            if wire not in self._live:
                continue
            if out.finished:
                self._live.discard(wire)
            items.append(
                (
                    wire,
                    RequestOutput(
                        wire, [], out.finished, out.finish_reason, None, out.audio, out.error
                    ),
                )
            )
        if items:
            self.events.put(Outputs(items))

    def _fail_all(self, exc: Exception) -> None:
        error = PortableError.of(exc)
        for wire in sorted(self._live):
            try:
                self.engine.abort(wire)
            except Exception:  # its failure is reported all the same
                log.exception("aborting %s after a failed step failed", wire)
            self.events.put(RequestFailed(wire, error))
        self._live.clear()


def process_main(spec: EngineSpec, commands, events) -> None:
    """The engine process: loads the engine, then serves the server's commands."""
    # Ctrl-C in a terminal, or a SIGTERM to the whole process group, must not stop the engine
    # under requests the server is still draining: it stops on Stop or when the server dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s clonecast-engine %(levelname)s %(message)s"
    )
    try:
        engine = Engine.from_pretrained(
            spec.model, spec.config, codec=spec.codec, cache_dir=spec.cache_dir
        )
    except BaseException as exc:  # the server reports it and exits
        log.exception("loading the engine failed")
        events.put(LoadFailed(PortableError.of(exc)))
        return
    host = EngineHost(engine, events, spec.profile)
    try:
        host.start()
        settle_garbage_collector()
        sys.setswitchinterval(spec.gil_switch_ms / 1000)
        orphaned = host.serve(commands, multiprocessing.parent_process().is_alive)
    finally:
        host.stop()
    if host.broken:  # the requests' failures reach the server, then a non-zero exit
        events.close()
        events.join_thread()
        os._exit(1)
    if orphaned:
        # Nobody reads the events any more: the queue's feeder thread may block on a full
        # pipe forever, and a normal exit would wait for it (holding the GPU). Leave now.
        os._exit(0)


def thread_main(engine: Engine, commands, events, profile=None) -> None:
    """An engine of the server's own process, served by the same loop from a thread;
    `profile` as the engine process's (ServiceSettings.profile)."""
    host = EngineHost(engine, events, profile)
    try:
        host.start()
        host.serve(commands)
    finally:
        host.stop()
