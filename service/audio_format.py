"""Output formats for streamed audio: PCM16 / float32 / G.711 mu-law / WAV at 8-48 kHz.

The engine produces PCM16 at 24 kHz in chunks. `StreamEncoder` converts chunk by chunk with a
streaming resampler that keeps context on both sides of every cut, so the concatenated
output equals resampling the whole utterance at once (no clicks at chunk boundaries). It
holds back a few milliseconds of input for look-ahead and releases them on `finish()`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from engine import SAMPLE_RATE as ENGINE_RATE
from engine import StreamingResampler

FORMATS = ("pcm16", "f32", "mulaw", "wav")
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)


@dataclass(frozen=True)
class OutputFormat:
    format: str = "pcm16"
    sample_rate: int = ENGINE_RATE

    @classmethod
    def parse(cls, spec: dict | None) -> OutputFormat:
        """From the protocol's `output` object; ValueError with a clear message if invalid."""
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(f"output must be an object, got {type(spec).__name__}")
        spec = dict(spec or {})
        fmt = spec.pop("format", "pcm16")
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise ValueError(f"output.format must be one of {list(FORMATS)}, got {fmt!r}")
        default_rate = 8000 if fmt == "mulaw" else ENGINE_RATE
        rate = spec.pop("sample_rate", default_rate)
        if type(rate) is not int or rate not in SAMPLE_RATES:
            raise ValueError(
                f"output.sample_rate must be one of {list(SAMPLE_RATES)}, got {rate!r}"
            )
        if spec:
            raise ValueError(f"unknown output field(s) {sorted(spec)}")
        return cls(fmt, rate)

    @property
    def bytes_per_sample(self) -> int:
        return {"pcm16": 2, "wav": 2, "f32": 4, "mulaw": 1}[self.format]


class StreamEncoder:
    """PCM16 24 kHz chunks in, bytes of the requested format out; `finish()` once at the end."""

    def __init__(self, fmt: OutputFormat):
        self.fmt = fmt
        self._resampler = (
            StreamingResampler(fmt.sample_rate) if fmt.sample_rate != ENGINE_RATE else None
        )
        self._header_sent = False
        self.header_bytes = 0  # bytes of WAV header inside the last returned chunk

    def encode(self, pcm16: bytes) -> bytes:
        if self._resampler is None and self.fmt.format in ("pcm16", "wav"):
            return self._with_header(pcm16)
        x = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
        if self._resampler is not None:
            x = self._resampler.push(x)
        return self._with_header(self._convert(x))

    def finish(self) -> bytes:
        tail = self._resampler.finish() if self._resampler is not None else np.zeros(0, np.float32)
        return self._with_header(self._convert(tail))

    def _convert(self, x: np.ndarray) -> bytes:
        if self.fmt.format == "f32":
            return x.astype("<f4").tobytes()
        pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2")
        if self.fmt.format == "mulaw":
            return mulaw_encode(pcm).tobytes()
        return pcm.tobytes()

    def _with_header(self, payload: bytes) -> bytes:
        self.header_bytes = 0
        if self.fmt.format != "wav" or self._header_sent:
            return payload
        self._header_sent = True
        header = wav_header(self.fmt.sample_rate, None)
        self.header_bytes = len(header)
        return header + payload


def mulaw_encode(pcm: np.ndarray) -> np.ndarray:
    """G.711 mu-law: int16 samples -> one byte each."""
    x = pcm.astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.clip(np.floor(np.log2(magnitude)).astype(np.int32) - 7, 0, 7)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def mulaw_decode(data: np.ndarray) -> np.ndarray:
    """G.711 mu-law bytes -> int16 samples (for tests and clients)."""
    u = ~data.astype(np.int32) & 0xFF
    exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
    magnitude = ((mantissa << 3) + 0x84) << exponent
    return np.where(u & 0x80, 0x84 - magnitude, magnitude - 0x84).astype(np.int16)


def wav_header(rate: int, data_bytes: int | None) -> bytes:
    """A PCM16 mono WAV header; `None` sizes (0xFFFFFFFF) for a stream of unknown length."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )
