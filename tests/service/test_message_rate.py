"""The token bucket of the per-connection message and ping limits and the message rate built
on it (when a flood is closed), on an injected clock; and the settings that configure them
and the HTTP deadlines."""

from __future__ import annotations

import pytest

from service.config import Limits, ServiceSettings
from service.message_rate import CLOSE, MessageRate, TokenBucket, retry_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_at_once_then_the_rate_and_refusals_say_when():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=4.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.25)  # a token every 0.25 s
    clock.now += 0.1
    assert bucket.take() == pytest.approx(0.15)  # a refusal takes nothing
    clock.now += 0.15
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.25)


def test_an_idle_bucket_refills_to_its_burst_and_no_further():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10.0, burst=2, clock=clock)
    bucket.take(), bucket.take()
    clock.now += 3600
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, pytest.approx(0.1)]


def _flood(rate: MessageRate, clock: Clock, gap_s: float, messages: int) -> list[float]:
    """What `rate.take` says to `messages` sent `gap_s` apart, up to the close if any."""
    said = []
    for _ in range(messages):
        said.append(rate.take())
        if said[-1] == CLOSE:
            break
        clock.now += gap_s
    return said


def test_a_flood_is_closed_even_when_tokens_refill_between_its_refusals():
    """Four messages a token (a message every 5 ms at 50 a second): after the burst every
    fourth is served, never more than 3 refused in a row, yet the client ignores every
    refusal. Its refusals outrun their own bucket (150 a second against 50 forgiven)."""
    clock = Clock()
    said = _flood(MessageRate(rate_per_s=50.0, burst=3, clock=clock), clock, 0.005, 400)
    assert said[-1] == CLOSE and len(said) < 50
    assert said[:3] == [0.0] * 3 and 0.0 in said[4:-1]  # served between refusals
    in_a_row = max(len(run) for run in "".join("x" if w else "." for w in said[:-1]).split("."))
    assert in_a_row <= 3  # the burst: refusals in a row alone would never close it


def test_a_client_that_slows_down_when_told_is_never_closed():
    """A burst as fast as it can, then, refused, it waits the retry_after_s it was told and
    sends at the rate: served for ever. A client a little over the rate (its refusals under
    the rate that forgives them) is refused now and then and stays too."""
    clock = Clock()
    rate = MessageRate(rate_per_s=50.0, burst=3, clock=clock)
    gap = 0.001
    for _ in range(1000):
        wait = rate.take()
        assert wait != CLOSE
        if wait:
            clock.now, gap = clock.now + retry_after_s(wait), 1 / 50
        else:
            clock.now += gap
    clock = Clock()
    said = _flood(MessageRate(rate_per_s=50.0, burst=3, clock=clock), clock, 0.012, 2000)
    assert CLOSE not in said and 0.0 < said.count(0.0) / len(said) < 1.0


def test_the_wait_a_client_is_told_is_rounded_up_to_whole_milliseconds():
    """Never shorter than the real wait but for float noise (5.000000000001 s is told 5.0);
    told to the nearest instead, a client could come back up to 0.5 ms early."""
    assert [retry_after_s(w) for w in (1e-9, 0.0123, 0.0125, 0.017, 5.000000000001)] == [
        0.001,
        0.013,
        0.013,
        0.017,
        5.0,
    ]


def test_the_limits_are_read_from_the_environment_and_validated(monkeypatch):
    monkeypatch.setenv("CLONECAST_MAX_MESSAGES_PER_S", "7.5")
    monkeypatch.setenv("CLONECAST_MESSAGE_BURST", "12")
    monkeypatch.setenv("CLONECAST_HEADER_TIMEOUT_S", "3")
    monkeypatch.setenv("CLONECAST_BODY_TIMEOUT_S", "30")
    limits = ServiceSettings.from_env().limits
    assert (limits.max_messages_per_s, limits.message_burst) == (7.5, 12)
    assert (limits.header_timeout_s, limits.body_timeout_s) == (3.0, 30.0)
    for bad in (
        {"max_messages_per_s": 0},
        {"max_messages_per_s": float("nan")},
        {"message_burst": 0},
        {"header_timeout_s": -1},
        {"body_timeout_s": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)
