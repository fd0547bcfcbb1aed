"""The server's engines: one per device (CLONECAST_DEVICES) or N on one device
(CLONECAST_ENGINES, on the CPU), each in its own process by default (or one in a thread of
this process, for tests and debugging). Starts them together, warms each up, supervises each
on its own (service/engine_supervisor.py: one engine's death ends only its own streams) and
routes each utterance (service/engine_router.py). Knows nothing of HTTP or WebSockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

from engine import ConfigError, Engine, EngineConfig, SamplingParams
from service.engine_client import EngineClient, EngineExited
from service.engine_host import EngineSpec, settle_garbage_collector
from service.engine_router import EngineRouter, EngineSlot, RoutingPolicy
from service.engine_supervisor import EngineSupervisor, RestartPolicy

log = logging.getLogger("clonecast.engines")
WARM_UP_TIMEOUT_S = 300.0  # a warm-up that takes longer: the engine is stuck (a failed start)


class Engines:
    """`services` gives the settings, metrics, the flags `stopping` / `draining`, the event
    loop and `give_up(reason)`; `make_spec(device)` the engine process's EngineSpec and
    `make_config(device)` an in-thread engine's EngineConfig."""

    def __init__(
        self,
        services,
        devices: list[str],
        make_config: Callable[[str], EngineConfig],
        make_spec: Callable[[str], EngineSpec],
        engine: Engine | None = None,
    ):
        self.services = services
        self.make_config, self.make_spec = make_config, make_spec
        settings = services.settings
        self.slots = [EngineSlot(i, device) for i, device in enumerate(devices)]
        self.slots[0].engine = engine  # a given engine object: served in a thread
        restart = RestartPolicy(settings.engine_restarts)
        for slot in self.slots:
            slot.supervisor = EngineSupervisor(self, slot, restart)
        policy = RoutingPolicy(settings.affinity_slack, settings.voice_affinity)
        self.router = EngineRouter(self.slots, policy)
        self._lock = threading.Lock()  # a start finishing against a stop (`start`, `stop`)

    # -- what the service asks ----------------------------------------------------------------

    @property
    def primary(self) -> EngineClient | None:
        """An engine client for what any engine answers alike (text checks, model info):
        the first ready one, else the first started."""
        clients = [s.client for s in self.slots if s.ready] or [
            s.client for s in self.slots if s.client is not None
        ]
        return clients[0] if clients else None

    @property
    def num_ready(self) -> int:
        return sum(slot.ready for slot in self.slots)

    @property
    def num_waiting(self) -> int:
        return sum(s.client.num_waiting for s in self.slots if s.client is not None)

    @property
    def restarting(self) -> bool:
        return any(slot.supervisor.restarting for slot in self.slots)

    @property
    def restarts_enabled(self) -> bool:
        return self.slots[0].supervisor.policy.max_attempts > 0

    def least_loaded(self) -> EngineClient | None:
        """The ready engine with the fewest requests in flight (a voice to encode)."""
        ready = [s for s in self.slots if s.ready]
        return min(ready, key=lambda s: s.load).client if ready else None

    def pick(self, voice: str | None) -> EngineClient | None:
        """The engine client for an utterance in `voice` (None when no engine is ready)."""
        picked = self.router.pick(voice)
        if picked is None:
            return None
        slot, reason = picked
        self.services.metrics.engine(slot.index).routed[reason].inc()
        return slot.client

    # -- starting and stopping ----------------------------------------------------------------

    def start_all(self) -> None:
        """Starts every engine at once (blocks until all are loaded); one that fails stops
        the others and raises its error."""
        if len(self.slots) == 1:
            self.start(self.slots[0])
            return
        with concurrent.futures.ThreadPoolExecutor(len(self.slots)) as pool:
            futures = [pool.submit(self.start, slot) for slot in self.slots]
            errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self.stop()
            raise errors[0]

    def start(self, slot: EngineSlot) -> None:
        """A new engine client for `slot`, started (blocks while it loads), in place of its
        last one. That one is stopped first (a dead engine's queues are released, a live but
        useless one frees its device for the new one) and kept until then: its model info
        still answers."""
        services, settings = self.services, self.services.settings
        metrics = services.metrics.engine(slot.index)
        if slot.client is not None:
            slot.client.stop()

        def on_exit(reason: str) -> None:  # the client's reader thread
            if services.loop is not None:
                services.loop.call_soon_threadsafe(self._exited, slot, reason)

        if slot.engine is None and settings.engine_process:
            spec = self.make_spec(slot.device)
            client = EngineClient.in_process(spec, metrics.observe_steps, on_exit)
        else:
            if slot.engine is None:
                slot.engine = Engine.from_pretrained(
                    settings.model,
                    self.make_config(slot.device),
                    codec=settings.codec,
                    cache_dir=settings.cache_dir,
                )
            client = EngineClient.in_thread(
                slot.engine, metrics.observe_steps, on_exit, settings.profile
            )
        try:
            client.start()
            if not client.info.has_codec:
                raise ConfigError(
                    "the service needs a codec: the checkpoint bundles none; set CLONECAST_CODEC"
                )
        except BaseException:
            client.stop()
            raise
        with self._lock:
            if services.stopping:  # stopped while it loaded: nobody would stop it later
                client.stop()
                raise EngineExited("the server stopped while the engine started")
            slot.client = client
        metrics.new_engine()

    async def warm_up(self, slot: EngineSlot) -> None:
        """One short request end to end, so the first client does not pay for lazy set-up."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def sink(out):
            if isinstance(out, BaseException) or out.finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        params = SamplingParams(seed=0, max_rows=24)
        client = slot.client
        await asyncio.wrap_future(client.submit("warm-up", "Warming up.", None, params, sink))
        try:
            result = await asyncio.wait_for(done, WARM_UP_TIMEOUT_S)
        except TimeoutError:
            client.stop()
            raise EngineExited(f"the engine's warm-up took over {WARM_UP_TIMEOUT_S:g} s") from None
        if isinstance(result, BaseException):
            raise result
        self.services.metrics.engine(slot.index).update(client.stats)
        settle_garbage_collector()
        slot.warmed = True

    async def warm_up_all(self) -> None:
        await asyncio.gather(*(self.warm_up(slot) for slot in self.slots))
        for slot in self.slots:
            slot.supervisor.engine_started()

    def stop(self) -> None:
        with self._lock:  # `services.stopping` is set: a start under way stops its own
            clients = [slot.client for slot in self.slots if slot.client is not None]
        for client in clients:
            client.stop()

    async def stop_supervisors(self) -> None:
        await asyncio.gather(*(slot.supervisor.stop() for slot in self.slots))

    # -- the supervisors' side ----------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.services.stopping

    @property
    def draining(self) -> bool:
        return self.services.draining

    @property
    def metrics(self):
        return self.services.metrics

    @property
    def progress(self) -> str:
        return self.services.progress

    @progress.setter
    def progress(self, text: str) -> None:  # what /ready says while no engine is ready
        self.services.progress = text

    def _exited(self, slot: EngineSlot, reason: str) -> None:
        """On the event loop: `slot`'s engine died (its requests have already failed)."""
        slot.warmed = False
        if slot.failed is None:
            slot.supervisor.engine_exited(self.name(slot, reason))

    def name(self, slot: EngineSlot, text: str) -> str:
        """`text` about `slot`'s engine, naming it when there are several."""
        return f"engine {slot.index} ({slot.device}): {text}" if len(self.slots) > 1 else text

    def give_up(self, slot: EngineSlot, reason: str) -> None:
        """`slot`'s engine failed every restart: it is left out; the server gives up when
        no engine is left."""
        slot.failed = reason
        if slot.client is not None:  # frees its device
            slot.client.stop()
        if all(s.failed is not None for s in self.slots):
            self.services.give_up(reason)
        else:
            log.error("engine %d is left out: %s", slot.index, reason)
