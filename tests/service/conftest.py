"""A real uvicorn server on a loopback port, in a background thread, on the embedded
default model (CPU). `make_server(**limits)` starts one with custom limits/settings."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import uvicorn

from service.app import create_app
from service.config import Limits, ServiceSettings


class RunningServer:
    def __init__(self, settings: ServiceSettings):
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                ws_max_size=2 * settings.limits.max_message_bytes, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/v1/stream"

    @property
    def services(self):
        return self.app.state.services

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def make_server(model_cache):
    servers = []

    def make(api_keys=(), allowed_origins=(), max_num_seqs=16, **limits) -> RunningServer:
        settings = ServiceSettings(device="cpu", cache_dir=model_cache, api_keys=tuple(api_keys),
                                   allowed_origins=tuple(allowed_origins), max_num_seqs=max_num_seqs,
                                   limits=dataclasses.replace(Limits(), **limits))
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
