"""Reference audio in (decode, mix, resample, check, fit to frames) and PCM16 out."""

from __future__ import annotations

import io
import math
import struct

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio

from engine.codec.audio_io import (
    HOP,
    SAMPLE_RATE,
    AudioLimits,
    ReferenceAudioError,
    decode_audio,
    fit_to_frames,
    pcm16_to_float,
    prepare_waveform,
    to_pcm16,
)
from engine.config import ConfigError

RATES = [8000, 16000, 22050, 44100, 48000]
OPUS_RATES = {8000, 12000, 16000, 24000, 48000}  # what libsndfile's Opus writer accepts
# 1.27 s is 31.75 frames at 24 kHz: not a rounding tie, and the decoder has to pad.
DURATION = 1.27


def voiced(sr: int, seconds: float = DURATION, f0: float = 220.0) -> np.ndarray:
    """A few harmonics under a raised-cosine envelope: peak ~0.3, never all-zero."""
    t = np.arange(int(round(sr * seconds))) / sr
    env = 0.2 + 0.8 * (0.5 - 0.5 * np.cos(2 * np.pi * t / seconds))
    x = np.sin(2 * np.pi * f0 * t) + 0.5 * np.sin(4 * np.pi * f0 * t)
    x += 0.3 * np.sin(2 * np.pi * 4.5 * f0 * t + 0.7)
    return (0.3 / 1.8 * env * x).astype(np.float32)


def encode(samples: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def frames_for(n: int) -> int:
    """Nearest whole number of 960-sample frames, at least 1 (test durations avoid ties)."""
    return max(1, math.floor(n / HOP + 0.5))


def expected(mono: np.ndarray, sr: int) -> torch.Tensor:
    """The oracle: torchaudio resample to 24 kHz, then zero-pad or trim to whole frames."""
    y = torch.from_numpy(mono.astype(np.float32))
    if sr != SAMPLE_RATE:
        y = torchaudio.functional.resample(y, sr, SAMPLE_RATE)
    target = frames_for(y.shape[0]) * HOP
    if y.shape[0] >= target:
        return y[:target]
    return torch.cat([y, torch.zeros(target - y.shape[0])])


def check_shape(out: torch.Tensor, seconds: float, slack_frames: int) -> None:
    assert isinstance(out, torch.Tensor)
    assert out.dim() == 1
    assert out.dtype == torch.float32
    assert out.shape[0] % HOP == 0
    assert out.shape[0] >= HOP
    assert abs(out.shape[0] - seconds * SAMPLE_RATE) <= slack_frames * HOP
    assert torch.isfinite(out).all()
    assert out.abs().max() > 0.05  # the signal survived


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.shape[0], b.shape[0])
    return float(np.corrcoef(a[:n].numpy(), b[:n].numpy())[0, 1])


def error_of(fn, *args) -> ReferenceAudioError:
    with pytest.raises(ReferenceAudioError) as info:
        fn(*args)
    exc = info.value
    assert isinstance(exc, ConfigError)
    assert str(exc).strip()
    return exc


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("sr", RATES)
@pytest.mark.parametrize(
    "fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16")], ids=["wav", "flac"]
)
def test_lossless_mono_decodes_to_resampled_source(fmt, subtype, sr):
    src = voiced(sr)
    out = decode_audio(encode(src, sr, fmt, subtype), AudioLimits())
    check_shape(out, src.shape[0] / sr, slack_frames=1)
    ref = expected(src, sr)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 2e-3  # PCM16 quantisation is ~1.5e-5
    assert torch.all(out[-200:] == 0)  # 31.75 frames: zero-padded up to 32


@pytest.mark.parametrize("sr", RATES)
@pytest.mark.parametrize(
    "fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16")], ids=["wav", "flac"]
)
def test_lossless_stereo_is_the_mean_of_the_channels(fmt, subtype, sr):
    left, right = voiced(sr, f0=220.0), voiced(sr, f0=330.0)
    stereo = np.stack([left, right], axis=1)  # [N, 2]
    data = encode(stereo, sr, fmt, subtype)
    assert sf.info(io.BytesIO(data)).channels == 2
    out = decode_audio(data, AudioLimits())
    check_shape(out, left.shape[0] / sr, slack_frames=1)
    ref = expected((left + right) / 2, sr)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 2e-3
    # Not just one of the channels.
    assert (out - expected(left, sr)).abs().max().item() > 0.05
    assert (out - expected(right, sr)).abs().max().item() > 0.05


LOSSY = [("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")]


