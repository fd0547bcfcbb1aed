"""Batched decoding of streaming windows (`engine.codec.chunk_decoder`) and our codec decoder
against transformers' `HiggsAudioV2TokenizerModel` on the same weights."""

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
from engine.codec.loader import build_reference_model, load_codec_state
from engine.streaming import ChunkWindow

HOP = 960
CPU = torch.device("cpu")
MARKER = 777  # a window whose codes are all MARKER is the culprit of the fault injections


def write_test_codec(directory: Path, seed: int = 1) -> Path:
    """The tiny random codec, decoder weights at std 0.6 / sqrt(fan_in) (see
    engine.checkpoint_writer.random_codec_weights): its audio depends strongly on the codes."""
    return write_codec_dir(directory, TINY_CODEC_CONFIG, seed=seed, decoder_std=0.6)


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    return write_test_codec(tmp_path_factory.mktemp("tiny-codec"))


@pytest.fixture(scope="module")
def codec(codec_dir):
    return Codec.load(codec_dir, CPU, 1 << 20)


def window(
    rid: str, context: int, num_frames: int, seed: int, holdback: int = 0, fill: int | None = None
) -> ChunkWindow:
    """A window of `context + num_frames + holdback` frames of seeded random codes (or all
    `fill`), for frames [start, start + num_frames) with start = context (8 for steady)."""
    rng = random.Random(seed)
    width = context + num_frames + holdback
    codes = np.array(
        [[fill if fill is not None else rng.randrange(700) for _ in range(width)] for _ in range(8)]
    )
    start = 0 if context == 0 else 8 + 25 * (seed % 3)
    return ChunkWindow(rid, seed, start, start + num_frames, context, holdback, codes, False)


def pcm_diff(a: bytes, b: bytes) -> int:
    assert len(a) == len(b)
    x, y = (np.frombuffer(p, dtype="<i2").astype(np.int32) for p in (a, b))
    return int(np.abs(x - y).max()) if len(x) else 0


def expected_pcm(codec, w: ChunkWindow) -> bytes:
    """The window decoded alone through `Codec.decode`, its kept samples as PCM16."""
    audio = codec.decode(torch.from_numpy(w.codes[None]))[0]
    return to_pcm16(audio[w.context * HOP : (w.context + w.num_frames) * HOP])


class Spy:
    """Wraps the decoder: records the shape of every call; optionally raises or writes NaN for
    batches holding a MARKER window."""

    def __init__(self, decoder, mode: str = "pass"):
        self.decoder, self.mode, self.shapes = decoder, mode, []

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(codes.shape))
        marked = (codes == MARKER).flatten(1).all(1)
        if self.mode == "raise" and marked.any():
            raise RuntimeError("injected codec failure")
        if self.mode == "never":
            raise AssertionError("the decoder must not be called")
        audio = self.decoder(codes)
        if self.mode == "nan":
            audio = audio.clone()
            audio[marked, :, 5] = float("nan")
        return audio


# -- batching ----------------------------------------------------------------------------------


