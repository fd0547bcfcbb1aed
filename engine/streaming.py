"""Streaming windows (spec section 6): when a request's generated rows make its next audio
chunk ready, and which rows the codec decodes for it.

With `n` rows generated, `max(0, n - 7)` frames are complete. The first chunk is 8 frames
(320 ms); then 25-frame chunks, each decoded with 8 frames of left context whose samples are
dropped, and no right holdback by default; the last chunk carries what remains, the terminal
frame excluded (it may be empty: it still marks the end). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import NUM_CODEBOOKS, StreamConfig
from engine.prompt import AudioRow

ROW_LAG = NUM_CODEBOOKS - 1  # frame f needs row f + 7


@dataclass(frozen=True, eq=False)
class ChunkWindow:
    """Frames `[start, end)` are this chunk's audio; the codec decodes frames
    `[start - context, end + holdback)` and keeps the samples of `[start, end)`."""

    request_id: str
    index: int
    start: int
    end: int
    context: int
    holdback: int
    codes: np.ndarray  # int64 [8, frames of the decode window], sanitised; empty: no frames
    is_last: bool

    @property
    def num_frames(self) -> int:
        return self.end - self.start

    @property
    def window_frames(self) -> int:
        return self.context + self.num_frames + self.holdback


_CODEBOOKS = np.arange(NUM_CODEBOOKS)[:, None]


def window_codes(rows: Sequence[AudioRow] | np.ndarray, first: int, last: int) -> np.ndarray:
    """Undoes the delay over frames `[first, last)`: codebook c of frame f is row f + c.
    `rows`: the generated rows (a list of 8-tuples, or an `[n, 8]` array). Returns int64
    `[8, last - first]`. Codes outside 0..1023 (BOC, EOC) become 0: never clamped, which
    would turn EOC into 1023. (One array conversion and one gather: this runs for every
    chunk of every request.)"""
    n = last - first
    span = np.asarray(rows[first : last + ROW_LAG], dtype=np.int64)
    if n <= 0 or len(span) < n + ROW_LAG:
        raise IndexError(f"frames [{first}, {last}) need rows up to {last + ROW_LAG - 1}")
    codes = span[_CODEBOOKS + np.arange(n), _CODEBOOKS]
    codes[(codes < 0) | (codes >= 1024)] = 0
    return codes


def final_num_frames(num_rows: int) -> int:
    """Frames of a finished utterance: complete frames minus the last (the terminal
    `[EOC, ...]` frame, or at the length cap the frame the spec drops)."""
    return max(0, num_rows - ROW_LAG - 1)


_NO_CODES = np.zeros((NUM_CODEBOOKS, 0), np.int64)  # every empty window's codes, shared
_NO_CODES.flags.writeable = False


class AudioStream:
    """Per-request chunking state: how many frames were emitted, and the next chunk index."""

    def __init__(self, request_id: str, config: StreamConfig):
        self.request_id = request_id
        self.config = config
        self.emitted = 0
        self.index = 0
        self.done = False
        self.rows_due = self._rows_due()

    def _rows_due(self) -> int:
        """Generated rows that make the next chunk (not the last) ready."""
        cfg = self.config
        want = cfg.first_chunk_frames if self.index == 0 else cfg.chunk_frames
        return self.emitted + want + cfg.holdback_frames + ROW_LAG

    def next_window(
        self, rows: Sequence[AudioRow] | np.ndarray, finished: bool
    ) -> ChunkWindow | None:
        """The window to decode now, if a chunk is ready (always one once finished)."""
        if self.done:
            return None
        cfg = self.config
        if finished:
            end, holdback = max(self.emitted, final_num_frames(len(rows))), 0
        else:
            if len(rows) < self.rows_due:
                return None
            end = self.rows_due - cfg.holdback_frames - ROW_LAG
            holdback = cfg.holdback_frames
        start = self.emitted
        context = min(cfg.left_context_frames, start)
        if end > start:
            codes = window_codes(rows, start - context, end + holdback)
        else:
            codes = _NO_CODES
        window = ChunkWindow(
            self.request_id, self.index, start, end, context, holdback, codes, finished
        )
        self.emitted, self.index, self.done = end, self.index + 1, finished
        self.rows_due = self._rows_due()
        return window
