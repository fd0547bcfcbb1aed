"""The browser-side clients' tests reuse the service tests' real servers on loopback."""

from tests.service.conftest import (  # noqa: F401 (fixtures)
    _engines_idle_after_test,
    make_server,
    model_cache,
)
