"""`clonecast say`: speak a text through a running clonecast server (docs/protocol.md) into a
WAV file or to the speakers, written as the audio streams in, with latency on stderr.

A client only: it talks to the server through clonecast_client.sync and never imports the
engine, torch or starlette. The server's `clonecast` command adds it (`add_say_parser`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import wave
from pathlib import Path
from typing import Any

from clonecast_client.aio import DEFAULT_URL, ClonecastError
from clonecast_client.sync import Client, SyncUtterance
from clonecast_client.wire import DEFAULT_SAMPLE_RATE as SAMPLE_RATE

DEFAULT_OUT = "out/say.wav"


class _WavSink:
    """The WAV is written beside its name as the audio arrives and takes its name when the
    utterance has ended (done or cancelled); a failed one leaves no file behind."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.where = path, str(path)
        self._partial = path.with_name(f".{path.name}.partial")
        self._wav = wave.open(str(self._partial), "wb")  # sizes are patched after every write
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(SAMPLE_RATE)

    def write(self, pcm: bytes) -> None:
        self._wav.writeframes(pcm)

    def close(self, failed: bool = False) -> None:
        self._wav.close()
        if failed:
            self._partial.unlink(missing_ok=True)
        else:
            os.replace(self._partial, self.path)


class _SpeakerSink:
    where = "the speakers"

    def __init__(self, sounddevice: Any):
        self._stream = sounddevice.RawOutputStream(
            samplerate=SAMPLE_RATE, channels=1, dtype="int16"
        )
        self._stream.start()

    def write(self, pcm: bytes) -> None:
        self._stream.write(pcm)

    def close(self, failed: bool = False) -> None:
        self._stream.stop()  # plays what is buffered before returning
        self._stream.close()


def _import_sounddevice() -> Any:
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: PortAudio itself is missing
        print(
            f"error: --play needs the sounddevice package ({exc}); "
            "`pip install sounddevice`, or write a file with --out PATH",
            file=sys.stderr,
        )
        return None
    return sounddevice


def _stream(utt: SyncUtterance, sink: _WavSink | _SpeakerSink, t0: float) -> None:
    chunks, audio_s, first_audio = 0, 0.0, None
    live = sys.stderr.isatty()
    try:
        for chunk in utt:
            if first_audio is None:
                first_audio = time.perf_counter() - t0
            sink.write(chunk.data)
            chunks += 1
            audio_s += len(chunk.data) / 2 / SAMPLE_RATE
            if live:  # a terminal: one line rewritten in place (a log gets the summary only)
                elapsed = time.perf_counter() - t0
                progress = f"\r{chunks} chunks, {audio_s:6.2f} s of audio in {elapsed:6.2f} s"
                print(progress, end="", file=sys.stderr, flush=True)
    finally:
        if chunks and live:
            print(file=sys.stderr)  # ends the progress line
    first = f"{first_audio * 1e3:.0f} ms" if first_audio is not None else "-"
    reason = (utt.done or {}).get("reason", "cancelled")
    print(
        f"first audio {first}, {audio_s:.2f} s of audio in {time.perf_counter() - t0:.2f} s "
        f"(done: {reason}) -> {sink.where}",
        file=sys.stderr,
    )


def say(args: argparse.Namespace) -> int:
    if args.transcript is not None and args.reference is None:
        print("error: --transcript describes --reference; give both", file=sys.stderr)
        return 2
    try:
        reference = Path(args.reference).read_bytes() if args.reference else None
    except OSError as exc:
        print(f"error: cannot read --reference: {exc}", file=sys.stderr)
        return 2
    params = {
        k: v
        for k, v in (
            ("seed", args.seed),
            ("temperature", args.temperature),
            ("max_duration_s", args.max_duration),
        )
        if v is not None
    }
    sounddevice = _import_sounddevice() if args.play else None
    if args.play and sounddevice is None:
        return 2
    try:
        with Client.connect(args.url, args.api_key) as client:
            if client.model_untrained:
                notice = client.ready.get("model", {}).get("notice") or "the model is untrained"
                print(f"note: {notice}", file=sys.stderr)
            voice_id = args.voice_id
            if reference is not None:
                voice_id = client.create_voice(reference, args.transcript)
                print(f"voice: {voice_id}", file=sys.stderr)
            t0 = time.perf_counter()
            utt = client.speak(
                args.text,
                voice_id=voice_id,
                params=params,
                output={"format": "pcm16", "sample_rate": SAMPLE_RATE},
            )
            sink = (
                _SpeakerSink(sounddevice) if args.play else _WavSink(Path(args.out or DEFAULT_OUT))
            )
            failed = True
            try:
                _stream(utt, sink, t0)
                failed = False
            except KeyboardInterrupt:
                utt.cancel()
                failed = False  # the audio so far is kept
                print("cancelled", file=sys.stderr)
                return 130
            finally:
                sink.close(failed)
    except ClonecastError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


def add_say_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "say",
        help="speak a text through a running clonecast server",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--url", default=DEFAULT_URL, help=f"server WebSocket URL (default {DEFAULT_URL})"
    )
    p.add_argument(
        "--api-key",
        help="sent as 'Authorization: Bearer KEY' when the server sets CLONECAST_API_KEYS "
        "(not read from the environment: pass it here)",
    )
    p.add_argument("--text", required=True)
    voice = p.add_mutually_exclusive_group()
    voice.add_argument("--reference", help="recording to clone (WAV/FLAC/OGG/Opus/MP3)")
    voice.add_argument("--voice-id", help="a voice the server already has")
    p.add_argument("--transcript", help="what the --reference recording says")
    p.add_argument("--seed", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-duration", type=float, help="seconds of audio at most per sentence")
    sink = p.add_mutually_exclusive_group()
    sink.add_argument("--out", help=f"WAV file to write as audio arrives (default {DEFAULT_OUT})")
    sink.add_argument("--play", action="store_true", help="play to the speakers (sounddevice)")
    p.set_defaults(func=say)
    return p


def main(argv: list[str] | None = None) -> int:
    """`clonecast-say`: the same command for a machine with only the client installed."""
    parser = argparse.ArgumentParser(prog="clonecast-say", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    add_say_parser(commands)
    args = parser.parse_args(["say", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
