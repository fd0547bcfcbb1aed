"""Prompt building and the delay layout of reference codes (spec section 2)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.config import BOC, EOC, NUM_CODEBOOKS, ConfigError, VoiceReference
from engine.prompt import Prompt, SpecialTokens, build_prompt, delay_rows, undelay_rows

SPECIAL = SpecialTokens(tts=1, text=2, audio=3, ref_audio=4, ref_text=5)
TTS, TEXT, AUDIO, REF_AUDIO, REF_TEXT = 1, 2, 3, 4, 5


class CharTokenizer:
    """Encodes each character to ord(c) + 1000."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 1000 for c in text]


TOK = CharTokenizer()


def enc(text: str) -> list[int]:
    return [ord(c) + 1000 for c in text]


def random_codes(frames: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(1024) for _ in range(8)) for _ in range(frames))


# -- delay layout --------------------------------------------------------------------------


def test_delay_rows_small_example_literal():
    codes = [tuple(10 * t + c for c in range(8)) for t in range(2)]  # frame t, codebook c
    B, E = BOC, EOC
    expected = [
        (0, B, B, B, B, B, B, B),
        (10, 1, B, B, B, B, B, B),
        (E, 11, 2, B, B, B, B, B),
        (E, E, 12, 3, B, B, B, B),
        (E, E, E, 13, 4, B, B, B),
        (E, E, E, E, 14, 5, B, B),
        (E, E, E, E, E, 15, 6, B),
        (E, E, E, E, E, E, 16, 7),
        (E, E, E, E, E, E, E, 17),
    ]
    assert delay_rows(codes) == expected


@pytest.mark.parametrize("frames", [1, 2, 7, 8, 9, 30])
def test_delay_rows_layout(frames):
    codes = random_codes(frames, seed=frames)
    rows = delay_rows(codes)
    assert len(rows) == frames + 7
    for r, row in enumerate(rows):
        assert isinstance(row, tuple) and len(row) == NUM_CODEBOOKS
        for c in range(NUM_CODEBOOKS):
            if r < c:
                assert row[c] == BOC, (r, c)
            elif r < c + frames:
                assert row[c] == codes[r - c][c], (r, c)
            else:
                assert row[c] == EOC, (r, c)
    # First row: only codebook 0 has started; last row: only codebook 7 is still running.
    assert rows[0][1:] == (BOC,) * 7
    assert rows[-1][:7] == (EOC,) * 7 and rows[-1][7] == codes[-1][7]


@pytest.mark.parametrize("frames", [1, 2, 7, 8, 30])
def test_undelay_inverts_delay(frames):
    codes = random_codes(frames, seed=100 + frames)
    assert undelay_rows(delay_rows(codes)) == list(codes)
    assert undelay_rows(delay_rows(list(codes))) == list(codes)


def test_undelay_frame_takes_codebook_c_from_row_f_plus_c():
    rows = [tuple(100 * r + c for c in range(8)) for r in range(12)]
    frames = undelay_rows(rows)
    assert len(frames) == 12 - 7
    for f, frame in enumerate(frames):
        assert frame == tuple(100 * (f + c) + c for c in range(8))


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 0), (7, 0), (8, 1), (9, 2), (40, 33)])
def test_undelay_complete_frame_count(n, expected):
    rows = [tuple(range(8))] * n
    assert len(undelay_rows(rows)) == expected


# -- build_prompt --------------------------------------------------------------------------


def test_plain_prompt():
    p = build_prompt(TOK, SPECIAL, "Hi there")
    assert isinstance(p, Prompt)
    assert list(p.token_ids) == [TTS, TEXT, *enc("Hi there"), AUDIO]
    assert p.audio_rows == (None,) * len(p)
    assert p.prefix_len == 2
    assert p.token_ids[p.prefix_len - 1] == TEXT
    assert p.token_ids[-1] == AUDIO
    assert p.position_keys() == list(p.token_ids)


def test_inline_tags_pass_through():
    text = "<|emotion:amusement|>ha"
    p = build_prompt(TOK, SPECIAL, text)
    assert list(p.token_ids) == [TTS, TEXT, *enc(text), AUDIO]