@pytest.mark.parametrize("sr", RATES)
@pytest.mark.parametrize("fmt,subtype", LOSSY, ids=["vorbis", "opus", "mp3"])
def test_lossy_formats_decode(fmt, subtype, sr):
    if subtype == "OPUS" and sr not in OPUS_RATES:
        pytest.skip(f"Opus cannot be written at {sr} Hz (libsndfile: 8/12/16/24/48 kHz only)")
    src = voiced(sr)
    try:
        data = encode(src, sr, fmt, subtype)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        pytest.skip(f"{fmt}/{subtype} encoder does not support {sr} Hz here: {exc}")
    out = decode_audio(data, AudioLimits())
    check_shape(out, src.shape[0] / sr, slack_frames=4)  # codec padding / priming
    # Lossy, but still the same waveform: strongly correlated and of similar level.
    ref = expected(src, sr)
    assert correlation(out, ref) > 0.95
    n = min(out.shape[0], ref.shape[0])
    ratio = float(out[:n].pow(2).mean().sqrt() / ref[:n].pow(2).mean().sqrt())
    assert 0.7 < ratio < 1.4


def test_24khz_float_wav_is_passed_through_exactly():
    src = voiced(SAMPLE_RATE, seconds=1.0)  # exactly 25 frames
    out = decode_audio(encode(src, SAMPLE_RATE, "WAV", "FLOAT"), AudioLimits())
    assert torch.equal(out, torch.from_numpy(src))


def test_prepare_waveform_accepts_1d_and_channels_first():
    left, right = voiced(16000, f0=200.0), voiced(16000, f0=300.0)
    mono = prepare_waveform(torch.from_numpy(left), 16000)
    assert torch.allclose(mono, expected(left, 16000), atol=1e-5)
    both = prepare_waveform(torch.from_numpy(np.stack([left, right])), 16000)
    assert torch.allclose(both, expected((left + right) / 2, 16000), atol=1e-5)
    f64 = prepare_waveform(torch.from_numpy(left.astype(np.float64)), 16000)
    assert f64.dtype == torch.float32
    assert torch.allclose(f64, mono, atol=1e-6)


# --------------------------------------------------------------------------- rejections


def test_empty_bytes():
    exc = error_of(decode_audio, b"", AudioLimits())
    assert exc.code == "audio_empty"
    assert "empty" in str(exc)


def test_empty_waveform():
    exc = error_of(prepare_waveform, torch.zeros(0), 16000)
    assert exc.code == "audio_empty"


def test_garbage_bytes_are_undecodable():
    junk = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    for data in (junk, b"this is not audio at all " * 40):
        exc = error_of(decode_audio, data, AudioLimits())
        assert exc.code == "audio_undecodable"
        assert "WAV" in str(exc) and "FLAC" in str(exc)  # says what is supported


def test_truncated_or_corrupted_wav_header_is_undecodable():
    wav = encode(voiced(16000), 16000, "WAV", "PCM_16")
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"
    broken = {
        "truncated header": wav[:30],
        "not WAVE": wav[:8] + b"XXXX" + wav[12:],
        "zero channels": wav[:22] + struct.pack("<H", 0) + wav[24:],
        "zero sample rate": wav[:24] + struct.pack("<I", 0) + wav[28:],
    }
    for what, data in broken.items():
        exc = error_of(decode_audio, data, AudioLimits())
        assert exc.code == "audio_undecodable", what
        assert "decoded" in str(exc), what


def test_too_many_bytes_is_rejected_before_decoding():
    data = encode(voiced(16000), 16000, "WAV", "PCM_16")
    limits = AudioLimits(max_bytes=len(data) - 1)
    exc = error_of(decode_audio, data, limits)
    assert exc.code == "audio_too_large"
    assert str(limits.max_bytes) in str(exc)
    # Exactly at the limit is fine.
    assert decode_audio(data, AudioLimits(max_bytes=len(data))).shape[0] % HOP == 0


def test_too_long():
    limits = AudioLimits(max_seconds=2)
    data = encode(voiced(16000, seconds=3.0), 16000, "WAV", "PCM_16")
    exc = error_of(decode_audio, data, limits)
    assert exc.code == "audio_too_long"
    assert "limit is 2" in str(exc)
    exc = error_of(prepare_waveform, torch.from_numpy(voiced(16000, seconds=3.0)), 16000, limits)
    assert exc.code == "audio_too_long"
    # The limit itself is allowed.
    ok = decode_audio(encode(voiced(16000, seconds=2.0), 16000, "WAV", "PCM_16"), limits)
    assert ok.shape[0] == 2 * SAMPLE_RATE


def test_long_file_is_rejected_without_decoding_it(monkeypatch):
    sr = 8000
    data = encode(voiced(sr, seconds=60.0), sr, "WAV", "PCM_16")
    reads = []
    real_read = sf.SoundFile.read

    def spy(self, *args, **kwargs):
        reads.append(args)
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(sf.SoundFile, "read", spy)
    exc = error_of(decode_audio, data, AudioLimits(max_seconds=2))
    assert exc.code == "audio_too_long"
    assert "60.0 s" in str(exc) and "limit is 2" in str(exc)
    assert reads == []  # the header's frame count was enough


