"""What a listener hears, checked end to end: the audio the server streams (WebSocket and
HTTP, 24 kHz PCM16 and resampled formats) equals what `Engine.generate` produces in this
process for the same text, voice, seed and sampling, within PCM16 rounding; plain and
cloned, one segment and several, alone and beside other utterances. Cloning changes what is
heard, and a voice is the same voice whichever transport created it.

The in-process engine loads the same embedded default model the server wrote; the expected
audio never goes through the service's code (its parser, splitter, encoder or resampler
wrapper), only through the engine's public API, so a server that drops a voice, ignores a
seed or sends silence fails here.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine import Engine, EngineConfig, SamplingParams, StreamingResampler
from tests.service.conftest import b64, check_complete, collect, open_ws, recv_json, run
from tests.service.conftest import reference_audio as tone

SEGMENT_CHARS = 24  # the server packs sentences into segments of at most this many characters
TWO_SEGMENTS = ("Good morning to you all.", "The weather is fine.")
ONE_SEGMENT = ("Hello from the engine.",)
# PCM16 steps: the codec decodes each step's windows in batches whose shape depends on the
# other requests, and CPU kernels of another batch shape round differently in the last bit.
PCM_TOLERANCE = 1
RECORDINGS = {  # name -> (reference audio file, transcript)
    "low": (tone(2.0, f0=140.0), "A low tone."),
    "high": (tone(2.0, "FLAC", f0=260.0), None),
}


@dataclass(frozen=True)
class Case:
    uid: str
    segments: tuple[str, ...]
    seed: int
    voice: str | None = None  # a RECORDINGS name
    sampling: dict = field(default_factory=dict)  # protocol params besides seed and duration
    rate: int = 24000
    dur: float = 1.6

    @property
    def text(self) -> str:
        return " ".join(self.segments)

    def params(self) -> SamplingParams:
        """The protocol's rule: max_duration_s caps the rows at ceil(s * 25) + the 8-row ramp."""
        return SamplingParams(
            seed=self.seed, max_rows=math.ceil(self.dur * 25) + 8, **self.sampling
        )


WS_CASES = [
    Case("plain-one", ONE_SEGMENT, seed=11),
    Case("plain-two", TWO_SEGMENTS, seed=12, sampling={"temperature": 0.7, "top_k": 40}),
    Case("greedy", ONE_SEGMENT, seed=13, sampling={"temperature": 0.0}),
    Case("clone-one", ONE_SEGMENT, seed=14, voice="low"),
    Case("clone-two-16k", TWO_SEGMENTS, seed=15, voice="high", sampling={"top_p": 0.8}, rate=16000),
]
HTTP_CASES = [
    Case("http-plain", ONE_SEGMENT, seed=21),
    Case("http-clone-two", TWO_SEGMENTS, seed=22, voice="low"),
    Case("http-clone-22k", ONE_SEGMENT, seed=23, voice="high", rate=22050),
]


class Lab:
    """The server under test, an in-process engine on the same model, and the expected audio."""

    def __init__(self, server, engine: Engine):
        self.server = server
        self.engine = engine
        self._expected: dict[tuple, np.ndarray] = {}

    def expected(self, case: Case) -> np.ndarray:
        """int16 samples the engine produces for `case`, resampled as the server must."""
        key = (case.segments, case.seed, case.voice, sorted(case.sampling.items()), case.rate)
        key = repr((*key, case.dur))
        if key not in self._expected:
            self._expected[key] = self._generate(case)
        return self._expected[key]

    def _generate(self, case: Case) -> np.ndarray:
        ref = None
        if case.voice is not None:
            data, transcript = RECORDINGS[case.voice]
            ref = self.engine.encode_reference(data, transcript)
        n = len(case.segments)
        results = self.engine.generate(
            list(case.segments), references=[ref] * n, params=case.params()
        )
        assert [r.finish_reason for r in results] == ["length"] * n  # no early EOS: full length
        pcm = np.concatenate([np.frombuffer(r.pcm, "<i2") for r in results])
        assert rms(pcm) > 300, "the engine's own audio is near silence: nothing to compare"
        return pcm if case.rate == 24000 else resampled(pcm, case.rate)


def resampled(pcm: np.ndarray, rate: int) -> np.ndarray:
    """The engine's resampler over the whole utterance at once, back to PCM16."""
    resampler = StreamingResampler(rate)
    x = pcm.astype(np.float32) / 32768.0
    y = np.concatenate([resampler.push(x), resampler.finish()])
    return np.clip(np.round(y * 32768.0), -32768, 32767).astype(np.int16)


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and int(np.abs(a.astype(np.int32) - b).max(initial=0)) <= PCM_TOLERANCE