def test_batched_decode_equals_one_by_one(codec):
    windows = [window(f"r{i}", 8, 25, seed=i) for i in range(5)]  # 5 requests, 33 frames each
    before = codec.chunks.num_batches
    batched = codec.chunks.decode(windows)
    assert codec.chunks.num_batches == before + 1
    for w, d in zip(windows, batched, strict=True):
        assert d.window is w and d.error is None
        assert len(d.pcm) == 25 * 2 * HOP
        single = codec.chunks.decode([w])[0]
        assert pcm_diff(d.pcm, single.pcm) <= 1
        assert pcm_diff(d.pcm, expected_pcm(codec, w)) <= 1
    # the windows sound different, so a mix-up of batch rows could not pass the checks above
    assert min(pcm_diff(a.pcm, b.pcm) for a, b in zip(batched, batched[1:], strict=False)) > 50

    stacked = torch.from_numpy(np.stack([w.codes for w in windows]))
    together = codec.decode(stacked)
    alone = torch.cat([codec.decode(stacked[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)


def test_mixed_lengths_are_grouped_and_returned_in_input_order(codec, monkeypatch):
    windows = [
        window("a", 8, 25, seed=1),  # steady: 33 frames
        window("b", 0, 8, seed=2),  # first chunk: 8 frames
        window("c", 8, 5, seed=3),  # tail: 13 frames
        window("d", 8, 0, seed=4),  # empty last chunk
        window("e", 8, 25, seed=5),
        window("f", 0, 13, seed=6),  # also 13 frames, without context (another profile)
        window("g", 0, 8, seed=7),
        window("h", 8, 17, seed=8),  # tail: 25 frames
        window("i", 3, 4, seed=9, holdback=1),  # 8 frames: context 3, holdback 1
        window("j", 8, 25, seed=10),
    ]
    expected = [expected_pcm(codec, w) if w.num_frames else b"" for w in windows]
    spy = Spy(codec.chunks.decoder)
    monkeypatch.setattr(codec.chunks, "decoder", spy)
    before = codec.chunks.num_batches
    decoded = codec.chunks.decode(windows)
    lengths = {w.window_frames for w in windows if w.num_frames}
    assert lengths == {33, 8, 13, 25}
    assert codec.chunks.num_batches == before + len(lengths)
    assert sorted(shape[2] for shape in spy.shapes) == sorted(lengths)  # one call per length
    assert {shape[2]: shape[0] for shape in spy.shapes} == {33: 3, 8: 3, 13: 2, 25: 1}
    assert [d.window for d in decoded] == windows
    assert all(d.window is w for d, w in zip(decoded, windows, strict=True))
    for d, want in zip(decoded, expected, strict=True):
        assert d.error is None
        assert len(d.pcm) == d.window.num_frames * 2 * HOP
        assert pcm_diff(d.pcm, want) <= 1


def test_batches_larger_than_the_captured_graphs_are_decoded_in_slices(codec, monkeypatch):
    """With codec graphs up to batch 2, five same-length windows are decoded as 2 + 2 + 1 (each
    a captured shape), in input order, with the same audio as one batch."""

    class NoGraphs:  # the slicing rule only; no shape is captured, so each slice runs eagerly
        max_batch = 2

        def has(self, batch, frames):
            return False

        def run(self, codes):
            return None

    windows = [window(f"s{i}", 8, 25, seed=60 + i) for i in range(5)]
    whole = codec.chunks.decode(windows)
    spy = Spy(codec.chunks.decoder)
    monkeypatch.setattr(codec.chunks, "decoder", spy)
    monkeypatch.setattr(codec.chunks, "graphs", NoGraphs())
    sliced = codec.chunks.decode(windows)
    assert [shape[0] for shape in spy.shapes] == [2, 2, 1]
    assert [d.window for d in sliced] == windows
    for a, b in zip(whole, sliced, strict=True):
        assert b.error is None and pcm_diff(a.pcm, b.pcm) <= 1


class FakeGraphs:
    """Codec graphs for `shapes` only: `run` decodes those (recording the shape) and returns
    None for any other, as CodecGraphs does."""

    def __init__(self, decoder, shapes, max_batch=64):
        self.decoder, self.shapes, self.max_batch, self.replays = decoder, shapes, max_batch, []

    def has(self, batch, frames):
        return (batch, frames) in self.shapes

    def run(self, codes):
        shape = (codes.shape[0], codes.shape[2])
        if shape not in self.shapes:
            return None
        self.replays.append(shape)
        return self.decoder(codes)


def test_same_length_windows_without_a_batch_graph_replay_single_window_graphs(codec, monkeypatch):
    """Last chunks come in any length; only (1, T) graphs exist for them. Two of one length
    replay the (1, T) graph twice rather than running the decoder eagerly on the pair, and
    batch shapes that are captured still go as one batch."""
    tails = [window(f"t{i}", 8, 9, seed=70 + i) for i in range(2)]  # 17 frames each
    steady = [window(f"s{i}", 8, 25, seed=80 + i) for i in range(3)]  # 33 frames
    windows = [tails[0], steady[0], tails[1], steady[1], steady[2]]
    expected = codec.chunks.decode(windows)  # no graphs: one eager batch per length
    graphs = FakeGraphs(codec.chunks.decoder, {(1, 17), (1, 33), (3, 33)})
    eager = Spy(codec.chunks.decoder, mode="never")
    monkeypatch.setattr(codec.chunks, "graphs", graphs)
    monkeypatch.setattr(codec.chunks, "decoder", eager)
    decoded = codec.chunks.decode(windows)
    assert eager.shapes == []  # nothing ran outside a graph
    assert sorted(graphs.replays) == [(1, 17), (1, 17), (3, 33)]
    assert [d.window for d in decoded] == windows
    for a, b in zip(expected, decoded, strict=True):
        assert b.error is None and pcm_diff(a.pcm, b.pcm) <= 1


# -- failure isolation -------------------------------------------------------------------------


def test_a_raising_batch_fails_only_its_culprit(codec, monkeypatch):
    windows = [window(f"r{i}", 8, 25, seed=20 + i) for i in range(4)]
    windows.insert(2, window("bad", 8, 25, seed=30, fill=MARKER))
    windows.append(window("tail", 8, 6, seed=31))  # another group, decoded as a batch
    expected = [expected_pcm(codec, w) for w in windows]
    spy = Spy(codec.chunks.decoder, "raise")
    monkeypatch.setattr(codec.chunks, "decoder", spy)
    decoded = codec.chunks.decode(windows)
    assert [d.window.request_id for d in decoded] == ["r0", "r1", "bad", "r2", "r3", "tail"]
    bad = decoded[2]
    assert bad.pcm == b""
    assert bad.error and "injected codec failure" in bad.error
    for i, d in enumerate(decoded):
        if i != 2:
            assert d.error is None, d.error
            assert pcm_diff(d.pcm, expected[i]) <= 1
    # the failed batch of 5, then each of its members alone, and the tail's batch of 1
    assert sorted(spy.shapes) == sorted([(5, 8, 33)] + [(1, 8, 33)] * 5 + [(1, 8, 14)])


def test_non_finite_audio_fails_only_its_window(codec, monkeypatch):
    windows = [window(f"r{i}", 8, 25, seed=40 + i) for i in range(3)]
    windows.insert(1, window("nan", 8, 25, seed=50, fill=MARKER))
    expected = [expected_pcm(codec, w) for w in windows]
    spy = Spy(codec.chunks.decoder, "nan")
    monkeypatch.setattr(codec.chunks, "decoder", spy)
    before = codec.chunks.num_batches
    decoded = codec.chunks.decode(windows)
    assert spy.shapes == [(4, 8, 33)]  # no fallback: the batch itself succeeded
    assert codec.chunks.num_batches == before + 1
    assert decoded[1].pcm == b"" and decoded[1].error and "non-finite" in decoded[1].error
    for i in (0, 2, 3):
        assert decoded[i].error is None
        assert pcm_diff(decoded[i].pcm, expected[i]) <= 1


def test_a_decoder_that_always_fails_errors_every_window_without_raising(codec, monkeypatch):
    windows = [window("a", 8, 25, seed=60), window("b", 0, 8, seed=61)]
    monkeypatch.setattr(codec.chunks, "decoder", Spy(codec.chunks.decoder, "never"))
    decoded = codec.chunks.decode(windows)
    assert [d.pcm for d in decoded] == [b"", b""]
    assert all(d.error and "AssertionError" in d.error for d in decoded)


def test_empty_windows_do_not_call_the_decoder(codec, monkeypatch):
    empty = [window("a", 8, 0, seed=70), window("b", 0, 0, seed=71)]
    assert [w.window_frames for w in empty] == [8, 0]
    spy = Spy(codec.chunks.decoder, "never")
    monkeypatch.setattr(codec.chunks, "decoder", spy)
    before = codec.chunks.num_batches
    decoded = codec.chunks.decode(empty)
    assert [(d.pcm, d.error) for d in decoded] == [(b"", None), (b"", None)]
    assert spy.shapes == [] and codec.chunks.num_batches == before
    assert codec.chunks.decode([]) == []


# -- our decoder vs transformers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(codec_dir):
    cfg, state = load_codec_state(codec_dir)
    return build_reference_model(cfg, state, CPU)


@pytest.mark.parametrize("batch,frames", [(1, 8), (4, 33), (2, 1), (1, 57)])
def test_decoder_matches_transformers(codec, reference, batch, frames):
    codes = torch.randint(
        0, 1024, (batch, 8, frames), generator=torch.Generator().manual_seed(frames)
    )
    ours = codec.decode(codes)
    with torch.inference_mode():
        out = reference.decode(codes, return_dict=False)
    ref = (out[0] if isinstance(out, tuple) else out)[:, 0].float()
    assert ours.shape == ref.shape == (batch, frames * HOP)
    assert ref.abs().max() > 1e-2  # a real signal, not silence
    rel = ((ours - ref).norm() / ref.norm()).item()
    worst = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"\n({batch}, {frames}): relative L2 {rel:.2e}, max {worst:.2e}")
    assert rel < 1e-5 and worst < 1e-5


@pytest.mark.parametrize("autotune", [False, True], ids=["heuristic", "autotuned"])
def test_codec_captures_every_batch_size_unless_autotuned(codec_dir, monkeypatch, autotune):
    """Codec graphs come for every batch size up to the plan's maximum; autotuned ones (each
    a cuDNN timing at start-up) for the coarse ladder, with autotuning asked of the capture,
    which runs on the codec's own stream. The capture itself needs CUDA: recorded here, not
    run (a stand-in for the stream)."""
    from engine.codec.codec_graphs import CodecGraphs, batch_ladder
    from engine.config import StreamConfig
    from engine.plan import ExecutionPlan

    asked = []
    monkeypatch.setattr(
        CodecGraphs, "capture", lambda self, autotune, stream: asked.append((autotune, stream))
    )
    plan = ExecutionPlan(codec_graph_max_batch=24, codec_autotune=autotune)
    codec = Codec.load(codec_dir, CPU, 1 << 20, plan)
    codec.chunks.stream = stream = object()  # stands for the codec's CUDA stream
    codec.capture_graphs(StreamConfig())
    graphs = codec.chunks.graphs
    assert asked == [(autotune, stream)]  # captured on the stream it replays on
    assert graphs.ladder == (batch_ladder(24) if autotune else list(range(1, 25)))
    assert graphs.graph_shape(9, 33) == ((10, 33) if autotune else (9, 33))
