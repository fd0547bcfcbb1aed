"""The dashboards' tests check their queries against a real server's /metrics."""

from tests.service.conftest import (  # noqa: F401 (fixtures)
    _engines_idle_after_test,
    make_server,
    model_cache,
    server,
)
