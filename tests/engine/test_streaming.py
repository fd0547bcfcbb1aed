"""Streaming windows (spec section 6) against `engine.streaming` and the tiny random codec.

Synthetic utterances are laid out row by row exactly as the engine's state machine would emit
them (checked against `engine.delay_state`), fed to `AudioStream` one row at a time the way
`Engine._decode_audio` does (`finished=True` only on the row that ends the request), and the
windows are decoded with `codec.chunks`. Byte counts are PCM16 mono at 24 kHz: 1,920 bytes a
frame.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint_writer import write_codec_dir
from engine.codec.audio_io import to_pcm16
from engine.codec.codec import Codec
from engine.codec.config import TINY_CODEC_CONFIG
from engine.config import BOC, EOC, NUM_CODEBOOKS, ConfigError, StreamConfig
from engine.delay_state import DelayState
from engine.prompt import delay_rows, undelay_rows
from engine.streaming import AudioStream, ChunkWindow, final_num_frames, window_codes

HOP = 960
FRAME_BYTES = 2 * HOP  # PCM16
CAP_ROWS = 2048
CPU = torch.device("cpu")
DEFAULT = StreamConfig()  # the required profile: 8, then 25 with 8 of context, no holdback


def write_test_codec(directory: Path, seed: int = 1) -> Path:
    """The tiny random codec, decoder weights at std 0.6 / sqrt(fan_in) (see
    engine.checkpoint_writer.random_codec_weights): its audio depends strongly on the codes."""
    return write_codec_dir(directory, TINY_CODEC_CONFIG, seed=seed, decoder_std=0.6)


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = write_test_codec(tmp_path_factory.mktemp("tiny-codec"))
    return Codec.load(path, CPU, 1 << 20)


# -- synthetic rows ----------------------------------------------------------------------------


def random_frame(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(1024) for _ in range(NUM_CODEBOOKS))


def utterance_rows(num_frames: int, seed: int = 0) -> tuple[list[tuple[int, ...]], list]:
    """(audio frames, delayed rows) of an utterance of exactly `num_frames` frames ended by
    codebook 0's EOC at row `num_frames`: `num_frames + 8` rows, the last frame `[EOC, 7 real]`.

    `delay_rows` leaves BOC at (row r, column c > r); after the EOC row the state machine
    forbids BOC (ending: "the others may emit neither BOC nor EOC"), so for utterances of at
    most 5 frames those cells hold real codes. They belong to no frame (r - c < 0)."""
    rng = random.Random(seed)
    frames = [random_frame(rng) for _ in range(num_frames)]
    terminal = (EOC, *random_frame(rng)[1:])
    rows = [list(r) for r in delay_rows([*frames, terminal])]
    for r in range(num_frames + 1, len(rows)):
        for c in range(r + 1, NUM_CODEBOOKS):
            rows[r][c] = rng.randrange(1024)
    return frames, [tuple(r) for r in rows]


def cap_rows(seed: int = 0, num_rows: int = CAP_ROWS) -> list:
    """A request that never emits EOC and stops at the length cap: BOC ramp, then real codes."""
    rng = random.Random(seed)
    return [
        tuple(BOC if c > r else rng.randrange(1024) for c in range(NUM_CODEBOOKS))
        for r in range(num_rows)
    ]


def state_machine_check(rows: list) -> list[bool]:
    """Every code of every row must be allowed by the state at that row; returns `done` after
    each row."""
    state = DelayState(1, CPU)
    slot = torch.tensor([0])
    done = []
    for i, row in enumerate(rows):
        forbidden = state.masks(slot)[0]
        for c, code in enumerate(row):
            assert not forbidden[c, code], f"row {i} codebook {c}: code {code} is forbidden"
        state.advance(slot, torch.tensor([row]))
        done.append(bool(state.done[0]))
    return done


def sanitise(code: int) -> int:
    return code if 0 <= code <= 1023 else 0


def expected_codes(rows: list, first: int, last: int) -> tuple[tuple[int, ...], ...]:
    """Independent undelay (engine.prompt.undelay_rows) + sanitising of frames [first, last)."""
    frames = undelay_rows(rows)[first:last]
    return tuple(tuple(sanitise(f[c]) for f in frames) for c in range(NUM_CODEBOOKS))


def as_tuples(codes) -> tuple[tuple[int, ...], ...]:
    """A window's `[8, frames]` code array as 8 tuples (empty: no frames)."""
    assert codes.dtype == np.int64 and codes.shape[0] == NUM_CODEBOOKS
    return tuple(map(tuple, codes.tolist())) if codes.shape[1] else ()


