"""A real uvicorn server on a loopback port, in a background thread, on the embedded
default model (CPU). `make_server(**limits)` starts one with custom limits/settings."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import math
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import soundfile as sf
import uvicorn
from websockets.asyncio.client import connect

from clonecast_client.wire import unpack_audio
from service.app import create_app, uvicorn_options
from service.config import Limits, ServiceSettings

LIVE_SERVERS: list = []  # every RunningServer not yet stopped


class RunningServer:
    def __init__(self, settings: ServiceSettings):
        self.app = create_app(settings)
        options = {**uvicorn_options(settings), "host": "127.0.0.1", "port": 0}
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        services = self.app.state.services  # the port is bound while the model loads
        while not services.is_ready:
            if services.load_error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready: {services.load_error}")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/v1/stream"
        LIVE_SERVERS.append(self)

    @property
    def services(self):
        return self.app.state.services

    def stop(self) -> None:
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def make_server(model_cache):
    servers = []

    def make(
        api_keys=(),
        allowed_origins=(),
        max_num_seqs=16,
        engine_process=True,
        token_secret=None,
        extra: dict | None = None,
        **limits,
    ) -> RunningServer:
        """`extra`: other ServiceSettings fields (voice_store, voices_dir, ...)."""
        settings = ServiceSettings(
            device="cpu",
            engine_process=engine_process,
            cache_dir=model_cache,
            api_keys=tuple(api_keys),
            token_secret=token_secret,
            allowed_origins=tuple(allowed_origins),
            max_num_seqs=max_num_seqs,
            limits=dataclasses.replace(Limits(), **limits),
            **(extra or {}),
        )
        server = RunningServer(settings)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


def run(coro):
    return asyncio.run(coro)


# -- helpers shared by the service tests (they talk to the real server over the network) -----

FRAME_SAMPLES = 960  # one 40 ms frame at 24 kHz
FRAME_BYTES = 2 * FRAME_SAMPLES  # PCM16


def frames_for(max_duration_s: float) -> int:
    """Audio frames of an utterance that runs to its length cap: max_rows - 8."""
    return math.ceil(max_duration_s * 25)


def speak(uid: str, text: str = "Hello there.", dur: float = 1.0, seed: int = 1, **extra) -> str:
    params = {"max_duration_s": dur, "seed": seed, **extra.pop("params", {})}
    return json.dumps({"type": "speak", "id": uid, "text": text, "params": params, **extra})


async def recv_json(ws, timeout: float = 30.0) -> dict:
    message = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(message, str), f"expected a text frame, got {len(message)} binary bytes"
    return json.loads(message)


async def recv_until(ws, kind: str, timeout: float = 30.0, **match) -> tuple[dict, list]:
    """Reads until a JSON message of `kind` (and matching fields) arrives; returns it and
    everything read before it (dicts, or bytes for binary frames)."""
    before = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {kind!r} {match} within {timeout} s; got {_brief(before)}"
        message = await asyncio.wait_for(ws.recv(), left)
        if isinstance(message, bytes):
            before.append(message)
            continue
        data = json.loads(message)
        if data.get("type") == kind and all(data.get(k) == v for k, v in match.items()):
            return data, before
        before.append(data)


def _brief(messages: list) -> list:
    return [m if isinstance(m, dict) else f"<{len(m)} bytes>" for m in messages][-8:]


async def connect_ready(uri: str, **kwargs):
    """Opens a connection and reads its `ready` message."""
    ws = await connect(uri, open_timeout=30, **kwargs)
    ready = await recv_json(ws)
    assert ready["type"] == "ready", ready
    return ws


@contextlib.asynccontextmanager
async def open_ws(uri: str, **kwargs):
    """A connection whose `ready` was read; closed on the way out, also when a test fails (so
    its utterances are cancelled and do not run on into the next test)."""
    ws = await connect_ready(uri, **kwargs)
    try:
        yield ws
    finally:
        await ws.close()


@pytest.fixture(autouse=True)
def _engines_idle_after_test():
    """Lets every live server's engine finish (or abort) its work before the next test, so
    tests do not share a slow CPU and two engines never step at the same time."""
    yield
    deadline = time.monotonic() + 20
    for server in list(LIVE_SERVERS):
        worker = server.services.worker
        while worker is not None and worker.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)


async def expect_error(ws, code: str, timeout: float = 30.0) -> dict:
    message = await recv_json(ws, timeout)
    assert message["type"] == "error", message
    assert message["code"] == code, message
    assert isinstance(message["message"], str) and message["message"]
    return message


async def assert_alive(ws, timeout: float = 30.0) -> list:
    """A ping is answered by a pong; returns what arrived before the pong."""
    await ws.send(json.dumps({"type": "ping"}))
    pong, before = await recv_until(ws, "pong", timeout)
    assert isinstance(pong["t"], (int, float))
    return before


def exchange(server, *frames, code: str) -> dict:
    """Sends frames on a fresh connection, expects one error with `code`, then a pong with
    nothing before it (the connection keeps working); returns the error."""

    async def main():
        async with open_ws(server.ws) as ws:
            for frame in frames:
                await ws.send(frame)
            err = await expect_error(ws, code)
            before_pong = await assert_alive(ws)
            return err, before_pong

    err, before_pong = run(main())
    assert before_pong == [], f"unexpected messages: {before_pong}"
    return err


@dataclass
class Utt:
    """Everything received for one utterance id."""

    started: dict | None = None
    headers: list = field(default_factory=list)  # JSON `audio` messages
    frames: list = field(default_factory=list)  # unpacked binary frames
    done: dict | None = None
    errors: list = field(default_factory=list)
    segments: list = field(default_factory=list)  # `segment` messages
    other: list = field(default_factory=list)
    kinds: list = field(default_factory=list)  # message types in arrival order

    @property
    def payload(self) -> bytes:
        return b"".join(f.payload for f in self.frames)


async def collect(
    ws, ids, timeout: float = 60.0, stop_on_error: bool = True, hook=None
) -> dict[str, Utt]:
    """Reads until every id has its `done` (or an `error`); checks that each `audio` message
    is immediately followed by its binary frame with the same id, seq and last. `hook(data)`,
    if given, is awaited after each message."""
    utts = {uid: Utt() for uid in ids}
    deadline = time.monotonic() + timeout

    def finished(u: Utt) -> bool:
        return u.done is not None or (stop_on_error and bool(u.errors))

    while not all(finished(u) for u in utts.values()):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got { {k: (v.done, v.errors) for k, v in utts.items()} }"
        message = await asyncio.wait_for(ws.recv(), left)
        assert isinstance(message, str), "a binary frame without its audio message"
        data = json.loads(message)
        kind, uid = data.get("type"), data.get("id")
        if kind == "error" and uid is None:  # a rejected message about a running utterance:
            uid = data.get("request_id")  # no id (it goes on); tests tag it with request_id
        assert uid in utts, f"message for an unexpected id: {data}"
        u = utts[uid]
        u.kinds.append(kind)
        if kind == "audio":
            raw = await asyncio.wait_for(ws.recv(), left)
            assert isinstance(raw, bytes), f"audio message not followed by a binary frame: {raw}"
            frame = unpack_audio(raw)
            assert (frame.utterance_id, frame.seq, frame.last) == (uid, data["seq"], data["last"])
            assert len(frame.payload) == data["bytes"]
            u.headers.append(data)
            u.frames.append(frame)
        elif kind == "started":
            u.started = data
        elif kind == "done":
            u.done = data
        elif kind == "error":
            u.errors.append(data)
        elif kind == "segment":
            u.segments.append(data)
        else:
            u.other.append(data)
        if hook is not None:
            await hook(data)
    return utts


def check_complete(u: Utt, first_bytes: int | None = 15360) -> None:
    """Continuous seq from 0, the last frame flagged last (and only it), `done` after it."""
    assert u.errors == [], u.errors
    assert u.done is not None
    assert [f.seq for f in u.frames] == list(range(len(u.frames)))
    assert [f.last for f in u.frames] == [False] * (len(u.frames) - 1) + [True]
    if first_bytes is not None:
        assert len(u.frames[0].payload) == first_bytes


def scrape(server) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}."""
    r = httpx.get(server.http + "/metrics", timeout=30)
    assert r.status_code == 200
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def summed(samples: dict[str, float], name: str) -> float:
    """A scraped series summed over its labels (`name` alone or `name{...}`)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def wait_engine_idle(server, timeout: float = 15.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits and every KV block is free again."""
    total = server.services.worker.stats.num_kv_blocks
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        idle = (
            summed(m, "clonecast_num_requests_running") == 0
            and summed(m, "clonecast_num_requests_waiting") == 0
            and summed(m, "clonecast_kv_cache_free_blocks") == total
        )
        if idle:
            return m
        assert time.monotonic() < deadline, (
            f"engine not idle after {timeout} s: running "
            f"{summed(m, 'clonecast_num_requests_running')}, "
            f"free blocks {summed(m, 'clonecast_kv_cache_free_blocks')} of {total}"
        )
        time.sleep(0.1)


def reference_audio(seconds: float = 2.0, fmt: str = "WAV", rate: int = 24000, f0=150.0) -> bytes:
    """A harmonic tone with a smooth envelope at amplitude 0.2: a usable reference."""
    t = np.arange(int(seconds * rate)) / rate
    tone = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 6))
    envelope = np.sin(np.pi * t / seconds) ** 0.5
    x = 0.2 * envelope * tone / np.max(np.abs(tone))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