def assert_same_audio(served: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert len(served) == len(expected), (
        f"{what}: {len(served)} samples served, the engine made {len(expected)}"
    )
    diff = np.abs(served.astype(np.int32) - expected)
    worst = int(diff.max(initial=0))
    assert worst <= PCM_TOLERANCE, (
        f"{what}: served audio differs from the engine's by up to {worst} PCM16 steps "
        f"({int((diff > PCM_TOLERANCE).sum())} of {len(diff)} samples; rms of the served "
        f"{rms(served):.0f}, of the engine's {rms(expected):.0f})"
    )


@pytest.fixture(scope="module")
def lab(make_server, model_cache):
    server = make_server(max_segment_chars=SEGMENT_CHARS)
    # The server's engine sizes; the output does not depend on them (batch-independent).
    config = EngineConfig(device="cpu", max_num_seqs=16, max_num_batched_tokens=512)
    return Lab(server, Engine.from_pretrained(None, config, cache_dir=model_cache))


def test_the_server_splits_the_texts_as_the_cases_expect(lab):
    """The cases' segments are how the server splits their text (sentences packed up to
    SEGMENT_CHARS characters): `started` announces that many."""

    async def main():
        async with open_ws(lab.server.ws) as ws:
            await ws.send(_speak_message(WS_CASES[1]))
            started = await recv_json(ws)
            await ws.send(json.dumps({"type": "cancel", "id": WS_CASES[1].uid}))
            return started

    started = run(main())
    assert started == {"type": "started", "id": "plain-two", "segments": 2}


# -- the WebSocket -----------------------------------------------------------------------------


def _speak_message(case: Case, voice_id: str | None = None) -> str:
    """A speak for `case`: its voice by `voice_id`, or inline (audio in the message)."""
    message = {
        "type": "speak",
        "id": case.uid,
        "text": case.text,
        "params": {"seed": case.seed, "max_duration_s": case.dur, **case.sampling},
    }
    if case.rate != 24000:
        message["output"] = {"format": "pcm16", "sample_rate": case.rate}
    if case.voice is not None and voice_id is not None:
        message["voice_id"] = voice_id
    elif case.voice is not None:
        data, transcript = RECORDINGS[case.voice]
        message["voice"] = {"audio_b64": b64(data)}
        if transcript is not None:
            message["voice"]["transcript"] = transcript
    return json.dumps(message)


async def _ws_utterances(ws, messages: dict[str, str]) -> dict[str, np.ndarray]:
    """Sends every speak at once; the int16 samples of each utterance, checked complete and
    announced in its requested format."""
    for message in messages.values():
        await ws.send(message)
    utts = await collect(ws, list(messages), timeout=180)
    out = {}
    for uid, u in utts.items():
        check_complete(u, first_bytes=None)
        rate = json.loads(messages[uid]).get("output", {}).get("sample_rate", 24000)
        assert {(h["format"], h["sample_rate"]) for h in u.headers} == {("pcm16", rate)}
        out[uid] = np.frombuffer(u.payload, "<i2")
    return out


async def _ws_create_voice(ws, name: str) -> str:
    data, transcript = RECORDINGS[name]
    message = {"type": "voice.create", "audio_b64": b64(data), "request_id": name}
    if transcript is not None:
        message["transcript"] = transcript
    await ws.send(json.dumps(message))
    created = await recv_json(ws, timeout=60)
    assert created["type"] == "voice.created" and created["request_id"] == name, created
    return created["voice_id"]


def _http_create_voice(lab: Lab, name: str) -> str:
    data, transcript = RECORDINGS[name]
    body = {"audio_b64": b64(data), **({"transcript": transcript} if transcript else {})}
    r = httpx.post(lab.server.http + "/v1/voices", json=body, timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()["voice_id"]


@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: c.uid)
def test_websocket_audio_equals_the_engines(lab, case):
    """Alone on its socket; the cloned cases by inline voice (`clone-one`) and by a voice
    created on the socket first (`clone-two-16k`)."""

    async def main():
        async with open_ws(lab.server.ws) as ws:
            voice_id = None
            if case.voice is not None and case.rate != 24000:
                voice_id = await _ws_create_voice(ws, case.voice)
            return (await _ws_utterances(ws, {case.uid: _speak_message(case, voice_id)}))[case.uid]

    assert_same_audio(run(main()), lab.expected(case), case.uid)


# -- HTTP ----------------------------------------------------------------------------------------


def _speech_body(case: Case, voice_id: str | None, stream: bool) -> dict:
    body = {
        "input": case.text,
        "voice": voice_id or "default",
        "seed": case.seed,
        "max_duration_s": case.dur,
        "stream": stream,
        **case.sampling,
    }
    if case.rate == 24000:
        return {**body, "response_format": "pcm"}
    return {**body, "response_format": "wav", "sample_rate": case.rate}


def _speech_samples(case: Case, content: bytes) -> np.ndarray:
    if case.rate == 24000:
        return np.frombuffer(content, "<i2")
    pcm, rate = sf.read(io.BytesIO(content), dtype="int16")
    assert rate == case.rate, f"the WAV header says {rate} Hz, {case.rate} was asked for"
    return pcm


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda c: c.uid)
def test_http_speech_equals_the_engines(lab, case, stream):
    voice_id = _http_create_voice(lab, case.voice) if case.voice else None
    r = httpx.post(
        lab.server.http + "/v1/audio/speech", json=_speech_body(case, voice_id, stream), timeout=180
    )
    assert r.status_code == 200, r.text
    assert_same_audio(_speech_samples(case, r.content), lab.expected(case), case.uid)