def drive(rows: list, config: StreamConfig = DEFAULT) -> list[tuple[int, ChunkWindow]]:
    """Feeds rows one at a time as the engine does; returns (rows available, window) for each
    window produced. Each call sees only the rows generated so far."""
    stream = AudioStream("req", config)
    out = []
    for n in range(1, len(rows) + 1):
        window = stream.next_window(rows[:n], finished=n == len(rows))
        if window is not None:
            out.append((n, window))
    assert stream.done
    assert stream.next_window(rows, finished=True) is None  # nothing after the last chunk
    return out


# -- the helper itself -------------------------------------------------------------------------


@pytest.mark.parametrize("num_frames", [0, 1, 6, 7, 8, 9, 33, 200])
def test_utterance_rows_follow_the_state_machine(num_frames):
    frames, rows = utterance_rows(num_frames, seed=num_frames)
    assert len(rows) == num_frames + 8
    done = state_machine_check(rows)
    assert done == [False] * (len(rows) - 1) + [True]  # done exactly at the last row
    undelayed = undelay_rows(rows)
    assert len(undelayed) == num_frames + 1
    assert undelayed[:num_frames] == frames
    assert undelayed[num_frames][0] == EOC
    assert all(0 <= x < 1024 for x in undelayed[num_frames][1:])
    assert final_num_frames(len(rows)) == num_frames


def test_plain_delay_layout_of_a_very_short_utterance_breaks_the_state_machine():
    """Why `utterance_rows` patches the cells after EOC: a 3-frame `delay_rows` layout keeps BOC
    in codebooks that the ending state machine obliges to emit real codes."""
    _, rows = utterance_rows(3, seed=1)
    raw = delay_rows(undelay_rows(rows))
    assert raw != rows and raw[4][5] == BOC
    with pytest.raises(AssertionError, match="row 4 codebook 5: code 1024"):
        state_machine_check(raw)


def test_cap_rows_follow_the_state_machine():
    rows = cap_rows()
    assert not any(state_machine_check(rows))  # never done: the engine stops it at the cap
    assert len(undelay_rows(rows)) == 2041
    assert final_num_frames(len(rows)) == 2040


# -- chunk sizes -------------------------------------------------------------------------------

FIRST, STEADY = 8 * FRAME_BYTES, 25 * FRAME_BYTES  # 15,360 and 48,000 bytes

CHUNK_BYTES = {
    0: [0],  # never reaches 8 frames: one empty last chunk
    1: [1 * FRAME_BYTES],
    7: [7 * FRAME_BYTES],
    8: [FIRST, 0],  # the first chunk is ready at row 15, before the last row (16)
    9: [FIRST, 1 * FRAME_BYTES],
    32: [FIRST, 24 * FRAME_BYTES],
    33: [FIRST, STEADY, 0],
    34: [FIRST, STEADY, 1 * FRAME_BYTES],
    200: [FIRST] + [STEADY] * 7 + [17 * FRAME_BYTES],  # 8 + 7 * 25 + 17
}


def check_chunks(windows: list[ChunkWindow], decoded, expected: list[int], num_frames: int):
    assert [len(d.pcm) for d in decoded] == expected
    assert sum(expected) == num_frames * FRAME_BYTES
    assert all(d.error is None for d in decoded)
    assert [d.window for d in decoded] == windows
    assert [w.is_last for w in windows] == [False] * (len(windows) - 1) + [True]
    assert [w.index for w in windows] == list(range(len(windows)))
    assert windows[0].start == 0 and windows[-1].end == num_frames
    assert all(a.end == b.start for a, b in zip(windows, windows[1:], strict=False))


@pytest.mark.parametrize("num_frames", sorted(CHUNK_BYTES))
def test_chunk_sizes(codec, num_frames):
    _, rows = utterance_rows(num_frames, seed=100 + num_frames)
    windows = [w for _, w in drive(rows)]
    check_chunks(windows, codec.chunks.decode(windows), CHUNK_BYTES[num_frames], num_frames)


def test_chunk_sizes_at_length_cap(codec):
    rows = cap_rows(seed=5)
    windows = [w for _, w in drive(rows)]
    expected = [FIRST] + [STEADY] * 81 + [7 * FRAME_BYTES]  # 8 + 81 * 25 + 7 = 2040
    decoded = codec.chunks.decode(windows)  # the only full decode of a capped utterance
    check_chunks(windows, decoded, expected, 2040)
    assert sum(len(d.pcm) for d in decoded) / 2 / 24000 == pytest.approx(81.6)


# -- readiness and window contents -------------------------------------------------------------


@pytest.mark.parametrize("num_frames", [8, 33, 200])
def test_readiness_and_window_codes(num_frames):
    _, rows = utterance_rows(num_frames, seed=7)
    emitted = drive(rows)
    for n, w in emitted[:-1]:
        # first chunk: prefill row + 14 decode rows; steady: frame end - 1 needs row end + 6
        assert n == (15 if w.index == 0 else w.end + 7)
    assert emitted[0][0] == 15 and emitted[0][1].end == 8
    assert emitted[-1][0] == len(rows)
    for n, w in emitted:
        assert w.context == min(8, w.start)
        assert w.holdback == 0
        assert w.window_frames == w.context + w.num_frames
        # computed from the rows available at that moment only
        assert as_tuples(w.codes) == (
            expected_codes(rows[:n], w.start - w.context, w.end) if w.num_frames else ()
        )


