"""The server's engines and which one takes each utterance. Each engine (one per device:
CLONECAST_DEVICES, or CLONECAST_ENGINES on the CPU) sits in a slot with its client and its
supervisor, and fails and restarts on its own. An utterance goes to the least loaded ready
engine, unless an engine that served its voice recently (and so holds the voice's prompt
prefix in its KV cache) is ready and not clearly busier: within `affinity_slack` utterances
of the least loaded. Load is counted here (utterances routed and still running), not read
from the engines' statistics, which lag a poll interval behind a burst of arrivals: an
engine's load is its requests in flight as its client counts them (submitted, not ended).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoutingPolicy:
    affinity_slack: int = 4  # extra requests in flight a voice's engine may have and still win
    affinity: bool = True  # False: always the least loaded (to measure what affinity brings)
    max_remembered_voices: int = 4096  # voice -> engine entries kept (least recent dropped)

    def __post_init__(self) -> None:
        if self.affinity_slack < 0:
            raise ValueError("the affinity slack must be >= 0")
        if self.max_remembered_voices < 1:
            raise ValueError("at least one voice must be remembered")


@dataclass(eq=False)
class EngineSlot:
    """One engine of the server: `client` (an EngineClient, None until first started),
    `warmed` once its warm-up request has run (False again when it dies)."""

    index: int
    device: str
    client: object | None = None
    supervisor: object | None = None
    engine: object | None = None  # an Engine object served in a thread of this process
    warmed: bool = False
    failed: str | None = None  # why it was given up (every restart failed)
    last_pick: int = field(default=0)  # when it was last chosen (spreads equal loads)

    @property
    def load(self) -> int:
        return self.client.in_flight if self.client is not None else 0

    @property
    def ready(self) -> bool:
        return self.warmed and self.failed is None and self.client is not None and self.client.alive


class EngineRouter:
    def __init__(self, slots: list[EngineSlot], policy: RoutingPolicy):
        self.slots, self.policy = slots, policy
        self._homes: OrderedDict[str, EngineSlot] = OrderedDict()  # voice -> its engine
        self._picks = itertools.count(1)

    def pick(self, voice: str | None) -> tuple[EngineSlot, str] | None:
        """(the slot, "affinity" or "least_loaded") for an utterance in `voice` (its id; None:
        no reference voice, whose short prompt every engine holds), or None when no engine is
        ready."""
        ready = [s for s in self.slots if s.ready]
        if not ready:
            return None
        least = min(ready, key=lambda s: (s.load, s.last_pick))
        home = self._homes.get(voice) if voice is not None and self.policy.affinity else None
        slack = self.policy.affinity_slack
        if home is not None and home.ready and home.load <= least.load + slack:
            chosen, reason = home, "affinity"
        else:
            chosen, reason = least, "least_loaded"
        chosen.last_pick = next(self._picks)
        if voice is not None:
            self._homes[voice] = chosen
            self._homes.move_to_end(voice)
            while len(self._homes) > self.policy.max_remembered_voices:
                self._homes.popitem(last=False)
        return chosen, reason
