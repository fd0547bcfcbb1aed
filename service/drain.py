"""Graceful shutdown: on SIGTERM (systemd, Kubernetes, a deploy) or SIGINT the server drains
before it stops. `/ready` turns 503 at once (a balancer stops sending), new utterances and
connections are refused with `draining`, running utterances finish for up to
`drain_timeout_s`, the rest are ended with `draining`; then uvicorn shuts down (open
WebSockets close with 1012, service restart) and the process exits 0. A second signal stops
at once. Knows the service only through `Services` (flags, running utterances, sessions).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("clonecast.drain")
POLL_S = 0.05
FLUSH_S = 2.0  # at most this long for the last messages to reach the clients


async def drain(services, timeout_s: float) -> None:
    """Stops taking work and waits for the running utterances (at most `timeout_s`)."""
    services.draining = True  # /ready turns 503 with it
    services.progress = "draining: the server is shutting down"
    loop = asyncio.get_running_loop()
    running = len(services.utterances)
    log.warning("draining: %d utterances running, %g s to finish", running, timeout_s)
    deadline = loop.time() + timeout_s
    while services.utterances and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    left = list(services.utterances)
    for utt in left:
        utt.fail("draining", f"the server shut down before this utterance ended ({timeout_s:g} s)")
    # their last messages (done, these errors) leave before the sockets close
    deadline = loop.time() + FLUSH_S
    while any(not s.outbox.empty() for s in services.sessions) and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    log.warning("drained: %d utterances finished, %d ended", running - len(left), len(left))


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signals drain first (`drain`) and are not re-raised
    after the shutdown: a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, services):
        super().__init__(config)
        self.services = services
        self.draining: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        loop = self.services.loop
        if self.draining is None and loop is not None and not self.should_exit:
            loop.call_soon_threadsafe(self._start_drain)  # a signal handler: not on the loop
        elif self.should_exit:
            self.force_exit = True
        else:  # a second signal, or one before the application started: stop now
            self.should_exit = True

    def _start_drain(self) -> None:
        if self.draining is None:
            self.draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await drain(self.services, self.services.settings.drain_timeout_s)
        except Exception:  # never keep a server that was told to stop
            log.exception("draining failed")
        self.should_exit = True