def test_cap_readiness():
    rows = cap_rows(seed=3)
    emitted = drive(rows)
    assert [n for n, _ in emitted[:-1]] == [15] + [8 + 25 * k + 7 for k in range(1, 82)]
    n, last = emitted[-1]
    assert (n, last.start, last.end, last.context) == (CAP_ROWS, 2033, 2040, 8)
    assert as_tuples(last.codes) == expected_codes(rows, 2025, 2040)


def test_out_of_range_codes_become_zero_never_clamped(codec):
    _, rows = utterance_rows(40, seed=11)
    rows = [list(r) for r in rows]
    # frame 20 codebook 3 -> EOC, frame 21 codebook 5 -> BOC, frame 22 codebook 1 -> -3,
    # frame 23 codebook 2 -> 1023 (the largest real code: kept)
    for frame, c, code in [(20, 3, EOC), (21, 5, BOC), (22, 1, -3), (23, 2, 1023)]:
        rows[frame + c][c] = code
    rows = [tuple(r) for r in rows]
    emitted = drive(rows)
    (_, w) = next((n, w) for n, w in emitted if w.start <= 20 and 23 < w.end)
    first = w.start - w.context
    assert w.codes[3][20 - first] == 0
    assert w.codes[5][21 - first] == 0
    assert w.codes[1][22 - first] == 0
    assert w.codes[2][23 - first] == 1023
    assert window_codes(rows, 20, 21)[3].tolist() == [0]

    pcm = codec.chunks.decode([w])[0].pcm
    codes = torch.tensor([w.codes])
    keep = slice(w.context * HOP, (w.context + w.num_frames) * HOP)
    zeroed = to_pcm16(codec.decode(codes)[0, keep])
    clamped = codes.clone()
    clamped[0, 3, 20 - first] = 1023
    assert pcm_diff(pcm, zeroed) <= 1
    assert pcm_diff(pcm, to_pcm16(codec.decode(clamped)[0, keep])) > 1


def pcm_diff(a: bytes, b: bytes) -> int:
    assert len(a) == len(b)
    x, y = (np.frombuffer(p, dtype="<i2").astype(np.int32) for p in (a, b))
    return int(np.abs(x - y).max()) if len(x) else 0


# -- other stream configurations ---------------------------------------------------------------

CUSTOM = StreamConfig(
    first_chunk_frames=4, chunk_frames=10, left_context_frames=3, holdback_frames=2
)

# frames per chunk: first 4, then 10, each ready once 2 more frames exist (holdback)
CUSTOM_FRAMES = {
    0: [0],
    5: [5],  # the first chunk needs 6 complete frames (13 rows); the 13th row is the last
    6: [4, 2],
    15: [4, 11],  # [4, 14) would need frame 15 complete: the tail takes 11 > chunk_frames
    16: [4, 10, 2],
    40: [4, 10, 10, 10, 6],
}


@pytest.mark.parametrize("num_frames", sorted(CUSTOM_FRAMES))
def test_custom_stream_config(codec, num_frames):
    _, rows = utterance_rows(num_frames, seed=21 + num_frames)
    emitted = drive(rows, CUSTOM)
    windows = [w for _, w in emitted]
    assert [w.num_frames for w in windows] == CUSTOM_FRAMES[num_frames]
    for n, w in emitted:
        assert w.context == min(3, w.start)
        if w.is_last:
            assert n == len(rows) and w.holdback == 0
        else:
            assert w.holdback == 2
            assert n == w.end + 2 + 7  # ready once frame end + 1 is complete
        assert w.window_frames == w.context + w.num_frames + w.holdback
        if w.num_frames:
            assert as_tuples(w.codes) == expected_codes(
                rows[:n], w.start - w.context, w.end + w.holdback
            )
    decoded = codec.chunks.decode(windows)
    assert [len(d.pcm) for d in decoded] == [f * FRAME_BYTES for f in CUSTOM_FRAMES[num_frames]]
    # holdback frames are decoded (they shape the kept samples) but not emitted
    for d in decoded:
        w = d.window
        if w.num_frames:
            audio = codec.decode(torch.from_numpy(w.codes[None]))[0]
            assert audio.shape[0] == w.window_frames * HOP
            kept = to_pcm16(audio[w.context * HOP : (w.context + w.num_frames) * HOP])
            assert pcm_diff(d.pcm, kept) <= 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"first_chunk_frames": 0},
        {"chunk_frames": 0},
        {"first_chunk_frames": -1},
        {"left_context_frames": -1},
        {"holdback_frames": -1},
    ],
)
def test_stream_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        StreamConfig(**kwargs)