def test_clone_prompt_with_ref_text():
    codes = random_codes(5, seed=1)
    ref = VoiceReference(codes, "ref words")
    p = build_prompt(TOK, SPECIAL, "say this", ref)
    ph = 5 + 7
    expected_ids = [
        TTS,
        REF_TEXT,
        *enc("ref words"),
        REF_AUDIO,
        *[TTS] * ph,
        TEXT,
        *enc("say this"),
        AUDIO,
    ]
    assert list(p.token_ids) == expected_ids
    start = 1 + 1 + len("ref words") + 1
    delayed = delay_rows(codes)
    assert len(delayed) == ph
    assert list(p.audio_rows[start : start + ph]) == delayed
    assert all(r is None for r in p.audio_rows[:start])
    assert all(r is None for r in p.audio_rows[start + ph :])
    assert sum(r is not None for r in p.audio_rows) == ph
    assert p.prefix_len == start + ph + 1
    assert p.token_ids[p.prefix_len - 1] == TEXT
    assert p.token_ids[p.prefix_len :] == (*enc("say this"), AUDIO)


@pytest.mark.parametrize("ref_text", [None, ""])
def test_clone_prompt_without_ref_text(ref_text):
    codes = random_codes(3, seed=2)
    p = build_prompt(TOK, SPECIAL, "go", VoiceReference(codes, ref_text))
    ph = 3 + 7
    assert list(p.token_ids) == [TTS, REF_AUDIO, *[TTS] * ph, TEXT, *enc("go"), AUDIO]
    assert REF_TEXT not in p.token_ids
    assert list(p.audio_rows[2 : 2 + ph]) == delay_rows(codes)
    assert p.prefix_len == 2 + ph + 1
    keys = p.position_keys()
    assert keys[2] == (TTS, delay_rows(codes)[0])
    assert keys[0] == TTS and keys[1] == REF_AUDIO


def test_prefix_shared_by_same_voice_and_ref_text():
    codes = random_codes(6, seed=3)
    a = build_prompt(TOK, SPECIAL, "first sentence", VoiceReference(codes, "hello"))
    b = build_prompt(TOK, SPECIAL, "something else", VoiceReference(codes, "hello"))
    assert a.prefix_len == b.prefix_len
    n = a.prefix_len
    assert a.position_keys()[:n] == b.position_keys()[:n]
    assert a.position_keys()[n:] != b.position_keys()[n:]


def test_prefix_changes_with_reference_row_or_ref_text():
    codes = random_codes(6, seed=4)
    a = build_prompt(TOK, SPECIAL, "text", VoiceReference(codes, "hello"))
    changed = [list(f) for f in codes]
    changed[4][6] = (changed[4][6] + 1) % 1024
    b = build_prompt(TOK, SPECIAL, "text", VoiceReference(tuple(map(tuple, changed)), "hello"))
    assert a.token_ids == b.token_ids  # same ids: the difference is only in the rows
    n = a.prefix_len
    ka, kb = a.position_keys()[:n], b.position_keys()[:n]
    diff = [i for i in range(n) if ka[i] != kb[i]]
    # frame 4, codebook 6 sits in delayed row 4 + 6 = 10
    start = 1 + 1 + len("hello") + 1
    assert diff == [start + 10]
    c = build_prompt(TOK, SPECIAL, "text", VoiceReference(codes, "hellO"))
    assert a.position_keys()[: a.prefix_len] != c.position_keys()[: c.prefix_len]


@pytest.mark.parametrize("text", ["", " ", "  \n\t "])
def test_empty_text_rejected(text):
    with pytest.raises(ConfigError, match="empty"):
        build_prompt(TOK, SPECIAL, text)
    with pytest.raises(ConfigError):
        build_prompt(TOK, SPECIAL, text, VoiceReference(random_codes(2, 0), "ref"))


@pytest.mark.parametrize("ref_text", [None, "ref words"])
def test_rows_array_is_audio_rows_with_minus_one_at_text_positions(ref_text):
    """The array the runner copies to the GPU equals `audio_rows` (-1 where None), for a clone
    prompt (built from the voice's cached delayed rows, the second time from the cache), a
    plain prompt, and a Prompt made by hand (built from its rows)."""
    codes = random_codes(9, seed=4)
    for text in ("first", "a second text, same voice"):
        p = build_prompt(TOK, SPECIAL, text, VoiceReference(codes, ref_text))
        want = [list(r) if r is not None else [-1] * NUM_CODEBOOKS for r in p.audio_rows]
        assert p.rows_array.dtype == np.int64 and p.rows_array.tolist() == want
    plain = build_prompt(TOK, SPECIAL, "plain")
    assert plain.rows_array.tolist() == [[-1] * NUM_CODEBOOKS] * len(plain)
    by_hand = Prompt(p.token_ids, p.audio_rows, p.prefix_len)
    assert by_hand.rows_array is None and by_hand.audio_array().tolist() == want
