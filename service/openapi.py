"""The HTTP API described as OpenAPI 3.1 (`GET /openapi.json`) and as a page for people
(`GET /docs`, rendered from the same document). The speech request's fields come from
speech_api.SPEECH_FIELDS' schema here, checked against it by the tests; the WebSocket
protocol is described beside it in docs/protocol.md."""

from __future__ import annotations

import html

from service import VERSION

ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict:
    """The error answers of `statuses`; 401 brings 403: an endpoint that takes a key also
    checks the browser origin; 413 brings 408: an endpoint that reads a body bounds how long
    it may take to arrive."""
    if 401 in statuses:
        statuses = tuple(sorted({*statuses, 403}))
    if 413 in statuses:
        statuses = tuple(sorted({*statuses, 408}))
    meaning = {
        400: "bad input (the code says which)",
        401: "a valid API key is required",
        403: "forbidden_origin: a browser Origin not in CLONECAST_ALLOWED_ORIGINS",
        429: "rate_limited: the key is over a per-key limit (Retry-After says when to retry)",
        404: "no such voice (or another key's)",
        408: "request_timeout: the body did not arrive within CLONECAST_BODY_TIMEOUT_S",
        409: "a voice name already taken",
        413: "the body is too large",
        503: "not ready, or over capacity: retry",
        507: "the voice store is full",
    }
    return {
        str(s): {"description": meaning[s], "content": {"application/json": {"schema": ERROR}}}
        for s in statuses
    }


SPEECH_REQUEST = {
    "type": "object",
    "required": ["input"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
        "input": {"type": "string", "description": "the text to speak"},
        "voice": {
            "description": 'a voice id or name, OpenAI\'s {"id": ...}, or "default"',
            "oneOf": [
                {"type": "string"},
                {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}},
            ],
        },
        "response_format": {
            "type": "string",
            "enum": ["wav", "pcm", "pcm16", "flac", "mp3", "opus", "f32", "mulaw"],
            "default": "wav",
        },
        "speed": {"type": "number", "enum": [1.0], "description": "only 1.0"},
        "stream_format": {"type": "string", "enum": ["audio", "sse"]},
        "stream": {"type": "boolean", "description": 'true: as stream_format "audio"'},
        "sample_rate": {"type": "integer", "enum": [8000, 16000, 22050, 24000, 44100, 48000]},
        "temperature": {"type": "number", "minimum": 0},
        "top_k": {"type": "integer"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "seed": {"type": "integer"},
        "max_duration_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 81.6},
    },
}

VOICE = {
    "type": "object",
    "properties": {
        "voice_id": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "frames": {"type": "integer"},
        "duration_s": {"type": "number"},
        "transcript": {"type": ["string", "null"]},
        "created_at": {"type": "number"},
    },
}


