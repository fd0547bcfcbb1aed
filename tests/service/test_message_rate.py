"""The token bucket of the per-connection message and ping limits, on an injected clock; and
the settings that configure it and the HTTP deadlines."""

from __future__ import annotations

import pytest

from service.config import Limits, ServiceSettings
from service.message_rate import TokenBucket


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
