"""The engine in its own process (`service/engine_client.py`, the server's default): requests,
their errors and reference encoding cross the process boundary intact; a cancelled wait is
aborted and never delivered; the server's step metrics come across; a dead engine process
fails what is in flight, turns `/ready` to 503 and refuses new work with a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine import STEP_PHASES, ConfigError, EngineStats, ReferenceAudioError, SamplingParams
from service.engine_channel import PortableError
from service.engine_client import EngineClient
from service.engine_host import EngineSpec
from tests.service.conftest import reference_audio, scrape, summed, wait_engine_idle


def test_exceptions_cross_as_data_and_keep_their_kind():
    ref = PortableError.of(ReferenceAudioError("audio_too_short", "only 0.1 s")).rebuild()
    assert isinstance(ref, ReferenceAudioError) and ref.code == "audio_too_short"
    assert str(ref) == "only 0.1 s"
    cfg = PortableError.of(ConfigError("bad top_k")).rebuild()
    assert type(cfg) is ConfigError and str(cfg) == "bad top_k"
    other = PortableError.of(ValueError("boom")).rebuild()
    assert type(other) is RuntimeError and "ValueError" in str(other) and "boom" in str(other)


def test_the_default_server_runs_the_engine_in_another_process(server):
    worker = server.services.worker
    assert isinstance(worker, EngineClient) and worker.alive
    assert worker.pid is not None and worker.pid != os.getpid()
    assert server.services.engine is None  # no model in the server's process


def test_a_request_streams_through_the_process_and_steps_reach_the_metrics(server):
    before = scrape(server)
    r = httpx.post(
        server.http + "/v1/audio/speech",
        json={
            "input": "across processes",
            "max_duration_s": 0.4,
            "response_format": "pcm",
            "seed": 1,
        },
        timeout=60,
    )
    assert r.status_code == 200 and len(r.content) == 10 * 1920
    after = wait_engine_idle(server)
    name = "clonecast_engine_step_seconds_count"
    assert summed(after, name) > summed(before, name)


def test_errors_and_voices_cross_the_process(server):
    worker = server.services.worker
    with pytest.raises(ConfigError, match="structural tokens"):
        worker.check_text("say <|audio|> now")
    params = SamplingParams(max_rows=4)
    bad = worker.submit("bad-text", "say <|audio|> now", None, params, lambda o: None)
    with pytest.raises(ConfigError, match="structural tokens"):  # raised by the engine there
        bad.result(timeout=30)
    voice = worker.encode_reference(reference_audio(2.0), "a transcript").result(timeout=60)
    assert voice.codes and voice.text == "a transcript"
    with pytest.raises(ReferenceAudioError) as info:
        worker.encode_reference(b"not audio at all", None).result(timeout=60)
    assert info.value.code


def test_a_cancelled_wait_is_aborted_and_never_delivered(server):
    """The requests were added before the cancel reached the engine process: they must be
    aborted there (at 2048 rows each they would run far past the 5 s allowed) and nothing
    of theirs delivered."""
    worker = server.services.worker
    delivered = []
    params = SamplingParams(max_rows=2048)
    futures = [
        worker.submit(f"cancel-{i}", "never heard", None, params, delivered.append)
        for i in range(4)
    ]
    assert all(f.cancel() for f in futures)  # before the engine process could answer
    deadline = time.monotonic() + 30
    while worker._added and time.monotonic() < deadline:  # the engine's answers arrived
        time.sleep(0.02)
    assert not worker._added
    wait_engine_idle(server, timeout=5)
    time.sleep(0.3)
    assert delivered == []


def test_a_request_id_reused_after_an_abort_gets_only_its_own_events(server):
    """Events of an aborted request still in the pipe never reach a later request of the
    same id (each crosses under a wire id of its own); a live id cannot be taken twice."""
    worker = server.services.worker
    first, second = [], []
    done = threading.Event()

    def sink2(out):
        second.append(out)
        if isinstance(out, BaseException) or out.finished:
            done.set()

    worker.submit("same-id", "the first one", None, SamplingParams(max_rows=400), first.append)
    with pytest.raises(ConfigError, match="already in use"):
        worker.submit("same-id", "a twin", None, SamplingParams(max_rows=4), sink2).result(30)
    deadline = time.monotonic() + 30
    while not first and time.monotonic() < deadline:  # the first is running and streaming
        time.sleep(0.02)
    worker.abort("same-id")
    n_first = len(first)
    assert n_first > 0, "the first request produced no output before its abort"
    assert not isinstance(first[0], BaseException) and first[0].audio is not None
    # seeded: an unseeded draw of the random test model once ended with "eos" (a local run)
    worker.submit("same-id", "the second one", None, SamplingParams(max_rows=30, seed=7), sink2)
    assert done.wait(60)
    assert len(first) == n_first and not any(o.finished for o in first)
    last = second[-1]
    assert not isinstance(last, BaseException) and last.finished
    assert last.finish_reason == "length"
    control, control_done = [], threading.Event()

    def control_sink(out):
        control.append(out)
        if isinstance(out, BaseException) or out.finished:
            control_done.set()

    control_params = SamplingParams(max_rows=30, seed=7)  # the second's: both run 30 rows
    worker.submit("control-id", "the second one", None, control_params, control_sink)
    assert control_done.wait(60)

    def pcm_bytes(outs):
        return sum(len(o.audio.pcm) for o in outs if o.audio)

    # its own 30 rows' audio, as much as the same request under a fresh id; none of the 400's
    assert 0 < pcm_bytes(second) == pcm_bytes(control) < 30 * 1920


def test_a_dead_engine_process_fails_requests_and_readiness(make_server):
    """With restarts off (CLONECAST_ENGINE_RESTARTS=0; test_engine_supervision.py has them
    on) a dead engine stays dead: the server says so until it is restarted."""
    server = make_server(extra={"engine_restarts": 0})
    worker = server.services.worker
    assert httpx.get(server.http + "/ready", timeout=10).status_code == 200
    assert summed(scrape(server), "clonecast_engine_up") == 1
    got = threading.Event()
    seen = []

    def sink(out):
        seen.append(out)
        got.set()

    worker.submit("doomed", "a long sentence to speak", None, SamplingParams(max_rows=400), sink)
    os.kill(worker.pid, signal.SIGKILL)
    assert got.wait(20), "the request in flight was not failed"
    assert isinstance(seen[-1], RuntimeError) and "engine process exited" in str(seen[-1])
    r = httpx.get(server.http + "/ready", timeout=10)
    assert r.status_code == 503 and "restart" in r.json()["error"]["message"]
    r = httpx.get(server.http + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "engine_exited"
    assert summed(scrape(server), "clonecast_engine_up") == 0
    with pytest.raises(RuntimeError, match="engine process exited"):
        worker.submit("late", "hi", None, SamplingParams(max_rows=4), sink).result(timeout=5)
    r = httpx.post(
        server.http + "/v1/audio/speech",
        json={"input": "anyone there", "max_duration_s": 0.4, "response_format": "pcm"},
        timeout=30,
    )
    assert r.status_code >= 500 and r.json()["error"]["code"]


_HOLDER = """
import sys, time
from pathlib import Path
from engine import EngineConfig
from service.engine_client import EngineClient
from service.engine_host import EngineSpec
spec = EngineSpec(None, EngineConfig(device="cpu"), cache_dir=Path(sys.argv[1]))
p = EngineClient.in_process(spec)
p.start()
if sys.argv[2] == "busy":  # requests streaming audio that nobody will read once killed
    from engine import SamplingParams
    for i in range(4):
        p.submit(f"r{i}", "a long sentence to keep the engine busy", None,
                 SamplingParams(max_rows=2048), lambda out: None)
    time.sleep(1.0)
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_the_engine_process_does_not_outlive_a_killed_server(model_cache, load):
    """A server killed outright (SIGKILL: no shutdown) must not leave its engine process
    holding the GPU: the engine notices its parent is gone and exits, also while it streams
    audio into a pipe nobody reads any more."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(model_cache), load],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(holder.stdout.readline())
        assert Path(f"/proc/{pid}").exists()
        if load == "busy":  # the server stops reading first: the pipe fills with audio
            holder.send_signal(signal.SIGSTOP)
            time.sleep(4.0)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the engine process outlived its server"


def test_a_steps_events_leave_the_engine_process_in_one_message():
    """The engine process sends a step's audio and finish events as one message (the
    queue's feeder thread then wakes once a step); row-only events stay behind, and a
    request's error still goes alone."""
    from engine import RequestOutput
    from service.engine_channel import Outputs, RequestFailed
    from service.engine_host import EngineHost

    class Events(list):
        put = list.append

    class Engine:  # what the host calls of the engine here
        def abort(self, request_id):
            return True

    events = Events()
    host = EngineHost(Engine(), events)
    host._live.update(("a", "b", "c"))
    chunk = object()  # stands in for an AudioChunk
    out_a = RequestOutput("a", [], audio=chunk)
    out_b = RequestOutput("b", [], True, "length", [])
    out_c = RequestOutput("c", [(1,) * 8])  # a row only: nobody reads it
    host._deliver([out_a, out_b, out_c])
    assert len(events) == 1 and isinstance(events[0], Outputs)
    sent = events[0].items
    assert [rid for rid, _ in sent] == ["a", "b"]
    assert sent[0][1].audio is chunk and not sent[0][1].finished
    assert sent[1][1].finished and sent[1][1].finish_reason == "length"
    assert sent[1][1].rows is None  # the rows stay in the engine process
    assert "b" not in host._live and "c" in host._live
    host._live.discard("a")
    host._fail_all(ConfigError("bad"))
    assert events[-1] == RequestFailed("c", PortableError("ConfigError", "bad", None, True))
    host.encoder_pool.shutdown()


