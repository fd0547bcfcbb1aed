"""The audio the engine streams is the audio of the rows it generated: for each request, the
concatenated chunks equal the codec's decode of that request's own rows, undelayed (frame f
takes codebook c from row f + c), sanitised (codes outside 0..1023 become 0) and decoded
whole, within the chunk-boundary tolerance of docs/codec.md. The expected audio is built
here from the rows alone, not with the engine's windowing code.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from engine import Engine, EngineConfig, SamplingParams, StreamConfig

NUM_CODEBOOKS = 8
HOP = 960  # samples of one 40 ms frame at 24 kHz


def _engine(cache, stream: StreamConfig) -> Engine:
    cfg = EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=256, stream=stream)
    return Engine.from_pretrained(None, cfg, cache_dir=cache)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def whole_decode(engine: Engine, rows) -> np.ndarray:
    """int16 samples of the rows decoded at once: every complete frame but the last (the
    terminal frame, or at the length cap the frame the stream drops)."""
    num_frames = len(rows) - NUM_CODEBOOKS  # complete frames (len - 7), minus the last
    frames = [[rows[f + c][c] for c in range(NUM_CODEBOOKS)] for f in range(num_frames)]
    codes = torch.tensor(frames, dtype=torch.long).T[None]  # [1, 8, frames]
    codes[(codes < 0) | (codes > 1023)] = 0
    audio = engine.codec.decode(codes)[0].numpy()
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def _requests(engine: Engine):
    """Three requests in one batch, ending at different steps: two plain, one cloned."""
    buf = io.BytesIO()
    t = np.arange(48000) / 24000
    sf.write(buf, (0.2 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, format="WAV")
    voice = engine.encode_reference(buf.getvalue(), "a steady tone")
    params = [SamplingParams(seed=s, max_rows=n) for s, n in ((1, 100), (2, 71), (3, 90))]
    texts = ["Stream this, please.", "And this one.", "A cloned voice speaks."]
    return engine.generate(texts, references=[None, None, voice], params=params)


def _per_frame_diff(streamed: np.ndarray, whole: np.ndarray) -> np.ndarray:
    assert len(streamed) == len(whole) and len(whole) % HOP == 0
    return np.abs(streamed.astype(np.int32) - whole).reshape(-1, HOP).max(axis=1)


def test_streamed_audio_is_the_whole_decode_of_its_rows_away_from_chunk_ends(cache):
    """The required profile (8-frame first chunk, then 25 with 8 frames of left context, no
    holdback): the decoder sees about +-10 frames, so the 10 frames before a chunk end and
    the 2 after it may differ (docs/codec.md); every other frame equals the whole decode."""
    engine = _engine(cache, StreamConfig())
    for result in _requests(engine):
        assert result.finish_reason == "length"
        rows = result.rows
        streamed = np.frombuffer(result.pcm, "<i2")
        whole = whole_decode(engine, rows)
        assert len(streamed) == (len(rows) - NUM_CODEBOOKS) * HOP, "frames lost or added"
        per_frame = _per_frame_diff(streamed, whole)
        num_frames = len(per_frame)
        ends = range(8, num_frames, 25)  # 8, 33, 58, ...: where one chunk ends, the next starts
        frame = np.arange(num_frames)
        exposed = np.zeros(num_frames, dtype=bool)
        for end in ends:
            exposed |= (frame >= end - 10) & (frame < end + 2)
        assert (~exposed).sum() >= 25  # a real share of the audio is held to the exact bound
        assert per_frame[~exposed].max() <= 1, (
            f"{result.request_id}: frames {np.flatnonzero(per_frame > 1).tolist()} differ"
        )
        assert np.sqrt(np.mean(whole.astype(np.float64) ** 2)) > 300  # not near silence


def test_with_the_decoders_full_reach_the_stream_is_the_whole_decode_everywhere(cache):
    """With 11 frames of left context and 11 held back, every chunk sees the decoder's whole
    receptive field: all of the stream equals the whole decode, batched requests included."""
    engine = _engine(cache, StreamConfig(left_context_frames=11, holdback_frames=11))
    for result in _requests(engine):
        streamed = np.frombuffer(result.pcm, "<i2")
        per_frame = _per_frame_diff(streamed, whole_decode(engine, result.rows))
        assert per_frame.max() <= 1, np.flatnonzero(per_frame > 1).tolist()
