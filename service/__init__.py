"""clonecast service: the Starlette app (WebSocket protocol clonecast.v1, HTTP API), the engine
worker thread, metrics, the Python SDK and the command line. Imports only the engine's
public names."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("clonecast")  # the installed distribution's (pyproject.toml)
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"
