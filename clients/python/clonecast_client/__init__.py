"""clonecast-client: the Python client of the clonecast real-time voice-cloning server
(WebSocket protocol clonecast.v1, docs/protocol.md). Standard library plus `websockets`.

    from clonecast_client import AsyncClient, Client, ClonecastError

`AsyncClient` (asyncio) and `Client` (blocking, on a private event loop) share one protocol
implementation (`clonecast_client.aio`); `clonecast_client.wire` holds the wire constants;
`clonecast_client.say` is the `clonecast say` command. This import path is stable.
"""

from clonecast_client.aio import DEFAULT_URL, AsyncClient, Chunk, ClonecastError, Utterance
from clonecast_client.sync import Client, SyncUtterance

__all__ = [
    "DEFAULT_URL",
    "AsyncClient",
    "Chunk",
    "Client",
    "ClonecastError",
    "SyncUtterance",
    "Utterance",
]
