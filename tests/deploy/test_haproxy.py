"""Two real `clonecast serve` servers behind HAProxy from Debian, on loopback, with the shipped
deploy/haproxy/clonecast.cfg (rendered: loopback ports, checks every 0.2 s): streams go
through the balancer over the WebSocket, least connections spreads them over both servers,
a SIGTERM (a deploy) takes one server out while its running streams finish through the
balancer and new connections go to the other, the restarted server is taken back, and a
`kill -9` of one server leaves the other serving. The servers share one voice store (a real
PostgreSQL on loopback): a voice created through one is spoken through the other."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from tests.deploy.balancer import HAPROXY, TEMPLATE, TEST_GLOBAL, Balancer, Server
from tests.service.conftest import (
    b64,
    check_complete,
    collect,
    connect_ready,
    recv_until,
    reference_audio,
    run,
    speak,
)

pytestmark = pytest.mark.skipif(
    HAPROXY is None,
    reason="needs haproxy: Debian package haproxy (`make system-deps` as root installs it)",
)
STOCK = Path("/etc/haproxy/haproxy.cfg")  # what Debian's package installs
LONG_S = 40.0  # audio seconds: still generating (several seconds on a CPU) when a signal comes


class Cluster:
    """Two servers sharing one voice store (a real PostgreSQL) behind HAProxy."""

    def __init__(self, workdir, voice_store: str):
        self.workdir = workdir
        self.servers = [Server("clonecast1", workdir), Server("clonecast2", workdir)]
        self.env = {"CLONECAST_VOICE_STORE": voice_store}
        self.balancer: Balancer | None = None

    def start(self) -> None:
        for server in self.servers:
            server.start(**self.env)
        self.balancer = Balancer(self.workdir, self.servers)

    def ensure_up(self) -> None:
        """Both servers running, marked UP by the balancer, no connection open on either."""
        for server in self.servers:
            if not server.running:
                server.start(**self.env)
        for server in self.servers:
            self.balancer.wait_status(server.name, "UP")
        deadline = time.monotonic() + 30
        while any(self.connections().values()) or any(self.balancer.current_sessions().values()):
            assert time.monotonic() < deadline, "connections of an earlier test still open"
            time.sleep(0.1)

    def connections(self) -> dict[str, int]:
        counts = {s.name: s.connections() for s in self.servers}
        return {name: n for name, n in counts.items() if n is not None}

    async def open(self) -> tuple[object, Server]:
        """A connection through the balancer (its `ready` read) and the server it reached:
        the one whose open connections rose (each counts a connection before `ready`)."""
        before = self.connections()
        ws = await connect_ready(self.balancer.ws)
        after = self.connections()
        rose = [s for s in self.servers if after.get(s.name, 0) == before.get(s.name, 0) + 1]
        assert len(rose) == 1, (before, after)
        return ws, rose[0]

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres):
    cluster = Cluster(tmp_path_factory.mktemp("cluster"), postgres.new_database())
    try:
        cluster.start()
        yield cluster
    finally:  # also when a server or the balancer failed to start: nothing left running
        cluster.stop()


def test_the_template_is_valid_haproxy_config(tmp_path):
    """The file as shipped (its example addresses) passes `haproxy -c`, and so does Debian's
    stock /etc/haproxy/haproxy.cfg with it appended, as docs/deploy.md says to install it."""
    (tmp_path / "global.cfg").write_text(TEST_GLOBAL.format(socket=tmp_path / "s.sock"))
    configs = [[tmp_path / "global.cfg", TEMPLATE]]
    if STOCK.exists():
        (tmp_path / "appended.cfg").write_text(STOCK.read_text() + TEMPLATE.read_text())
        configs.append([tmp_path / "appended.cfg"])
    for files in configs:
        args = [arg for path in files for arg in ("-f", str(path))]
        check = subprocess.run([HAPROXY, "-c", *args], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_streams_through_the_balancer_spread_by_least_connections(cluster):
    cluster.ensure_up()

    async def stream(ws, n):
        utts = {}
        for i in range(3):  # several utterances, one after another on the connection
            await ws.send(speak(f"u{n}-{i}", "Through the balancer.", dur=1.0, seed=n))
            utts |= await collect(ws, [f"u{n}-{i}"], timeout=120)
        return utts

    async def main():
        opened = [await cluster.open() for _ in range(4)]  # one after another, all kept open
        spread, scur = cluster.connections(), cluster.balancer.current_sessions()
        results = await asyncio.gather(*(stream(ws, n) for n, (ws, _) in enumerate(opened)))
        # empty one server: the next two connections both go to it (round robin would not)
        emptied = opened[0][1]
        for ws, server in opened:
            if server is emptied:
                await ws.close()
        cluster.balancer.wait_sessions(emptied.name, 0)
        refill = [await cluster.open() for _ in range(2)]
        for ws, _ in [*opened, *refill]:
            await ws.close()
        return spread, scur, results, emptied, [server for _, server in refill]

    spread, scur, results, emptied, refilled = run(main())
    assert httpx.get(cluster.balancer.http + "/ready", timeout=30).status_code == 200
    assert httpx.get(cluster.balancer.http + "/metrics", timeout=30).status_code == 403
    # each new connection went to the server with fewer: two and two
    assert spread == {"clonecast1": 2, "clonecast2": 2}
    assert scur == {"clonecast1": 2, "clonecast2": 2}  # the balancer counts them the same
    assert refilled == [emptied, emptied]
    for utts in results:
        assert len(utts) == 3
        for utt in utts.values():
            check_complete(utt)
            assert utt.payload


@pytest.mark.slow
def test_a_voice_created_through_one_server_is_spoken_by_the_other(cluster):
    """The servers share a PostgreSQL voice store: a voice registered through the balancer
    (on whichever server it reached) is heard by name on both servers' connections."""
    cluster.ensure_up()
    created = httpx.post(
        cluster.balancer.http + "/v1/voices",
        json={"audio_b64": b64(reference_audio(3.0)), "transcript": "shared", "name": "shared"},
        timeout=120,
    )
    assert created.status_code == 201, created.text

    async def main():
        opened = [await cluster.open() for _ in range(2)]  # least connections: one on each
        heard = {}
        for n, (ws, server) in enumerate(opened):
            await ws.send(speak(f"shared-{n}", "In the shared voice.", dur=0.6, voice_id="shared"))
            heard[server.name] = (await collect(ws, [f"shared-{n}"], timeout=120))[f"shared-{n}"]
        for ws, _ in opened:
            await ws.close()
        return heard

    heard = run(main())
    assert sorted(heard) == ["clonecast1", "clonecast2"]
    for utt in heard.values():
        check_complete(utt)
        assert utt.payload


