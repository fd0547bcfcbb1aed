"""The soak's load (benchmarks/soak.py): `Load` runs N clients, each looping over scenarios
drawn by weight, and tallies every request by scenario and outcome. A scenario checks what
it gets against what the protocol promises (benchmarks/soak_conn.py reads the streams) and
returns its outcomes ("done", "cancelled", "disconnected", "error:CODE"); anything else is a
failure with its detail. The normal scenarios are here, the faults and bad inputs in
benchmarks/soak_faults.py."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import time
import wave
from collections import Counter
from dataclasses import dataclass, field

import httpx

from benchmarks.soak_conn import Conn, Unexpected, UtteranceReader, next_item, until_first_audio

TEXTS = (
    "Thanks for calling, how can I help you today?",
    "The package will arrive on Thursday. Please sign for it at the door.",
    "Please hold while I transfer you.",
    "Your appointment is confirmed for Monday at three.",
    "I can read that back to you one more time if you like.",
)
FORMATS = (("pcm16", 24000), ("f32", 24000), ("mulaw", 8000), ("wav", 16000), ("pcm16", 48000))
SCENARIO_TIMEOUT_S = 120.0


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (scenario, outcome) -> count
    failures: Counter = field(default_factory=Counter)  # scenario -> count
    details: list[str] = field(default_factory=list)  # the first failures, for the report

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values()) + sum(self.failures.values())

    def fail(self, scenario: str, detail: str) -> None:
        self.failures[scenario] += 1
        if len(self.details) < 40:
            self.details.append(f"{scenario}: {detail}")


@dataclass
class Client:
    """One simulated user: its connection (reopened when a scenario ended it), its HTTP
    client, its random stream and its own churn recordings (no other client deletes them)."""

    index: int
    load: Load
    rng: random.Random
    http: httpx.AsyncClient
    churn: list[tuple[bytes, str]]
    conn: Conn | None = None
    counter: int = 0

    def next_id(self, prefix: str = "u") -> str:
        self.counter += 1
        return f"{prefix}{self.index}-{self.counter}"

    async def connection(self) -> Conn:
        if self.conn is None or self.conn.closed:
            self.conn = await Conn.open(self.load.ws_url)
        return self.conn

    def params(self, seconds: float | None = None) -> dict:
        return {
            "seed": self.rng.randrange(1 << 30),
            "max_duration_s": round(seconds or self.rng.uniform(0.3, self.load.max_duration_s), 2),
        }

    def speak(self, uid: str, **fields) -> dict:
        message = {"type": "speak", "id": uid, "text": self.rng.choice(TEXTS)}
        message["params"] = self.params()
        return {**message, "request_id": "r" + uid, **fields}


@dataclass
class Load:
    ws_url: str
    http_url: str
    voice_ids: list[str]  # registered voices (ids and names)
    inline: list[tuple[bytes, str]]  # recordings sent inline with a speak
    max_duration_s: float
    tally: Tally = field(default_factory=Tally)
    stop_at: float = 0.0
    max_requests: int = 0  # 0: until stop_at

    def running(self) -> bool:
        if self.max_requests and self.tally.requests >= self.max_requests:
            return False
        return time.monotonic() < self.stop_at


async def run_one(client: Client, name: str, scenario) -> None:
    tally = client.load.tally
    try:
        outcomes = await asyncio.wait_for(scenario(client), SCENARIO_TIMEOUT_S)
    except Unexpected as e:
        tally.fail(name, str(e))
    except TimeoutError:
        tally.fail(name, f"no end in {SCENARIO_TIMEOUT_S:.0f} s")
    except Exception as e:  # a crashed scenario is a failure of the run, never hidden
        tally.fail(name, f"{type(e).__name__}: {e}")
    else:
        for outcome in outcomes:
            tally.outcomes[name, outcome] += 1
    if client.conn is not None and client.conn.stray:
        for stray in client.conn.stray:
            tally.fail(name, "stray message: " + stray)
        client.conn.stray.clear()


async def client_loop(client: Client, weights: dict) -> None:
    names, scenarios = list(weights), [weights[n][0] for n in weights]
    draw = [weights[n][1] for n in names]
    while client.load.running():
        i = client.rng.choices(range(len(names)), draw)[0]
        await run_one(client, names[i], scenarios[i])
    if client.conn is not None:
        await client.conn.close()


async def utterance(conn: Conn, message: dict, timeout: float = SCENARIO_TIMEOUT_S) -> str:
    """Sends one speak (or the opening append) and reads its stream to its end."""
    queue = conn.expect(message["id"], message["request_id"])
    try:
        await conn.send(message)
        return await UtteranceReader(queue, message["id"]).until_end(time.monotonic() + timeout)
    finally:
        conn.forget(message["id"], message["request_id"])


def expect_done(outcome: str) -> list[str]:
    if outcome != "done":
        raise Unexpected(f"expected done, got {outcome}")
    return [outcome]


async def speak_voice(c: Client) -> list[str]:
    fmt, rate = c.rng.choice(FORMATS)
    message = c.speak(c.next_id(), voice_id=c.rng.choice(c.load.voice_ids))
    message["output"] = {"format": fmt, "sample_rate": rate}
    return expect_done(await utterance(await c.connection(), message))


async def speak_default(c: Client) -> list[str]:
    return expect_done(await utterance(await c.connection(), c.speak(c.next_id())))


async def speak_inline(c: Client) -> list[str]:
    audio, transcript = c.rng.choice(c.load.inline)
    voice = {"audio_b64": base64.b64encode(audio).decode(), "transcript": transcript}
    return expect_done(await utterance(await c.connection(), c.speak(c.next_id(), voice=voice)))


async def stream(c: Client) -> list[str]:
    """append, append, flush: `flushed`, then `done`."""
    conn, uid = await c.connection(), c.next_id()
    queue = conn.expect(uid, "r" + uid)
    reader = UtteranceReader(queue, uid)
    opening = {"voice_id": c.rng.choice(c.load.voice_ids), "params": c.params()}
    try:
        await conn.send({"type": "append", "id": uid, "text": "Hello there. How ", **opening})
        await conn.send({"type": "append", "id": uid, "text": "are you today"})
        await conn.send({"type": "flush", "id": uid})
        outcome = await reader.until_end(time.monotonic() + SCENARIO_TIMEOUT_S)
    finally:
        conn.forget(uid, "r" + uid)
    if outcome == "done" and not reader.flushed:
        raise Unexpected("done without flushed")
    return expect_done(outcome)


async def several(c: Client) -> list[str]:
    """Three utterances at once on one connection."""
    conn = await c.connection()
    messages = [c.speak(c.next_id(), voice_id=c.rng.choice(c.load.voice_ids)) for _ in range(3)]
    outcomes = await asyncio.gather(*(utterance(conn, m) for m in messages))
    return [o for outcome in outcomes for o in expect_done(outcome)]


async def cancel(c: Client) -> list[str]:
    """Barge-in after the first audio: `cancelled`, or `done` and then `unknown_id` for the
    cancel when the utterance had already ended."""
    conn, uid = await c.connection(), c.next_id()
    message = c.speak(uid, voice_id=c.rng.choice(c.load.voice_ids))
    message["params"]["max_duration_s"] = 5.0
    queue = conn.expect(uid, "r" + uid, "c" + uid)
    reader = UtteranceReader(queue, uid)
    try:
        await conn.send(message)
        end = asyncio.create_task(reader.until_end(time.monotonic() + SCENARIO_TIMEOUT_S))
        try:
            await until_first_audio(reader, end, 60)
            await conn.send({"type": "cancel", "id": uid, "request_id": "c" + uid})
            outcome = await end
        finally:
            end.cancel()
            await asyncio.gather(end, return_exceptions=True)
        if outcome == "done":
            late = await next_item(queue, time.monotonic() + 30)
            if late.get("code") != "unknown_id":
                raise Unexpected(f"a cancel after done got {late}")
            return ["done", "error:unknown_id"]
    finally:
        conn.forget(uid, "r" + uid, "c" + uid)
    if outcome != "cancelled":
        raise Unexpected(f"expected cancelled, got {outcome}")
    return [outcome]


async def voice_churn(c: Client) -> list[str]:
    """Create a voice of this client's own, speak with it, delete it (HTTP 204)."""
    conn, rid = await c.connection(), c.next_id("v")
    audio, transcript = c.rng.choice(c.churn)
    queue = conn.expect(rid)
    try:
        await conn.send(
            {
                "type": "voice.create",
                "audio_b64": base64.b64encode(audio).decode(),
                "transcript": transcript,
                "request_id": rid,
            }
        )
        created = await next_item(queue, time.monotonic() + 60)
    finally:
        conn.forget(rid)
    if created.get("type") != "voice.created":
        raise Unexpected(f"voice.create got {created}")
    outcomes = expect_done(
        await utterance(conn, c.speak(c.next_id(), voice_id=created["voice_id"]))
    )
    response = await c.http.delete(f"/v1/voices/{created['voice_id']}")
    if response.status_code != 204:
        raise Unexpected(f"DELETE of a voice answered {response.status_code}")
    return ["voice_created", *outcomes, "voice_deleted"]


async def http_speech(c: Client) -> list[str]:
    body = {"input": c.rng.choice(TEXTS), "voice": c.rng.choice(["default", *c.load.voice_ids])}
    body.update(c.params())
    response = await c.http.post("/v1/audio/speech", json=body)
    if response.status_code != 200:
        raise Unexpected(f"speech answered {response.status_code}: {response.text[:200]}")
    with wave.open(io.BytesIO(response.content)) as wav:
        seconds = wav.getnframes() / wav.getframerate()
    if not 0 < seconds <= body["max_duration_s"] * 2 + 0.5:  # two sentences at most
        raise Unexpected(f"a {seconds:.2f} s WAV for max_duration_s {body['max_duration_s']}")
    return ["done"]


NORMAL = {  # name: (scenario, weight)
    "speak_voice": (speak_voice, 30),
    "speak_default": (speak_default, 8),
    "speak_inline": (speak_inline, 6),
    "stream": (stream, 8),
    "several": (several, 6),
    "cancel": (cancel, 8),
    "voice_churn": (voice_churn, 3),
    "http_speech": (http_speech, 6),
}
