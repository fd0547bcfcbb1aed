"""How fast one connection may send: a token bucket of `rate_per_s` tokens a second holding
at most `burst`, one token a message. service/ws.py counts a WebSocket's messages with it
(`MessageRate`: messages, then refusals) and service/transport_guards.py its ping frames; it
knows nothing of sockets."""

from __future__ import annotations

import math
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


CLOSE = -1.0  # MessageRate.take: the connection went on at full speed after being told


class MessageRate:
    """A connection's messages: a bucket of them, and one of refusals of the same size and
    rate. A client that slows down when told never runs the second dry; one that goes on at
    full speed does, however refills interleave with its refusals (counting refusals in a row
    instead, a token refilled mid-flood restarted the count: a flood could last for ever
    when the server handled it slowly enough)."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.messages = TokenBucket(rate_per_s, burst, clock)
        self.refusals = TokenBucket(rate_per_s, burst, clock)

    def take(self) -> float:
        """0.0: serve the message; more: refuse it, the next is taken in that many seconds;
        `CLOSE`: close the connection."""
        wait = self.messages.take()
        if wait and self.refusals.take():
            return CLOSE
        return wait


def retry_after_s(wait: float) -> float:
    """`wait` as the client is told it: in whole milliseconds, rounded up (never 0), so that a
    client that waits what it is told finds a token."""
    return max(1, math.ceil(wait * 1000 - 1e-6)) / 1000
