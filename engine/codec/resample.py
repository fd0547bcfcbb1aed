"""Streaming resampling of 24 kHz engine audio to another rate, chunk by chunk, exact against
resampling the whole signal at once (up to float rounding): every resampled span keeps
context on both sides, and a few milliseconds of input are held back for look-ahead until
`finish()`. Knows nothing of formats or sockets."""

from __future__ import annotations

import math

import numpy as np
import torch
import torchaudio

ENGINE_RATE = 24000
_MARGIN = 64  # input samples of context on each side of a resampled span


class StreamingResampler:
    """24 kHz float chunks in, `rate` out; exact against one-shot resampling up to rounding."""

    def __init__(self, rate: int):
        g = math.gcd(ENGINE_RATE, rate)
        self.rate, self.in_period, self.out_period = rate, ENGINE_RATE // g, rate // g
        self.margin = -(-_MARGIN // self.in_period) * self.in_period
        self._buf = np.zeros(0, np.float32)  # input from `_base` on
        self._base = 0  # absolute index of _buf[0]
        self._done = 0  # input samples whose output was emitted (a multiple of in_period)

    def push(self, x: np.ndarray) -> np.ndarray:
        self._buf = np.concatenate([self._buf, x])
        total = self._base + len(self._buf)
        end = (total - self.margin) // self.in_period * self.in_period
        return self._emit(end, final=False) if end > self._done else np.zeros(0, np.float32)

    def finish(self) -> np.ndarray:
        return self._emit(self._base + len(self._buf), final=True)

    def _emit(self, end: int, final: bool) -> np.ndarray:
        start = self._done
        lead = min(self.margin, start)
        lo = start - lead - self._base
        hi = len(self._buf) if final else end + self.margin - self._base
        segment = torch.from_numpy(np.ascontiguousarray(self._buf[lo:hi]))
        out = torchaudio.functional.resample(segment, ENGINE_RATE, self.rate).numpy()
        first = lead * self.out_period // self.in_period
        if final:
            count = (
                math.ceil(end * self.rate / ENGINE_RATE) - start * self.out_period // self.in_period
            )
        else:
            count = (end - start) * self.out_period // self.in_period
        self._done = end
        keep_from = max(0, end - self.margin - self._base)
        self._buf, self._base = self._buf[keep_from:], self._base + keep_from
        return out[first : first + count].astype(np.float32, copy=False)
