"""Per-API-key limits: the utterances one key runs at once (over all its connections and HTTP
requests together) and the audio seconds it was sent in the last minute. An utterance is
admitted when it opens (`admit` gives a lease, or raises RateLimited saying when to retry);
its audio is counted as it goes out, and its lease is released when it ends. An utterance
admitted under the audio limit runs to its end: the limit refuses the next one.

Knows keys only by name (never a key), nothing of transports; the clock is injectable."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0
BUSY_RETRY_S = 1  # when a key's running utterances will end is unknown: try again soon


class RateLimited(Exception):
    """A key over one of its limits: `limit` names which ("utterances" or "audio_seconds"),
    `retry_after_s` (whole seconds, at least 1) when the key is under it again."""

    def __init__(self, limit: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


class _Usage:
    def __init__(self) -> None:
        self.running = 0
        self.audio: deque[list[float]] = deque()  # [second it started, audio seconds], oldest first


class KeyLease:
    """One admitted utterance's hold on its key: its running slot, released once (when it
    stops generating), and its audio, counted as it goes out (also after the release: the
    last chunks leave after the engine is done)."""

    def __init__(self, limits: KeyLimits | None, name: str | None):
        self._limits, self.name = limits, name
        self._held = limits is not None

    def add_audio(self, seconds: float) -> None:
        if self._limits is not None:
            self._limits._add_audio(self.name, seconds)

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self.name)


UNLIMITED = KeyLease(None, None)  # no key, or no per-key limit set


class KeyLimits:
    def __init__(
        self,
        max_utterances: int = 0,
        max_audio_s_per_minute: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
    ):
        """0: that limit is off. `on_refused(name, limit)`: called for each refusal."""
        self.max_utterances = max_utterances
        self.max_audio_s = max_audio_s_per_minute
        self.clock = clock
        self.on_refused = on_refused
        self._usage: dict[str, _Usage] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.max_utterances or self.max_audio_s)

    def admit(self, name: str | None) -> KeyLease:
        """A lease for one more utterance of key `name`; RateLimited when it is over a limit.
        A caller without a key (a server without keys) has no per-key limit."""
        if name is None or not self.enabled:
            return UNLIMITED
        usage = self._usage.setdefault(name, _Usage())
        if self.max_utterances and usage.running >= self.max_utterances:
            self._refused(name, "utterances")
            raise RateLimited(
                "utterances",
                f"the key {name!r} already runs {usage.running} utterances "
                f"(its limit: {self.max_utterances} at once)",
                BUSY_RETRY_S,
            )
        if self.max_audio_s and (spent := self.audio_s(name)) >= self.max_audio_s:
            self._refused(name, "audio_seconds")
            raise RateLimited(
                "audio_seconds",
                f"the key {name!r} was sent {spent:.1f} s of audio in the last minute "
                f"(its limit: {self.max_audio_s:g} s a minute)",
                self._audio_retry_s(usage),
            )
        usage.running += 1
        return KeyLease(self, name)

    def running(self, name: str) -> int:
        usage = self._usage.get(name)
        return usage.running if usage else 0

    def audio_s(self, name: str) -> float:
        """Audio seconds key `name` was sent in the last WINDOW_S."""
        usage = self._usage.get(name)
        if usage is None:
            return 0.0
        self._expire(usage)
        return sum(seconds for _, seconds in usage.audio)

    def _expire(self, usage: _Usage) -> None:
        now = self.clock()
        while usage.audio and usage.audio[0][0] + WINDOW_S <= now:
            usage.audio.popleft()

    def _audio_retry_s(self, usage: _Usage) -> int:
        """Seconds until enough of the window has aged out to be under the limit again."""
        now, left = self.clock(), sum(seconds for _, seconds in usage.audio)
        for started, seconds in usage.audio:
            left -= seconds
            if left < self.max_audio_s:
                return max(1, math.ceil(started + WINDOW_S - now))
        return 1

    def _add_audio(self, name: str, seconds: float) -> None:
        usage = self._usage.setdefault(name, _Usage())
        second = math.floor(self.clock())  # one entry per second: a bounded window
        if usage.audio and usage.audio[-1][0] == second:
            usage.audio[-1][1] += seconds
        else:
            usage.audio.append([second, seconds])

    def _release(self, name: str) -> None:
        usage = self._usage.get(name)
        if usage is None:
            return
        usage.running -= 1
        self._expire(usage)
        if usage.running == 0 and not usage.audio:
            del self._usage[name]  # an idle key holds nothing

    def _refused(self, name: str, limit: str) -> None:
        if self.on_refused is not None:
            self.on_refused(name, limit)