# -- beside other utterances -------------------------------------------------------------------


def test_concurrent_utterances_each_equal_the_engines(lab):
    """Every WebSocket case at once on one socket, a second socket with two more, and the
    HTTP cases at the same time: the engine batches them together, and each still gets
    exactly its own audio."""
    http_cases = HTTP_CASES[:2]
    voices = {name: _http_create_voice(lab, name) for name in RECORDINGS}
    second = [
        Case("second-plain", TWO_SEGMENTS, seed=31),
        Case("second-clone", ONE_SEGMENT, seed=32, voice="high"),
    ]

    async def one_socket(cases, by_id: bool):
        async with open_ws(lab.server.ws) as ws:
            messages = {
                c.uid: _speak_message(c, voices.get(c.voice) if by_id else None) for c in cases
            }
            return await _ws_utterances(ws, messages)

    async def speech(client, case):
        body = _speech_body(case, voices.get(case.voice), stream=True)
        r = await client.post(lab.server.http + "/v1/audio/speech", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return {case.uid: _speech_samples(case, r.content)}

    async def main():
        async with httpx.AsyncClient() as client:
            parts = await asyncio.gather(
                one_socket(WS_CASES, by_id=False),
                one_socket(second, by_id=True),
                *(speech(client, c) for c in http_cases),
            )
        return {uid: pcm for part in parts for uid, pcm in part.items()}

    served = run(main())
    for case in [*WS_CASES, *second, *http_cases]:
        assert_same_audio(served[case.uid], lab.expected(case), case.uid)


# -- cloning -----------------------------------------------------------------------------------


def test_a_voice_changes_the_audio_and_two_voices_differ(lab):
    """The same text and seed without a voice, with one, and with another: three different
    utterances as served (and each is the engine's, so the engine's differ too)."""
    cases = [Case(f"v-{name}", ONE_SEGMENT, seed=41, voice=name) for name in (None, *RECORDINGS)]

    async def main():
        async with open_ws(lab.server.ws) as ws:
            return await _ws_utterances(ws, {c.uid: _speak_message(c) for c in cases})

    served = run(main())
    for case in cases:
        assert_same_audio(served[case.uid], lab.expected(case), case.uid)
    plain, low, high = (served[c.uid] for c in cases)
    for a, b, what in (
        (plain, low, "plain / low"),
        (plain, high, "plain / high"),
        (low, high, "low / high"),
    ):
        assert not same_audio(a, b), f"{what}: the voice made no difference"
        assert np.abs(a.astype(np.int32) - b).mean() > 0.1 * rms(a), what


def test_a_voice_from_one_transport_sounds_as_inline_on_the_other(lab):
    """A voice created over HTTP and spoken over the socket, and one created on the socket and
    spoken over HTTP, give the audio of the same recording sent inline."""
    low = Case("low-by-id", ONE_SEGMENT, seed=51, voice="low")
    high = Case("high-by-id", ONE_SEGMENT, seed=52, voice="high")
    low_by_http = _http_create_voice(lab, "low")

    async def main():
        async with open_ws(lab.server.ws) as ws:
            high_by_ws = await _ws_create_voice(ws, "high")
            messages = {
                "low-by-id": _speak_message(low, low_by_http),
                "low-inline": _speak_message(Case("low-inline", ONE_SEGMENT, 51, "low")),
                "high-inline": _speak_message(Case("high-inline", ONE_SEGMENT, 52, "high")),
            }
            return high_by_ws, await _ws_utterances(ws, messages)

    high_by_ws, served = run(main())
    r = httpx.post(
        lab.server.http + "/v1/audio/speech",
        json=_speech_body(high, high_by_ws, stream=False),
        timeout=180,
    )
    assert r.status_code == 200, r.text
    assert_same_audio(served["low-by-id"], served["low-inline"], "HTTP voice over the socket")
    assert_same_audio(
        _speech_samples(high, r.content), served["high-inline"], "socket voice over HTTP"
    )
    assert_same_audio(served["low-inline"], lab.expected(low), "inline low")
    assert_same_audio(served["high-inline"], lab.expected(high), "inline high")
