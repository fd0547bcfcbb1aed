"""Per-key limits on their own (service/key_limits.py), on an injected clock: utterances at
once, audio seconds in a sliding minute, when to retry, and nothing held by an idle key."""

from __future__ import annotations

import pytest

from service.key_limits import KeyLimits, RateLimited


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_utterances_at_once_are_capped_per_key_and_freed_by_release():
    refused = []
    limits = KeyLimits(max_utterances=2, on_refused=lambda *a: refused.append(a))
    a1, a2 = limits.admit("alice"), limits.admit("alice")
    limits.admit("bob")  # another key has its own count
    with pytest.raises(RateLimited) as info:
        limits.admit("alice")
    assert info.value.limit == "utterances" and info.value.retry_after_s == 1
    assert "alice" in str(info.value) and refused == [("alice", "utterances")]
    a1.release()
    a1.release()  # once only
    assert limits.running("alice") == 1
    limits.admit("alice")
    a2.release()
    assert limits.running("alice") == 1


def test_audio_seconds_in_the_last_minute_refuse_the_next_utterance_until_they_age_out():
    clock = Clock()
    limits = KeyLimits(max_audio_s_per_minute=10.0, clock=clock)
    lease = limits.admit("alice")
    lease.add_audio(4.0)
    clock.t += 20
    lease.add_audio(7.0)  # 11 s in the window: this one ran past the limit, the next waits
    lease.release()
    lease.add_audio(0.5)  # the last chunks leave after the release: still counted
    assert limits.audio_s("alice") == pytest.approx(11.5)
    with pytest.raises(RateLimited) as info:
        limits.admit("alice")
    # the first 4 s leave the window 60 s after they came (40 s from now): 7.5 s remain
    assert info.value.limit == "audio_seconds" and info.value.retry_after_s == 40
    limits.admit("bob").release()
    clock.t += 39
    with pytest.raises(RateLimited):
        limits.admit("alice")
    clock.t += 1
    assert limits.audio_s("alice") == pytest.approx(7.5)
    limits.admit("alice").release()


def test_retry_after_is_when_enough_has_aged_out_rounded_up():
    clock = Clock(0.0)
    limits = KeyLimits(max_audio_s_per_minute=5.0, clock=clock)
    lease = limits.admit("k")
    for _ in range(3):
        lease.add_audio(3.0)  # 9 s: two entries must leave to be under 5
        clock.t += 10.5
    with pytest.raises(RateLimited) as info:
        limits.admit("k")
    # entries at 0, 10 and 21 (whole seconds); now 31.5: the second leaves at 70
    assert info.value.retry_after_s == 39


def test_no_key_or_no_limit_is_never_refused_and_an_idle_key_holds_nothing():
    limits = KeyLimits(max_utterances=1, max_audio_s_per_minute=1.0)
    for _ in range(3):
        limits.admit(None).add_audio(100.0)  # a server without keys
    off = KeyLimits()
    assert not off.enabled
    for _ in range(3):
        off.admit("alice")
    lease = limits.admit("alice")
    lease.release()
    assert limits._usage == {}  # released, no audio in the window: forgotten


def test_the_settings_default_to_off_and_a_bad_value_names_the_variable():
    from service.config import ServiceSettings

    off = ServiceSettings.from_env({}).limits
    assert off.max_utterances_per_key == 0 and off.max_audio_s_per_minute_per_key == 0
    env = {
        "CLONECAST_MAX_UTTERANCES_PER_KEY": "4",
        "CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY": "90.5",
        "CLONECAST_API_KEY_FILE": "/etc/clonecast/keys",
    }
    settings = ServiceSettings.from_env(env)
    assert settings.limits.max_utterances_per_key == 4
    assert settings.limits.max_audio_s_per_minute_per_key == 90.5
    assert str(settings.api_key_file) == "/etc/clonecast/keys"
    for name, bad in (
        ("CLONECAST_MAX_UTTERANCES_PER_KEY", "-1"),
        ("CLONECAST_MAX_UTTERANCES_PER_KEY", "two"),
        ("CLONECAST_MAX_AUDIO_S_PER_MINUTE_PER_KEY", "nan"),
    ):
        with pytest.raises(ValueError, match=name):
            ServiceSettings.from_env({name: bad})