def test_too_short():
    for data in (
        encode(voiced(16000, seconds=0.3), 16000, "WAV", "PCM_16"),
        encode(voiced(16000, seconds=0.01), 16000, "FLAC"),
    ):
        exc = error_of(decode_audio, data, AudioLimits())
        assert exc.code == "audio_too_short"
        assert "0.5" in str(exc)  # the minimum


def test_silence_and_near_silence():
    sr = 16000
    zeros = np.zeros(sr, dtype=np.float32)
    t = np.arange(sr) / sr
    quiet = (1e-4 * math.sqrt(2) * np.sin(2 * np.pi * 200 * t)).astype(np.float32)  # -80 dBFS
    for data in (encode(zeros, sr, "WAV", "PCM_16"), encode(quiet, sr, "WAV", "PCM_16")):
        exc = error_of(decode_audio, data, AudioLimits())
        assert exc.code == "audio_silent"
        assert "-60" in str(exc)
    for wave in (zeros, quiet):
        exc = error_of(prepare_waveform, torch.from_numpy(wave), sr)
        assert exc.code == "audio_silent"
    # -40 dBFS is quiet but usable.
    audible = (1e-2 * math.sqrt(2) * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    assert prepare_waveform(torch.from_numpy(audible), sr).abs().max() > 1e-3


def test_nan_and_inf_are_invalid():
    for bad in (float("nan"), float("inf"), float("-inf")):
        wave = torch.from_numpy(voiced(16000))
        wave[1234] = bad
        exc = error_of(prepare_waveform, wave, 16000)
        assert exc.code == "audio_invalid"
        assert "NaN" in str(exc)


def test_clipped_square_wave():
    sr = 16000
    t = np.arange(sr) / sr
    square = np.where(np.sin(2 * np.pi * 100 * t) >= 0, 1.0, -1.0).astype(np.float32)
    exc = error_of(decode_audio, encode(square, sr, "WAV", "PCM_16"), AudioLimits())
    assert exc.code == "audio_clipped"
    assert "lower level" in str(exc)
    exc = error_of(prepare_waveform, torch.from_numpy(square), sr)
    assert exc.code == "audio_clipped"
    # A loud but unclipped signal passes.
    assert prepare_waveform(torch.from_numpy(0.9 * square), sr).shape[0] == SAMPLE_RATE


# --------------------------------------------------------------------------- fit_to_frames


@pytest.mark.parametrize(
    "n,target",
    [(1, 960), (959, 960), (960, 960), (1439, 960), (1440, 1920), (1441, 1920), (24000, 24000)],
)
def test_fit_to_frames(n, target):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = fit_to_frames(x)
    assert out.shape == (target,)
    assert out.dtype == x.dtype
    keep = min(n, target)
    assert torch.equal(out[:keep], x[:keep])
    assert torch.all(out[keep:] == 0)


# --------------------------------------------------------------------------- PCM16


def test_pcm16_round_trip():
    x = torch.rand(5000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x[:3] = torch.tensor([-1.0, 0.0, 1.0])
    data = to_pcm16(x)
    assert isinstance(data, bytes)
    assert len(data) == 2 * x.shape[0]
    back = pcm16_to_float(data)
    assert back.dtype == np.float32
    assert np.abs(back - x.numpy()).max() <= 1 / 32767
    assert back[:3].tolist() == [-1.0, 0.0, 1.0]


def test_pcm16_saturates():
    data = to_pcm16(torch.tensor([2.0, -3.0, 1.0001, -1.5, float("inf"), float("-inf")]))
    assert np.frombuffer(data, dtype="<i2").tolist() == [32767, -32767] * 3


def test_pcm16_is_little_endian():
    assert to_pcm16(torch.tensor([0.5])) == b"\x00\x40"  # 16384
    assert to_pcm16(torch.tensor([-0.5])) == b"\x00\xc0"  # -16384
    assert to_pcm16(torch.tensor([1 / 32767])) == b"\x01\x00"
    assert pcm16_to_float(b"\x00\x40")[0] == np.float32(16384 / 32767)
    assert pcm16_to_float(b"\xff\x7f")[0] == 1.0


def test_a_sample_rate_too_costly_to_resample_is_invalid():
    """7,907 Hz is prime: 7907:24000 would need a ~190-million-tap filter (gigabytes, whatever
    the length); refused at once. 44.1 kHz (147:80) and 11.025 kHz (147:320) resample."""
    x = 0.1 * torch.sin(torch.arange(8000) / 5.0)
    with pytest.raises(ReferenceAudioError) as err:
        prepare_waveform(x, 7907)
    assert err.value.code == "audio_invalid" and "7907 Hz" in str(err.value)
    for rate in (44100, 11025):
        assert prepare_waveform(0.1 * torch.sin(torch.arange(rate) / 5.0), rate).numel() > 0
