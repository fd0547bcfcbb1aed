"""Keeps the engine serving: when its process dies (killed, out of memory, a CUDA error that
made it exit), the client has already failed every request in flight with
`generation_failed`; this starts a new engine process, warms it up and turns `/ready` back
to 200, without restarting the server. Voices live in the server, so they survive.

Restarts are bounded: after `max_attempts` in a row without an engine that served for
`stable_s`, the server gives up and exits (status 1), so that systemd or Kubernetes, which
can do more (another node, an operator's page), take over. Runs on the event loop; knows
nothing of HTTP or WebSockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("clonecast.engine_supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    max_attempts: int = 5  # restarts in a row before giving up; 0: never restart
    first_delay_s: float = 1.0  # before the first attempt; doubled for each further one
    max_delay_s: float = 30.0
    stable_s: float = 60.0  # an engine that served this long resets the count

    def __post_init__(self) -> None:
        if self.max_attempts < 0:
            raise ValueError("engine restart attempts must be >= 0")
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError("restart delays must satisfy 0 <= first <= max")

    def delay(self, attempt: int) -> float:
        """The wait before restart `attempt` (1, 2, ...)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1))


class EngineSupervisor:
    """Supervises the engine of one slot. `owner` (service/engines.py) provides
    `start(slot)` (blocking: a new engine client, started), `warm_up(slot)` (async: one
    request through it, then ready), `give_up(slot, reason)`, `metrics`, `progress` and the
    flags `stopping` / `draining`."""

    def __init__(self, owner, slot, policy: RestartPolicy, clock=time.monotonic):
        self.owner, self.slot, self.policy, self.clock = owner, slot, policy, clock
        self.attempts = 0  # restarts in a row so far
        self.started_at = clock()
        self.task: asyncio.Task | None = None
        self.restarting = False

    def engine_started(self) -> None:
        self.started_at = self.clock()

    def engine_exited(self, reason: str) -> None:
        """On the event loop, once the engine is gone (its requests have already failed)."""
        owner = self.owner
        if owner.stopping or owner.draining or self.restarting:
            return
        if self.policy.max_attempts == 0:
            owner.progress = f"{reason}; restarts are off (CLONECAST_ENGINE_RESTARTS=0)"
            return
        if self.clock() - self.started_at >= self.policy.stable_s:
            self.attempts = 0
        self.restarting = True
        self.task = asyncio.get_running_loop().create_task(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        owner, policy = self.owner, self.policy
        try:
            while True:
                if self.attempts >= policy.max_attempts:
                    owner.give_up(
                        self.slot,
                        f"the engine failed {self.attempts} restarts in a row; last: {reason}",
                    )
                    return
                self.attempts += 1
                delay = policy.delay(self.attempts)
                owner.progress = (
                    f"restarting the engine (attempt {self.attempts} of {policy.max_attempts}, "
                    f"in {delay:.0f} s) after: {reason}"
                )
                log.error("%s: restarting it in %.1f s", reason, delay)
                await asyncio.sleep(delay)
                if owner.stopping or owner.draining:
                    return
                try:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, owner.start, self.slot)
                    await owner.warm_up(self.slot)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    reason = owner.name(self.slot, f"the restarted engine failed: {exc}")
                    continue
                if not self.slot.client.alive:  # it died again before this resumed
                    reason = owner.name(self.slot, "the restarted engine died at once")
                    self.slot.warmed = False
                    continue
                self.engine_started()
                owner.metrics.engine(self.slot.index).restarts.inc()
                owner.progress = "ready"
                log.warning(owner.name(self.slot, "serving again (restart %d)"), self.attempts)
                return
        finally:
            self.restarting = False

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.restarting = False  # also when it was cancelled before it began
