"""Two service apps in one process (as in these tests, and as the per-app metrics registry
intends): each has its own engine, so generating on both at the same time must give each
client its complete audio, the same as when it runs alone."""

from __future__ import annotations

import asyncio

from .conftest import FRAME_BYTES, collect, frames_for, open_ws, run, speak


def test_two_apps_generate_at_the_same_time(make_server):
    a, b = make_server(), make_server()

    async def one(server, uid):
        async with open_ws(server.ws) as ws:
            await ws.send(speak(uid, "Some words to say here.", dur=3.0, seed=30))
            return (await collect(ws, [uid]))[uid]

    async def main():
        alone = await one(a, "alone")
        both = await asyncio.gather(one(a, "a"), one(b, "b"))
        return alone, both

    alone, both = run(main())
    assert alone.done is not None and len(alone.payload) == frames_for(3.0) * FRAME_BYTES
    for u in both:
        assert u.errors == [], u.errors
        assert u.done is not None
        assert u.payload == alone.payload