@pytest.mark.slow
def test_sigterm_drains_a_server_out_of_the_balancer_and_a_restart_brings_it_back(cluster):
    """A deploy: the stopped server's running stream ends with its `done` through the
    balancer, new connections meanwhile reach only the other server, and once the server is
    started again the balancer sends it new connections."""
    cluster.ensure_up()

    async def main():
        (ws_a, victim), (ws_b, other) = await cluster.open(), await cluster.open()
        assert victim is not other  # least connections: one each
        await ws_a.send(speak("drained", "A long stream through the deploy.", dur=LONG_S))
        await ws_b.send(speak("other", "A stream on the other server.", dur=2.0))
        first, _ = await recv_until(ws_a, "audio", timeout=120, id="drained")  # it runs
        assert first["seq"] == 0 and isinstance(await ws_a.recv(), bytes)
        victim.process.send_signal(signal.SIGTERM)
        down = cluster.balancer.wait_status(victim.name, "DOWN")
        late = []
        for n in range(2):  # new connections while the victim drains: all to the other
            ws, server = await cluster.open()
            late.append((ws, server))
            await ws.send(speak(f"late{n}", "A new connection during the deploy.", dur=1.0))
        late_utts = [await collect(ws, [f"late{n}"], timeout=120) for n, (ws, _) in enumerate(late)]
        drained = await collect(ws_a, ["drained"], timeout=240)
        closed = await _close_code(ws_a)  # the drained server closes it: 1012, restart
        other_utts = await collect(ws_b, ["other"], timeout=120)
        for ws, _ in [*late, (ws_b, other)]:
            await ws.close()
        return victim, other, down, late, late_utts, drained, closed, other_utts

    victim, other, down, late, late_utts, drained, closed, other_utts = run(main())
    # out by its answer to GET /ready, not by a closed port (it still listened then)
    assert (down["check_status"], down["check_code"]) == ("L7STS", "503")
    assert [server for _, server in late] == [other, other]
    for utts in [*late_utts, other_utts]:
        for utt in utts.values():
            check_complete(utt)
    rest = drained["drained"]  # after its first chunk (read before the signal)
    assert rest.errors == []
    assert [f.seq for f in rest.frames] == list(range(1, 1 + len(rest.frames)))
    assert rest.frames[-1].last and rest.done["stats"]["audio_s"] == pytest.approx(LONG_S)
    assert closed == 1012
    assert victim.process.wait(timeout=60) == 0
    log = victim.log()
    assert "draining: 1 utterances running" in log and "drained: 1 utterances finished" in log

    victim.start()  # the deploy's new version, on the same address
    cluster.balancer.wait_status(victim.name, "UP")

    async def after_deploy():
        opened = [await cluster.open() for _ in range(2)]
        for ws, _ in opened:
            await ws.close()
        return {server.name for _, server in opened}

    assert run(after_deploy()) == {victim.name, other.name}


