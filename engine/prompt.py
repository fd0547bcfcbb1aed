"""Prompt building (spec section 2) and the delay layout of reference codes.

Owns the mapping from (text, optional reference voice) to input positions: a token id per
position plus, at placeholder positions, the delayed audio row whose summed embedding replaces
the token's. Knows nothing of tensors, the KV cache or the scheduler; imports no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.config import ADDED_TOKENS, BOC, EOC, NUM_CODEBOOKS, ConfigError, VoiceReference

AudioRow = tuple[int, ...]  # 8 codes, one per codebook


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the added tokens, resolved from the tokenizer at load time."""

    tts: int
    text: int
    audio: int
    ref_audio: int
    ref_text: int


@dataclass(frozen=True)
class Prompt:
    """Input positions of a request's prompt.

    `token_ids[i]` is the text token at position i; where `audio_rows[i]` is not None the
    position is a placeholder whose input is the summed embedding of that delayed row.
    `prefix_len` counts the positions up to and including `<|text|>`: identical for every
    request with the same voice and reference text.
    """

    token_ids: tuple[int, ...]
    audio_rows: tuple[AudioRow | None, ...]
    prefix_len: int
    # `audio_rows` as int64 `[len, 8]`, -1 where None (what the runner copies to the GPU);
    # build_prompt makes it from the voice's remembered delayed rows
    rows_array: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    def audio_array(self) -> np.ndarray:
        """`rows_array`, or the same built from `audio_rows` (a Prompt made by hand)."""
        if self.rows_array is not None:
            return self.rows_array
        rows = np.full((len(self.audio_rows), NUM_CODEBOOKS), -1, dtype=np.int64)
        at = [i for i, row in enumerate(self.audio_rows) if row is not None]
        if at:
            rows[at] = [self.audio_rows[i] for i in at]
        return rows

    def position_keys(self) -> list[int | tuple[int, AudioRow]]:
        """Content of each position for prefix hashing: the id, or (id, row) at placeholders."""
        return [
            t if row is None else (t, row)
            for t, row in zip(self.token_ids, self.audio_rows, strict=True)
        ]


def delay_rows(codes: tuple[AudioRow, ...] | list[AudioRow]) -> list[AudioRow]:
    """Lays out `[T, 8]` frames as `[T + 7, 8]` delayed rows: column c is BOC in rows
    0..c-1, the codes in rows c..c+T-1, EOC after."""
    return list(_delayed(codes)[0])


def _delayed(codes) -> tuple[tuple[AudioRow, ...], np.ndarray]:
    """The delayed rows and the same as a read-only int64 `[T + 7, 8]` array; a voice's
    reference (a tuple of tuples) is computed once and remembered."""
    if isinstance(codes, tuple):
        try:
            return _delayed_cached(codes)  # a voice's reference, once per request
        except TypeError:  # rows that are lists cannot key the cache
            pass
    return _delayed_uncached(codes)


@functools.lru_cache(maxsize=256)
def _delayed_cached(codes: tuple[AudioRow, ...]) -> tuple[tuple[AudioRow, ...], np.ndarray]:
    return _delayed_uncached(codes)


def _delayed_uncached(codes) -> tuple[tuple[AudioRow, ...], np.ndarray]:
    rows = tuple(_delay_rows(codes))
    array = np.array(rows, dtype=np.int64).reshape(-1, NUM_CODEBOOKS)
    array.flags.writeable = False
    return rows, array


def _delay_rows(codes) -> list[AudioRow]:
    num_frames = len(codes)
    rows = [[EOC] * NUM_CODEBOOKS for _ in range(num_frames + NUM_CODEBOOKS - 1)]
    for c in range(NUM_CODEBOOKS):
        for r in range(c):
            rows[r][c] = BOC
        for t in range(num_frames):
            rows[t + c][c] = codes[t][c]
    return [tuple(r) for r in rows]


def undelay_rows(rows: list[AudioRow]) -> list[AudioRow]:
    """Inverse of the delay: frame f takes codebook c from row f + c. `n` rows give
    `max(0, n - 7)` complete frames."""
    num_frames = max(0, len(rows) - (NUM_CODEBOOKS - 1))
    return [tuple(rows[f + c][c] for c in range(NUM_CODEBOOKS)) for f in range(num_frames)]


def build_prompt(
    tokenizer: TextTokenizer,
    special: SpecialTokens,
    text: str,
    reference: VoiceReference | None = None,
) -> Prompt:
    """plain: `<|tts|><|text|>{text}<|audio|>`; clone:
    `<|tts|>[<|ref_text|>{ref_text}]<|ref_audio|>[PH x (T_ref + 7)]<|text|>{text}<|audio|>`."""
    if not text or not text.strip():
        raise ConfigError("text to speak is empty")
    for part in (text, reference.text if reference else None):
        found = [t for t in ADDED_TOKENS if part and t in part]
        if found:
            raise ConfigError(f"text may not contain the prompt's structural tokens {found}")
    ids: list[int] = [special.tts]
    rows: list[AudioRow | None] = [None]
    if reference is not None:
        if reference.text:
            ref_ids = [special.ref_text, *tokenizer.encode(reference.text)]
            ids += ref_ids
            rows += [None] * len(ref_ids)
        ids.append(special.ref_audio)
        rows.append(None)
        delayed, delayed_array = _delayed(reference.codes)
        delayed_at = len(ids)
        ids += [special.tts] * len(delayed)
        rows += delayed
    ids.append(special.text)
    rows.append(None)
    prefix_len = len(ids)
    text_ids = tokenizer.encode(text)
    ids += [*text_ids, special.audio]
    rows += [None] * (len(text_ids) + 1)
    array = np.full((len(ids), NUM_CODEBOOKS), -1, dtype=np.int64)
    if reference is not None:
        array[delayed_at : delayed_at + len(delayed)] = delayed_array
    return Prompt(tuple(ids), tuple(rows), prefix_len, array)


class TextChecker:
    """`Engine.check_text` without the engine (a process that holds no model uses it): raises
    ConfigError if `text` cannot be spoken (empty, structural tokens, a prompt too long for
    `max_model_len`). `tokenizer` has `.encode` and `.special`."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    @classmethod
    def from_checkpoint(cls, checkpoint, max_model_len: int) -> TextChecker:
        """With the checkpoint's own tokenizer (a resolved checkpoint directory)."""
        from engine.tokenizer import HiggsTokenizer

        return cls(HiggsTokenizer(checkpoint), max_model_len)

    def __call__(self, text: str, reference: VoiceReference | None = None) -> None:
        prompt = build_prompt(self.tokenizer, self.tokenizer.special, text, reference)
        if len(prompt) + 1 > self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt)} positions; max_model_len is "
                f"{self.max_model_len}: shorten the text or the reference"
            )
