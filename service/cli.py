"""The `clonecast` command line.

`clonecast synthesize`: speak a text (optionally in the voice of a reference recording) into a
WAV file, written chunk by chunk as the audio streams out of the engine.
`clonecast generate`: write the generated delayed audio-code rows to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import wave
from pathlib import Path

from clonecast_client.say import add_say_parser

# torch-free names only at the top: `--help` and `--version` answer without loading torch
from engine import (
    FRAMES_PER_SECOND,
    MAX_ROWS,
    SAMPLE_RATE,
    ConfigError,
    EngineConfig,
    SamplingParams,
)
from service import VERSION
from service.config import ServiceSettings, config_file


def _device(requested: str | None) -> str:
    from engine import default_device

    return requested or default_device()


def _settings(config: str | None = None, **overrides) -> ServiceSettings:
    """The settings: command-line flags over the environment over a `--config` file; a bad
    one is a ConfigError (one line, exit 2)."""
    try:
        env = {**config_file(Path(config)), **os.environ} if config else None
        return ServiceSettings.from_env(env, **overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    params = _params(args)
    t0 = time.perf_counter()
    [result] = engine.generate([args.text], params=params, audio=False)
    seconds = time.perf_counter() - t0
    frames = max(0, len(result.rows) - 8)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": str(engine.checkpoint),
                "untrained_default_model": engine.is_default_model,
                "text": args.text,
                "finish_reason": result.finish_reason,
                "delayed_rows": [list(r) for r in result.rows],
            }
        )
    )
    print(
        f"{len(result.rows)} rows ({frames / FRAMES_PER_SECOND:.2f} s of audio, "
        f"finish: {result.finish_reason}) in {seconds:.2f} s -> {out}"
    )
    return 0


def _engine(args: argparse.Namespace, max_num_seqs: int = 4):
    from engine import UNTRAINED_NOTICE, Engine

    settings = _settings()
    config = EngineConfig(device=_device(args.device or settings.device), max_num_seqs=max_num_seqs)
    engine = Engine.from_pretrained(
        args.model or settings.model, config, codec=args.codec, cache_dir=settings.cache_dir
    )
    if engine.is_default_model:
        print(f"note: {UNTRAINED_NOTICE}", file=sys.stderr)
    return engine


def synthesize(args: argparse.Namespace) -> int:
    data = None
    if args.reference:  # read before the model loads: a wrong path fails at once
        try:
            data = Path(args.reference).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the reference recording: {exc}") from exc
    engine = _engine(args)
    reference = None
    if data is not None:
        t0 = time.perf_counter()
        reference = engine.encode_reference(data, args.transcript)
        print(
            f"reference: {len(reference.codes)} frames encoded in {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
        )
    params = _params(args)
    engine.add_request("cli", args.text, reference=reference, params=params, audio=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    first_audio = None
    seconds = 0.0
    reason = "?"
    with wave.open(str(out), "wb") as wav:  # header sizes are patched on close
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        while engine.has_unfinished():
            for event in engine.step():
                chunk = event.audio
                if chunk is not None:
                    if chunk.error:
                        print(f"\nerror: {chunk.error}", file=sys.stderr)
                        return 1
                    wav.writeframes(chunk.pcm)
                    seconds += chunk.duration_s
                    if first_audio is None and chunk.pcm:
                        first_audio = time.perf_counter() - t0
                    if sys.stderr.isatty():  # a log gets the summary line only
                        elapsed = time.perf_counter() - t0
                        print(
                            f"\r{chunk.index + 1} chunks, {seconds:6.2f} s of audio in "
                            f"{elapsed:6.2f} s",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                if event.finished:
                    reason = event.finish_reason
    elapsed = time.perf_counter() - t0
    rtf = elapsed / seconds if seconds else float("inf")
    first = f"{first_audio * 1e3:.0f} ms" if first_audio is not None else "-"
    print(
        f"{chr(10) if sys.stderr.isatty() else ''}{seconds:.2f} s of audio (finish: {reason}), "
        f"first audio {first}, "
        f"real-time factor {rtf:.2f} -> {out}",
        file=sys.stderr,
    )
    return 0


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_rows=args.max_rows,
    )


def _add_common(p: argparse.ArgumentParser, max_rows: int) -> None:
    p.add_argument("--text", required=True)
    p.add_argument("--model", help="checkpoint dir or hub id (default: embedded default model)")
    p.add_argument("--codec", help="standalone Higgs audio tokenizer (default: the bundled one)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rows", type=int, default=max_rows)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app, uvicorn_options
    from service.drain import DrainingServer
    from service.logs import log_config

    settings = _settings(
        args.config,
        api_keys=tuple(args.api_key) if args.api_key else None,
        api_key_file=Path(args.api_key_file) if args.api_key_file else None,
        model=args.model,
        codec=args.codec,
        device=args.device,
        devices=tuple(d.strip() for d in args.devices.split(",") if d.strip())
        if args.devices
        else None,
        engines=args.engines,
        host=args.host,
        port=args.port,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        cuda_graphs=False if args.eager else None,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        prefix_caching=False if args.no_prefix_caching else None,
    )
    _check_port(settings.host, settings.port)
    _check_model_path(settings.model)
    app = create_app(settings)
    print(
        f"clonecast: loading {settings.model or 'the embedded default model (untrained)'}; "
        f"serving on http://{settings.host}:{settings.port} "
        f"(WebSocket ws://{settings.host}:{settings.port}/v1/stream)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        log_config=log_config(args.log_level),  # clonecast's loggers too; secrets redacted
        **uvicorn_options(settings),
    )
    services = app.state.services
    server = DrainingServer(config, services)  # SIGTERM / SIGINT: drain, then exit 0
    # the port is bound while the model loads; a failed load stops the server, one line
    services.on_load_failed = lambda: setattr(server, "should_exit", True)
    server.run()
    if services.load_error is not None:
        print(f"error: {services.load_error}", file=sys.stderr)
        return 1
    return 0


def key_new(args: argparse.Namespace) -> int:
    """A line for the API key file on stdout (`>> FILE` appends it) and, on stderr, the fresh
    key it stands for, shown this once: the server keeps only its hash. `--stdin`: the line
    of an existing key (read from stdin), e.g. to move a CLONECAST_API_KEYS key into a file
    (its voices stay its own)."""
    from service.api_keys import key_file_line, new_key

    key = sys.stdin.readline().strip() if args.stdin else new_key()
    if not key:
        raise ConfigError("--stdin: no key on standard input")
    try:
        line = key_file_line(args.name, key, args.admin)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not args.stdin:
        print(f"the API key of {args.name} (shown once, keep it secret): {key}", file=sys.stderr)
    print(line)
    return 0


def _check_model_path(model: str | None) -> None:
    """A model given as a path (not a hub id) that does not exist, before anything loads."""
    if model is None or not model.startswith((".", "/", "~")):
        return
    if not Path(model).expanduser().is_dir():
        raise ConfigError(f"--model / CLONECAST_MODEL {model!r} is not a directory")


def _check_port(host: str, port: int) -> None:
    """A port already in use, in one line naming the setting (before the model loads)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} (--port / CLONECAST_PORT): {exc.strerror}"
            ) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clonecast", description=__doc__)
    parser.add_argument("--version", action="version", version=f"clonecast {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("serve", help="run the WebSocket/HTTP service")
    v.add_argument("--model", help="checkpoint dir or hub id (default: embedded default model)")
    v.add_argument("--codec", help="standalone Higgs audio tokenizer (default: the bundled one)")
    v.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    v.add_argument(
        "--devices",
        metavar="LIST",
        help="one engine on each of these devices, e.g. cuda:0,cuda:1 (default: one engine)",
    )
    v.add_argument(
        "--engines", type=int, metavar="N", help="N engines on --device (default 1; on the CPU)"
    )
    v.add_argument("--host", help="bind address (default 127.0.0.1)")
    v.add_argument("--port", type=int, help="port (default 8737)")
    v.add_argument("--max-num-seqs", type=int, help="requests decoded together (default 64)")
    v.add_argument(
        "--max-batched-tokens",
        type=int,
        metavar="N",
        help="token positions a step may run, decodes and prompts (default max(512, "
        "--max-num-seqs))",
    )
    v.add_argument("--eager", action="store_true", help="no CUDA graphs (debugging, comparison)")
    v.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        help="KV cache element type (default auto: the model's; fp8: twice the blocks, lossy)",
    )
    v.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        help="projection weights (default none: the model's dtype; fp8: float8, lossy)",
    )
    v.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full, never reusing an earlier prompt's KV blocks "
        "(a worst-case measure; default: reuse)",
    )
    v.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept this API key (repeat for several; default: CLONECAST_API_KEYS, or none: "
        "no authentication)",
    )
    v.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="accept the keys of this file of 'NAME SHA256HEX [admin]' lines (default: "
        "CLONECAST_API_KEY_FILE; `clonecast key new NAME` makes a line)",
    )
    v.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of CLONECAST_* settings (the environment and these flags win)",
    )
    v.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="server log level (default: info)",
    )
    v.set_defaults(func=serve)
    k = sub.add_parser("key", help="API keys for --api-key-file")
    key_sub = k.add_subparsers(dest="key_command", required=True)
    n = key_sub.add_parser(
        "new",
        help="make a key: its file line on stdout (append it to the key file), the key itself "
        "on stderr (shown once)",
    )
    n.add_argument(
        "name", help="the key's name: what logs and metrics show (1-64 of A-Z a-z 0-9 _ . -)"
    )
    n.add_argument("--admin", action="store_true", help="the key sees and deletes every voice")
    n.add_argument(
        "--stdin", action="store_true", help="the line of an existing key read from stdin"
    )
    n.set_defaults(func=key_new)
    s = sub.add_parser("synthesize", help="speak a text into a WAV file, streaming")
    _add_common(s, max_rows=MAX_ROWS)
    s.add_argument("--reference", help="reference recording to clone (WAV/FLAC/OGG/MP3...)")
    s.add_argument("--transcript", help="what the reference recording says")
    s.add_argument("--out", default="out/speech.wav")
    s.set_defaults(func=synthesize)
    add_say_parser(sub)
    g = sub.add_parser("generate", help="generate audio-code rows for a text")
    _add_common(g, max_rows=200)
    g.add_argument("--out", default="out/codes.json")
    g.set_defaults(func=generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
