"""Reference audio in: decode an uploaded file, mix to mono, resample to 24 kHz, check it,
and pad/trim to whole codec frames. PCM out: float waveform to PCM16 little-endian bytes.

Decoding uses libsndfile (through `soundfile`): WAV, FLAC, OGG/Vorbis, OGG/Opus, MP3, AIFF
and the rest of its formats, at any sample rate. Every rejection is a `ReferenceAudioError`
with a stable `code` and a message that says what to fix.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ConfigError

SAMPLE_RATE = 24000
HOP = 960


class ReferenceAudioError(ConfigError):
    """A reference upload that cannot be used; `code` is stable for clients to match on."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int = 10 * 1024 * 1024
    min_seconds: float = 0.5
    max_seconds: float = 30.0
    silence_dbfs: float = -60.0  # RMS below this is "silent"
    max_clipped_fraction: float = 0.01  # samples at full scale


def decode_audio(data: bytes, limits: AudioLimits = AudioLimits()) -> torch.Tensor:
    """Bytes of an audio file -> mono float32 waveform at 24 kHz, a whole number of frames."""
    import soundfile as sf

    if not data:
        raise ReferenceAudioError("audio_empty", "the reference audio is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ReferenceAudioError(
            "audio_too_large",
            f"the reference audio is {len(data)} bytes; the limit is {limits.max_bytes}",
        )
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = f.samplerate
            if f.frames > limits.max_seconds * rate * 1.01 + rate:  # before decoding it all
                raise _too_long(f.frames / rate, limits)
            samples = f.read(dtype="float32", always_2d=True)  # [N, channels]
    except ReferenceAudioError:
        raise
    except Exception as exc:
        raise ReferenceAudioError(
            "audio_undecodable",
            "the reference audio could not be decoded: it is corrupt or not a supported "
            "format (WAV, FLAC, OGG/Vorbis, OGG/Opus, MP3, AIFF)",
        ) from exc
    return prepare_waveform(torch.from_numpy(samples.T.copy()), rate, limits)


def prepare_waveform(
    waveform: torch.Tensor, sample_rate: int, limits: AudioLimits = AudioLimits()
) -> torch.Tensor:
    """`[channels, N]` or `[N]` float at any rate -> checked mono 24 kHz `[M]`, M % 960 == 0."""
    import torchaudio

    if waveform.dim() == 1:
        waveform = waveform[None]
    if waveform.numel() == 0:
        raise ReferenceAudioError("audio_empty", "the reference audio has no samples")
    if not torch.isfinite(waveform).all():
        raise ReferenceAudioError(
            "audio_invalid", "the reference audio contains NaN or infinite samples"
        )
    seconds = waveform.shape[1] / sample_rate
    if seconds > limits.max_seconds:
        raise _too_long(seconds, limits)
    if seconds < limits.min_seconds:
        raise ReferenceAudioError(
            "audio_too_short",
            f"the reference audio lasts {seconds:.2f} s; at least {limits.min_seconds} s is needed",
        )
    clipped = float((waveform.abs() >= 0.999).float().mean())
    if clipped > limits.max_clipped_fraction:
        raise ReferenceAudioError(
            "audio_clipped",
            f"{clipped:.1%} of the reference samples are at full scale (clipped); "
            "record at a lower level",
        )
    mono = waveform.float().mean(0)
    if sample_rate != SAMPLE_RATE:
        _check_resampling_cost(sample_rate)
        mono = torchaudio.functional.resample(mono, sample_rate, SAMPLE_RATE)
    rms = float(mono.pow(2).mean().sqrt())
    if rms == 0.0 or 20 * math.log10(rms) < limits.silence_dbfs:
        raise ReferenceAudioError(
            "audio_silent", f"the reference audio is silent (RMS below {limits.silence_dbfs} dBFS)"
        )
    return fit_to_frames(mono)


# Exact resampling by the ratio p:q (the rates over their gcd) builds a filter of about
# p x q taps: 44.1 kHz -> 24 kHz is 147:80; a 7,907 Hz file (prime) would be 7907:24000, a
# 190-million-tap filter taking gigabytes and seconds whatever the recording's length.
MAX_RESAMPLE_TAPS = 1_000_000


def _check_resampling_cost(sample_rate: int) -> None:
    g = math.gcd(sample_rate, SAMPLE_RATE)
    if (sample_rate // g) * (SAMPLE_RATE // g) > MAX_RESAMPLE_TAPS:
        raise ReferenceAudioError(
            "audio_invalid",
            f"the reference audio's sample rate ({sample_rate} Hz) is not supported: use a "
            "standard rate (8, 11.025, 16, 22.05, 24, 32, 44.1, 48, 88.2 or 96 kHz, ...)",
        )


def fit_to_frames(mono: torch.Tensor) -> torch.Tensor:
    """Pads (zeros) or trims to a multiple of 960 samples: the nearest whole frame count."""
    frames = max(1, int(mono.shape[0] / HOP + 0.5))  # halves round up
    target = frames * HOP
    if mono.shape[0] >= target:
        return mono[:target].contiguous()
    return torch.nn.functional.pad(mono, (0, target - mono.shape[0]))


def _too_long(seconds: float, limits: AudioLimits) -> ReferenceAudioError:
    return ReferenceAudioError(
        "audio_too_long",
        f"the reference audio lasts {seconds:.1f} s; the limit is {limits.max_seconds} s "
        "(3 to 10 s of clean speech works best)",
    )


def to_pcm16(waveform: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] -> PCM16 little-endian bytes (samples beyond are saturated)."""
    pcm = (waveform.detach().float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return pcm.cpu().numpy().astype("<i2", copy=False).tobytes()


def pcm16_to_float(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