def _profile_of_one_request(client, out) -> str:
    """Starts `client`, runs one request to its end, waits for the profile file the engine
    writes to `out`, stops the client; the file's text."""
    client.start()
    try:
        finished = threading.Event()

        def sink(o):
            return (isinstance(o, BaseException) or o.finished) and finished.set()

        client.submit("p", "profile me", None, SamplingParams(max_rows=20), sink)
        assert finished.wait(60)
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return out.read_text()
    finally:
        client.stop()


def test_the_engine_process_profiles_busy_steps_on_request(model_cache, tmp_path, monkeypatch):
    """CLONECAST_PROFILE=SKIP,STEPS,FILE: torch.profiler tables of STEPS busy steps of the
    engine process (how the served step is diagnosed on a GPU)."""
    from engine import EngineConfig
    from service.config import ServiceSettings

    out = tmp_path / "profile.txt"
    monkeypatch.delenv("CLONECAST_PROFILE", raising=False)
    assert ServiceSettings.from_env().profile is None
    monkeypatch.setenv("CLONECAST_PROFILE", f"2,5,{out}")
    profile = ServiceSettings.from_env().profile
    assert profile == (2, 5, str(out), "torch", 1)
    monkeypatch.setenv("CLONECAST_PROFILE", f"0,3,{out},python")
    assert ServiceSettings.from_env().profile == (0, 3, str(out), "python", 1)
    monkeypatch.setenv("CLONECAST_PROFILE", f"0,3,{out},python,200")
    assert ServiceSettings.from_env().profile == (0, 3, str(out), "python", 200)
    spec = EngineSpec(None, EngineConfig(device="cpu"), cache_dir=model_cache, profile=profile)
    process = EngineClient.in_process(spec)
    text = _profile_of_one_request(process, out)
    assert "Self CPU" in text and "5 busy steps of the engine in " in text
    assert not process.alive


