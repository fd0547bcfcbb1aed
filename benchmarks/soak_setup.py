"""The soak's preparation (benchmarks/soak.py): its reference recordings (synthetic, seeded:
benchmarks/voice_pool.py), the voices it registers (half over the WebSocket, half over
HTTP, each under a name too), the clients, and the warm-up pass (every scenario once per
client, every recording encoded once) that precedes the baseline sample, so that pools and
caches filled on first use are not counted as growth."""

from __future__ import annotations

import asyncio
import base64
import random
import time

import httpx

from benchmarks.soak_conn import Conn, Unexpected, next_item
from benchmarks.soak_faults import FAULTS
from benchmarks.soak_load import NORMAL, Client, Load, run_one
from benchmarks.voice_pool import pool


def scenarios() -> dict:
    """name: (scenario, weight): the normal ones and the faults together."""
    return {**NORMAL, **FAULTS}


async def _register(ws_url: str, http: httpx.AsyncClient, voices) -> list[str]:
    """Each voice under its id and its name `soak-I` (so both are used): even ones by
    `voice.create`, odd ones by POST /v1/voices."""
    keys = []
    conn = await Conn.open(ws_url)
    try:
        for i, (audio, transcript) in enumerate(voices):
            b64, name = base64.b64encode(audio).decode(), f"soak-{i}"
            body = {"audio_b64": b64, "transcript": transcript, "name": name}
            if i % 2 == 0:
                queue = conn.expect(f"reg{i}")
                await conn.send({"type": "voice.create", "request_id": f"reg{i}", **body})
                created = await next_item(queue, _deadline(120))
                if created.get("type") != "voice.created":
                    raise Unexpected(f"registering {name}: {created}")
                voice_id = created["voice_id"]
            else:
                response = await http.post("/v1/voices", json=body)
                if response.status_code not in (200, 201):
                    raise Unexpected(f"registering {name}: {response.status_code} {response.text}")
                voice_id = response.json()["voice_id"]
            keys += [voice_id, name]
    finally:
        await conn.close()
    return keys


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


async def clients_for(
    ws_url: str, http_url: str, num_clients: int, num_voices: int, max_duration_s: float, seed: int
) -> tuple[Load, list[Client]]:
    recordings = pool(num_voices + 3 + 2 * num_clients, seed)
    registered, inline = recordings[:num_voices], recordings[num_voices : num_voices + 3]
    churn = recordings[num_voices + 3 :]
    async with httpx.AsyncClient(base_url=http_url, timeout=120) as http:
        keys = await _register(ws_url, http, registered)
    load = Load(ws_url, http_url, keys, inline, max_duration_s)
    users = [
        Client(
            index=i,
            load=load,
            rng=random.Random(seed * 1000 + i),
            http=httpx.AsyncClient(base_url=http_url, timeout=120),
            churn=churn[2 * i : 2 * i + 2],
        )
        for i in range(num_clients)
    ]
    return load, users


async def warm_up(users: list[Client]) -> None:
    """Every scenario once per client (the clients at once), then each churn and inline
    recording encoded once more (registered and deleted over HTTP), so the voice cache holds
    every recording of the run before the baseline."""

    async def one(user: Client) -> None:
        for name, (scenario, _) in scenarios().items():
            await run_one(user, name, scenario)
        for audio, transcript in user.churn + (user.load.inline if user.index == 0 else []):
            b64 = base64.b64encode(audio).decode()
            created = await user.http.post(
                "/v1/voices", json={"audio_b64": b64, "transcript": transcript}
            )
            if created.status_code in (200, 201):
                await user.http.delete(f"/v1/voices/{created.json()['voice_id']}")
            else:
                user.load.tally.fail("warm_up", f"registering a churn voice: {created.text}")
        # The baseline is taken with no connection open: neither the WebSocket nor the
        # HTTP client's kept-alive ones (each an open file of the server's).
        if user.conn is not None:
            await user.conn.close()
        await user.http.aclose()
        user.http = httpx.AsyncClient(base_url=user.load.http_url, timeout=120)

    await asyncio.gather(*(one(user) for user in users))
