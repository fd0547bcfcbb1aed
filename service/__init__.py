"""clonecast service: the Starlette app (WebSocket protocol clonecast.v1, HTTP API), the engine
worker thread, metrics, the Python SDK and the command line. Imports only the engine's
public names."""