def test_an_engine_thread_profiles_busy_steps_too(model_cache, tmp_path):
    """An engine served from a thread of the server's own process (tests, and
    benchmarks/sim_server.py, which models the served host work on a CPU) takes the same
    CLONECAST_PROFILE: the python mode's tables and each thread's CPU time."""
    from engine import Engine, EngineConfig

    out = tmp_path / "profile.txt"
    engine = Engine.from_pretrained(None, EngineConfig(device="cpu"), cache_dir=model_cache)
    client = EngineClient.in_thread(engine, profile=(1, 4, str(out), "python", 1))
    text = _profile_of_one_request(client, out)
    assert "-- by tottime --" in text and "4 busy steps of the engine in " in text
    assert "CPU time per thread" in text and "clonecast-engine" in text


def test_after_stop_requests_fail_clearly_and_stop_again_is_harmless(model_cache):
    """stop() releases the queues to the engine process (their semaphores go with them): a
    request, an abort or an encode afterwards never touches them; stopping twice is fine."""
    from engine import EngineConfig

    process = EngineClient.in_process(
        EngineSpec(None, EngineConfig(device="cpu"), cache_dir=model_cache)
    )
    process.start()
    process.stop()
    assert not process.alive
    done = process.submit("late", "hello", None, SamplingParams(max_rows=4), lambda o: None)
    with pytest.raises(RuntimeError, match="engine"):
        done.result(timeout=1)
    process.abort("late")  # nothing to tell: no error
    with pytest.raises(RuntimeError, match="engine"):
        process.encode_reference(b"RIFF", None).result(timeout=1)
    process.stop()


