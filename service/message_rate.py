"""How fast one connection may send: a token bucket of `rate_per_s` tokens a second holding
at most `burst`, one token a message. service/ws.py counts a WebSocket's messages with it and
service/transport_guards.py its ping frames; it knows nothing of sockets."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)  # a new connection may send a whole burst at once
        self.stamp = clock()

    def take(self) -> float:
        """Takes a token: 0.0 when there was one, else the seconds until there will be one
        (and nothing is taken: a refused message costs the sender nothing more)."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate_per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s