def test_stream_config_accepts_edge_values():
    cfg = StreamConfig(
        first_chunk_frames=1, chunk_frames=1, left_context_frames=0, holdback_frames=0
    )
    _, rows = utterance_rows(5, seed=2)
    windows = [w for _, w in drive(rows, cfg)]
    assert [w.num_frames for w in windows] == [1] * 5 + [0]
    assert all(w.context == 0 for w in windows)


# -- streamed audio vs whole-utterance decode --------------------------------------------------


def streamed_audio(
    codec, rows, config: StreamConfig
) -> tuple[list[ChunkWindow], torch.Tensor, bytes]:
    """(windows, float audio of the stream, PCM of the stream): the float audio decodes each
    window alone exactly as ChunkDecoder does, before PCM16 quantisation."""
    windows = [w for _, w in drive(rows, config)]
    decoded = codec.chunks.decode(windows)
    assert all(d.error is None for d in decoded)
    parts = []
    for w in windows:
        if w.num_frames:
            audio = codec.decode(torch.from_numpy(w.codes[None]))[0]
            parts.append(audio[w.context * HOP : (w.context + w.num_frames) * HOP])
    return windows, torch.cat(parts), b"".join(d.pcm for d in decoded)


def boundary_report(stream: torch.Tensor, whole: torch.Tensor, boundaries: list[int]):
    """Per-frame max |stream - whole| relative to the whole decode's RMS, and a printout:
    within +-960 samples of a boundary vs elsewhere, and by frame offset from a boundary."""
    rms = whole.pow(2).mean().sqrt().item()
    diff = (stream - whole).abs() / rms
    near = torch.zeros(len(whole), dtype=torch.bool)
    for b in boundaries:
        near[max(0, (b - 1) * HOP) : (b + 1) * HOP] = True
    print(f"\nsignal rms {rms:.3e}; |stream - whole| / rms:")
    for name, sel in (("within +-960 samples of a boundary", near), ("elsewhere", ~near)):
        print(f"  {name:36s} max {diff[sel].max():.2e}  rms {diff[sel].pow(2).mean().sqrt():.2e}")
    per_frame = diff.view(-1, HOP).max(dim=1).values
    for k in range(-11, 3):
        vals = [per_frame[b + k].item() for b in boundaries if 0 <= b + k < len(per_frame)]
        print(f"  frame boundary{k:+3d}: max over boundaries {max(vals):.2e}")
    return per_frame


def test_streamed_audio_matches_whole_decode(codec):
    frames, rows = utterance_rows(200, seed=42)
    windows, stream, pcm = streamed_audio(codec, rows, StreamConfig())
    whole = codec.decode(torch.tensor(frames).T[None])[0]  # all 200 frames at once
    assert stream.shape == whole.shape == (200 * HOP,)
    assert len(pcm) == 200 * FRAME_BYTES
    assert pcm_diff(pcm, to_pcm16(stream)) <= 1  # ChunkDecoder's PCM is this float audio

    boundaries = [w.end for w in windows[:-1]]
    assert boundaries == [8 + 25 * k for k in range(8)]  # 8, 33, ..., 183
    per_frame = boundary_report(stream, whole, boundaries)
    frame = torch.arange(200)
    offset = torch.stack([frame - b for b in boundaries])  # [boundaries, frames]
    # Far from every boundary (more than 12 frames; the decoder sees about +-10): only frames
    # 196..199 qualify, since boundaries are 25 frames apart.
    assert per_frame[offset.abs().min(0).values > 12].max() < 1e-4
    # As measured: the error sits in the 10 frames before a boundary (no right context, no
    # holdback) and the 2 after it (8 frames of left context are slightly short of the
    # receptive field); everything else matches to fp32 noise.
    exposed = ((offset >= -10) & (offset < 2)).any(0)
    assert exposed.sum() < 100
    assert per_frame[~exposed].max() < 1e-4
    assert all(per_frame[b - 1] > 1e-2 for b in boundaries)  # the cost of no right holdback


def test_enough_context_and_holdback_remove_boundary_differences(codec):
    """With 11 frames of left context and right holdback each chunk sees its decoder's full
    receptive field: the stream equals the whole decode everywhere."""
    frames, rows = utterance_rows(120, seed=43)
    cfg = StreamConfig(left_context_frames=11, holdback_frames=11)
    windows, stream, _ = streamed_audio(codec, rows, cfg)
    assert len(windows) > 4
    whole = codec.decode(torch.tensor(frames).T[None])[0]
    rms = whole.pow(2).mean().sqrt()
    assert stream.shape == whole.shape
    assert ((stream - whole).abs().max() / rms) < 1e-4