@pytest.mark.parametrize(
    "value",
    ["5", "a,b,c", "1,0,x", "-1,3,x", "1,3,", "1,3,x,gpu", "1,3,x,torch,n", "1,3,x,torch,1,2"],
)
def test_a_bad_profile_setting_is_refused(value, monkeypatch):
    from service.config import ServiceSettings

    monkeypatch.setenv("CLONECAST_PROFILE", value)
    with pytest.raises(ValueError, match="CLONECAST_PROFILE"):
        ServiceSettings.from_env()


def test_a_model_that_cannot_load_fails_start_with_its_error(tmp_path):
    """A bad CLONECAST_MODEL: start() raises the loader's own error (a ConfigError naming
    the path, rebuilt from the engine process) and leaves no engine process behind."""
    from engine import EngineConfig

    missing = tmp_path / "no-such-checkpoint"
    process = EngineClient.in_process(EngineSpec(str(missing), EngineConfig(device="cpu")))
    with pytest.raises(ConfigError, match="no-such-checkpoint"):
        process.start()
    process.stop()
    assert not process.alive and process._transport.process.exitcode is not None


def test_a_checkpoint_without_a_codec_is_refused_and_its_engine_stopped(tiny_ckpt):
    """The service needs audio: a checkpoint that bundles no codec (and no CLONECAST_CODEC)
    fails start-up with a clear ConfigError, and the engine process it started is stopped."""
    import multiprocessing

    from service.app import Services
    from service.config import ServiceSettings

    before = {p.pid for p in multiprocessing.active_children()}  # other tests' servers
    services = Services(ServiceSettings(model=str(tiny_ckpt), device="cpu"))
    with pytest.raises(ConfigError, match="needs a codec"):
        services.start()
    assert services.worker is None  # the refused engine never served
    assert {p.pid for p in multiprocessing.active_children()} <= before


def _thread_client(model_cache, patch=None):
    """An engine of this process behind the same client (CLONECAST_ENGINE_PROCESS=0)."""
    from engine import Engine, EngineConfig

    engine = Engine.from_pretrained(None, EngineConfig(device="cpu"), cache_dir=model_cache)
    if patch is not None:
        patch(engine)
    client = EngineClient.in_thread(engine)
    client.start()
    return client


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_that_dies_fails_its_requests_and_readiness(model_cache):
    """Whatever ends the engine's own thread (here a SystemExit out of a step), the engine's
    command loop ends too: requests in flight fail with an error, `alive` turns false (so
    `/ready` answers 503) and new requests fail at once instead of waiting forever."""

    def dying_step(engine):
        def step(emit=None):
            raise SystemExit("the engine thread ends")

        engine.step = step

    client = _thread_client(model_cache, dying_step)
    try:
        seen, got = [], threading.Event()

        def sink(out):
            seen.append(out)
            got.set()

        client.submit("r", "a sentence", None, SamplingParams(max_rows=20), sink)
        assert got.wait(20), "the request in flight was not failed"
        assert isinstance(seen[-1], RuntimeError) and not client.alive
        late = client.submit("late", "hi", None, SamplingParams(max_rows=4), sink)
        with pytest.raises(RuntimeError, match="engine"):
            late.result(timeout=5)
    finally:
        client.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_cancelled_submit_never_reaches_its_sink_even_when_the_engine_ends(model_cache):
    """The caller stopped waiting before the engine answered (its future cancelled), and the
    engine ends before its answer: the sink is never called, not even with the error."""
    release = threading.Event()

    def dies_while_adding(engine):
        def add_request(*args, **kwargs):
            release.wait(10)  # the engine has not answered when the caller cancels
            raise SystemExit("the engine thread ends")

        engine.add_request = add_request

    client = _thread_client(model_cache, dies_while_adding)
    try:
        delivered = []
        future = client.submit(
            "c", "never heard", None, SamplingParams(max_rows=8), delivered.append
        )
        assert future.cancel()
        release.set()
        deadline = time.monotonic() + 20
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.alive
        time.sleep(0.2)
        assert delivered == []
    finally:
        client.stop()


