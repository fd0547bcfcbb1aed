"""Reference voices for the served benchmark: `pool(n, seed)` gives n distinct synthetic
recordings of 3-6 s (a harmonic voice-like tone, its own pitch contour and rhythm each) with
transcripts, so that each voice's clone prompt is its own (about 75-150 audio frames plus
its transcript: ~200 prompt positions with the text) and only requests of the same voice
share a prefix, as real traffic does."""

from __future__ import annotations

import io
import random

import numpy as np

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright birds sing near the old "
    "stone bridge and children laugh as the river runs past green fields toward the quiet "
    "town where bakers open their doors early every morning to sell warm bread"
).split()


def reference_wav(seconds: float, seed: int = 0, f0: float = 120.0) -> bytes:
    """A WAV of `seconds` at 24 kHz: harmonics of a pitch contour around `f0`, syllable-rate
    amplitude modulation and a little noise."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24000)) / 24000
    contour = f0 * (1 + 0.3 * np.sin(2 * np.pi * rng.uniform(0.3, 0.8) * t + rng.uniform(0, 6)))
    phase = 2 * np.pi * np.cumsum(contour) / 24000
    x = sum(np.sin(k * phase) / k for k in range(1, 8))
    syllables = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(2.5, 4.5) * t)
    x = 0.2 * x * syllables + 0.003 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), 24000, format="WAV")
    return buf.getvalue()


def pool(n: int, seed: int = 0) -> list[tuple[bytes, str]]:
    """n (recording, transcript) pairs, 3-6 s each, about 2.5 words a second; all distinct."""
    rng = random.Random(seed)
    voices = []
    for v in range(n):
        seconds = rng.uniform(3.0, 6.0)
        words = [rng.choice(WORDS) for _ in range(max(6, round(seconds * 2.5)))]
        transcript = " ".join(words).capitalize() + "."
        voices.append((reference_wav(seconds, seed * 1000 + v, rng.uniform(85, 260)), transcript))
    return voices