def document() -> dict:
    audio = {
        media: {"schema": {"type": "string", "format": "binary"}}
        for media in (
            "audio/wav",
            "audio/pcm",
            "audio/flac",
            "audio/mpeg",
            "audio/ogg",
            "audio/x-f32le",
            "audio/basic",
        )
    }
    audio["text/event-stream"] = {"schema": {"type": "string"}}
    voice_path = {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "clonecast",
            "version": VERSION,
            "description": "Real-time voice cloning. This is the HTTP API; the streaming "
            "WebSocket protocol at ws://HOST:PORT/v1/stream is described in docs/protocol.md.",
        },
        "security": [{"bearer": []}, {"apiKeyHeader": []}, {"apiKeyQuery": []}, {}],
        "paths": {
            "/v1/audio/speech": {
                "post": {
                    "summary": "Speak a text (OpenAI's audio.speech)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/SpeechRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": {"description": "the audio", "content": audio},
                        **_errors(400, 401, 404, 413, 429, 503),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "The served model (its id is speech's `model`)",
                    "responses": {
                        "200": {"description": "the model list", "content": _json_object()},
                        **_errors(401, 503),
                    },
                }
            },
            "/v1/voices": {
                "post": {
                    "summary": "Register a voice from a reference recording",
                    "parameters": [
                        {"name": "transcript", "in": "query", "schema": {"type": "string"}},
                        {"name": "name", "in": "query", "schema": {"type": "string"}},
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["audio_b64"],
                                    "properties": {
                                        "audio_b64": {"type": "string"},
                                        "transcript": {"type": "string"},
                                        "name": {"type": "string"},
                                    },
                                }
                            },
                            "multipart/form-data": {
                                "schema": {
                                    "type": "object",
                                    "required": ["file"],
                                    "properties": {
                                        "file": {"type": "string", "format": "binary"},
                                        "transcript": {"type": "string"},
                                        "name": {"type": "string"},
                                    },
                                }
                            },
                            "application/octet-stream": {
                                "schema": {"type": "string", "format": "binary"}
                            },
                        },
                    },
                    "responses": {
                        "200": _voice_response("already registered"),
                        "201": _voice_response("registered"),
                        **_errors(400, 401, 409, 413, 503, 507),
                    },
                },
                "get": {
                    "summary": "The voices this key sees",
                    "responses": {
                        "200": {"description": "the voices", "content": _json_object()},
                        **_errors(401, 503),
                    },
                },
            },
            "/v1/voices/{voice_id}": {
                "parameters": [voice_path],
                "get": {
                    "summary": "One voice, by id or name",
                    "responses": {"200": _voice_response("the voice"), **_errors(401, 404)},
                },
                "delete": {
                    "summary": "Delete a voice, by id or name",
                    "responses": {"204": {"description": "deleted"}, **_errors(401, 404)},
                },
            },
            "/v1/tokens": {
                "post": {
                    "summary": "A short-lived browser token for the WebSocket's ?token=",
                    "requestBody": {
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "ttl_s": {"type": "integer", "minimum": 1},
                                        "origin": {"type": "string"},
                                    },
                                }
                            }
                        }
                    },
                    "responses": {
                        "200": {"description": "the token", "content": _json_object()},
                        **_errors(400, 401, 413),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness (open): ok, loading, failed or engine_exited",
                    "security": [],
                    "responses": {
                        "200": {"description": "serving or loading", "content": _json_object()},
                        "503": {"description": "failed or engine exited"},
                    },
                }
            },
            "/ready": {
                "get": {
                    "summary": "Readiness (open): the model, the execution plan",
                    "security": [],
                    "responses": {
                        "200": {"description": "ready", "content": _json_object()},
                        "503": {"description": "loading, with its progress"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (open; docs/observability.md)",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "text exposition",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "SpeechRequest": SPEECH_REQUEST,
                "Voice": VOICE,
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                            },
                        }
                    },
                },
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                "apiKeyQuery": {"type": "apiKey", "in": "query", "name": "api_key"},
            },
        },
    }


def _json_object() -> dict:
    return {"application/json": {"schema": {"type": "object"}}}


def _voice_response(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Voice"}}},
    }


def page(spec: dict) -> str:
    """The document as a page: each endpoint, what it does, its fields and its answers."""
    rows = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            answers = ", ".join(f"{code} {r['description']}" for code, r in op["responses"].items())
            rows.append(
                f"<tr><td><code>{method.upper()} {html.escape(path)}</code></td>"
                f"<td>{html.escape(op['summary'])}</td><td>{html.escape(answers)}</td></tr>"
            )
    fields = "".join(
        f"<tr><td><code>{name}</code></td><td>{html.escape(_kind(schema))}</td>"
        f"<td>{html.escape(schema.get('description', ''))}</td></tr>"
        for name, schema in spec["components"]["schemas"]["SpeechRequest"]["properties"].items()
    )
    info = spec["info"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{info["title"]} HTTP API</title>
<style>body{{font:15px/1.5 system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem}}
table{{border-collapse:collapse;width:100%;margin:1rem 0}}td,th{{border:1px solid #ccc;
padding:.3rem .5rem;text-align:left;vertical-align:top}}code{{white-space:nowrap}}</style>
</head><body><h1>{info["title"]} {info["version"]}: the HTTP API</h1>
<p>{html.escape(info["description"])} The machine-readable document:
<a href="/openapi.json">/openapi.json</a> (OpenAPI {spec["openapi"]}). Authentication, when
the server has keys: <code>Authorization: Bearer KEY</code>, <code>X-API-Key</code> or
<code>?api_key=</code>.</p>
<h2>Endpoints</h2><table><tr><th>endpoint</th><th>what it does</th><th>answers</th></tr>
{"".join(rows)}</table>
<h2>POST /v1/audio/speech fields</h2><table><tr><th>field</th><th>kind</th><th>meaning</th></tr>
{fields}</table><p>Any other field is refused (400 <code>unknown_field</code>).</p>
</body></html>
"""


def _kind(schema: dict) -> str:
    if "enum" in schema:
        return " | ".join(str(v) for v in schema["enum"])
    if "oneOf" in schema:
        return "string or object"
    return str(schema.get("type", ""))