def test_a_reader_whose_queue_is_closed_under_it_ends_and_fails_what_waits(monkeypatch):
    """stop() closes the event queue once the engine is gone, even when the reader thread
    outlived its join (an engine terminated while it still had events to read): the reader
    then ends quietly and fails what still waits, instead of dying of the closed queue."""
    import multiprocessing

    from service.engine_client import EngineExited

    class Transport:  # an engine that stays up and never says anything
        events = multiprocessing.get_context("spawn").Queue()
        commands = None
        pid = None

        def is_alive(self):
            return True

        def join(self, timeout):
            pass

        def exit_reason(self):
            return "the engine has stopped"

    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    client = EngineClient(Transport())
    got = []
    client._sinks["r#1"] = got.append
    client._reader.start()
    time.sleep(0.2)  # the reader waits in get()
    Transport.events.close()
    client._reader.join(timeout=5)
    assert not client._reader.is_alive() and escaped == []
    assert len(got) == 1 and isinstance(got[0], EngineExited)


def _stats(step_seconds: float, rows: int = 0) -> EngineStats:
    """Statistics whose phase totals add up to `step_seconds` (all of it waiting on the GPU)."""
    phases = tuple(step_seconds if p == "gpu_wait" else 0.0 for p in STEP_PHASES)
    return EngineStats(1, 0, 10, 10, 0, 0, 0, num_rows_generated=rows, phase_seconds_total=phases)


def test_steps_travel_with_the_statistics_taken_after_the_last_of_them():
    """A refresh from the command loop reads the engine mid-step: those totals already count
    part of a step whose time is not observed yet, so the waiting steps go with the
    statistics of their own last step, and the fresher ones follow alone (for the gauges)."""
    from engine.stats import Observations, StepShape
    from service.engine_channel import Stats, Steps
    from service.engine_host import _StatsSender

    class Events(list):
        put = list.append

    class Engine:  # mid-step: 0.03 s into its phases, one step of 0.02 s observed
        stats = _stats(0.05, rows=3)

        def take_observations(self):
            return Observations(steps=[(0.02, StepShape("decode", 1, 1))])

    events = Events()
    sender = _StatsSender(events, Engine())
    sender.last_sent = time.monotonic()  # within the batching interval: on_step holds it
    sender.on_step(0.02, _stats(0.02, rows=1))
    assert events == []
    sender.refresh()
    [steps, fresh] = events
    assert isinstance(steps, Steps) and isinstance(fresh, Stats)
    assert steps.observed.steps == [(0.02, StepShape("decode", 1, 1))]
    assert steps.stats == _stats(0.02, rows=1) and fresh.stats == Engine.stats
    sender.refresh()  # nothing new: nothing sent
    assert len(events) == 2


def test_a_scrape_sees_a_report_of_steps_whole():
    """A scrape taken while a report of steps is being counted sees all of it or none: the
    phases of step time never add up to more than the step time scraped with them."""
    from engine.stats import Observations, StepShape
    from service.metrics import Metrics

    metrics = Metrics()
    series = metrics.engine(0)
    stop, reports = threading.Event(), [0]

    def report():  # reports of one 20 ms step each, as fast as they can go, until told
        while not stop.is_set():
            n = reports[0] + 1
            observed = Observations(steps=[(0.02, StepShape("decode", 1, 1))])
            series.observe_steps(observed, _stats(0.02 * n, rows=n))
            reports[0] = n

    def check() -> dict[str, float]:
        samples = {}
        for line in metrics.render().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        steps = summed(samples, "clonecast_engine_step_seconds_sum")
        phases = summed(samples, "clonecast_engine_phase_seconds_total")
        rows = samples["clonecast_engine_rows_total"]
        # a tear would be a whole step (0.02 s) apart; float sums drift by far less
        assert phases <= steps * (1 + 1e-9) and rows == round(steps / 0.02)
        return samples

    thread = threading.Thread(target=report)
    thread.start()
    try:
        for _ in range(150):  # scrapes a little apart, each likely to meet a report midway
            check()
            time.sleep(0.001)  # the lock is not fair: leave the reports their turn
    finally:
        stop.set()
        thread.join()
    assert reports[0] > 150  # the reports really ran between the scrapes
    assert summed(check(), "clonecast_engine_step_seconds_count") == reports[0]