@pytest.mark.slow
def test_a_killed_server_leaves_the_other_serving_through_the_balancer(cluster):
    cluster.ensure_up()

    async def main():
        (ws_a, victim), (ws_b, other) = await cluster.open(), await cluster.open()
        assert victim is not other
        await ws_a.send(speak("lost", "A stream whose server is killed.", dur=LONG_S))
        await ws_b.send(speak("kept", "A stream whose server lives on.", dur=LONG_S / 4))
        await recv_until(ws_a, "audio", timeout=120, id="lost")
        victim.process.kill()  # SIGKILL: no drain, no close frame
        lost = await _messages_until_closed(ws_a)
        kept = await collect(ws_b, ["kept"], timeout=240)
        down = cluster.balancer.wait_status(victim.name, "DOWN")
        fresh = []
        for n in range(3):
            ws, server = await cluster.open()
            await ws.send(speak(f"fresh{n}", "After the kill.", dur=1.0))
            fresh.append((server, await collect(ws, [f"fresh{n}"], timeout=120)))
            await ws.close()
        await ws_b.close()
        return victim, other, down, lost, kept, fresh

    victim, other, down, lost, kept, fresh = run(main())
    # the check's connection was refused (L4CON), or failed at the socket (SOCKERR) when
    # the kill came while a check was connecting
    assert down["check_status"] in ("L4CON", "SOCKERR")
    assert victim.process.wait(timeout=30) == -signal.SIGKILL
    assert not any(isinstance(m, str) and '"done"' in m for m in lost)  # it never ended
    check_complete(kept["kept"])
    for server, utts in fresh:
        assert server is other
        check_complete(utts[next(iter(utts))])


async def _messages_until_closed(ws) -> list:
    """Everything received until the connection closes (the balancer closes the client's
    side when the server's vanishes)."""
    received = []
    with contextlib.suppress(ConnectionClosed):
        while True:
            received.append(await asyncio.wait_for(ws.recv(), 60))
    return received


async def _close_code(ws) -> int | None:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 60)
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else None
