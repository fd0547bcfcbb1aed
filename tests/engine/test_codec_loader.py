"""Codec loading: standalone tokenizer dir or bundled in a v3 checkpoint, weight-norm
folding, errors naming keys, and parity with transformers' decoder."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ConfigError, Engine, EngineConfig, SamplingParams
from engine.checkpoint_writer import TINY_TEXT_CONFIG, write_checkpoint, write_codec_dir
from engine.codec.codec import Codec
from engine.codec.config import TINY_CODEC_CONFIG, CodecConfig
from engine.codec.loader import build_decoder, build_reference_model, load_codec_state

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    return write_codec_dir(tmp_path_factory.mktemp("codec"), TINY_CODEC_CONFIG, seed=4)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_decoder_matches_transformers_decode(codec_dir):
    cfg, state = load_codec_state(codec_dir)
    ours = build_decoder(cfg, state, CPU, torch.float32)
    ref = build_reference_model(cfg, state, CPU)
    for b, t in [(1, 8), (3, 33), (2, 1), (1, 60)]:
        codes = torch.randint(0, 1024, (b, 8, t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            expected = ref.decode(codes, return_dict=False)
            got = ours(codes)
        assert got.shape == expected.shape == (b, 1, t * 960)
        assert _rel(got, expected) <= 1e-5


@pytest.mark.parametrize("fused", [False, True], ids=["torch-snake", "triton-snake"])
def test_channels_last_decoder_equals_the_default_layout(codec_dir, fused, monkeypatch):
    """NHWC activations and 2-D convolutions on converted weights (with fused Snake: each
    convolution's bias and the residual adds folded into the Snake passes) compute the same
    audio (fp32, to rounding); switching back restores the default path. The convolutions'
    biases are redrawn: the random codec's are zero, which would hide a dropped bias."""
    from engine.codec.decoder import AcousticDecoder

    cfg, state = load_codec_state(codec_dir)
    gen = torch.Generator().manual_seed(5)
    for key, value in state.items():
        if key.startswith("acoustic_decoder.") and key.endswith(".bias"):
            state[key] = torch.randn(value.shape, generator=gen) * 0.3
    plain = build_decoder(cfg, state, CPU, torch.float32, fused)
    nhwc = build_decoder(cfg, state, CPU, torch.float32, fused, True)
    folded = []
    original = AcousticDecoder._forward_folded
    monkeypatch.setattr(
        AcousticDecoder, "_forward_folded", lambda self, x: folded.append(1) or original(self, x)
    )
    # The window shapes the stream decodes (8, 33 frames) and a single frame; fused Snake
    # runs in Triton's interpreter (3 x 33 frames took 20 s there); any length covers its
    # 1,024-sample blocks and a partial last one.
    shapes = [(1, 8), (2, 12), (2, 1)] if fused else [(1, 8), (3, 33), (2, 1)]
    for b, t in shapes:
        codes = torch.randint(0, 1024, (b, 8, t), generator=torch.Generator().manual_seed(b + t))
        with torch.no_grad():
            expected, got = plain(codes), nhwc(codes)
        assert got.shape == expected.shape == (b, 1, t * 960)
        assert _rel(got, expected) <= 1e-5
    assert len(folded) == (3 if fused else 0)  # the folded path runs exactly with fused Snake
    nhwc.use_channels_last(False)
    with torch.no_grad():
        assert torch.equal(nhwc(codes), plain(codes))


def test_bundled_codec_loads_like_the_standalone_one(codec_dir, tmp_path):
    ckpt = write_checkpoint(
        tmp_path / "v3", TINY_TEXT_CONFIG, seed=2, codec_config=TINY_CODEC_CONFIG
    )
    bundled_cfg, bundled = load_codec_state(ckpt)
    assert bundled_cfg == CodecConfig.from_dict(TINY_CODEC_CONFIG)
    assert any(k.startswith("acoustic_decoder.") for k in bundled)
    engine = Engine.from_pretrained(ckpt, EngineConfig(max_num_seqs=1))
    assert engine.codec is not None
    # A standalone codec overrides the bundled one.
    engine2 = Engine.from_pretrained(ckpt, EngineConfig(max_num_seqs=1), codec=codec_dir)
    codes = torch.randint(0, 1024, (1, 8, 9))
    a, b = engine.codec.decode(codes), engine2.codec.decode(codes)
    assert a.shape == b.shape and not torch.equal(a, b)
    assert torch.allclose(engine2.codec.decode(codes), Codec.load(codec_dir, CPU, 1).decode(codes))


def test_weight_norm_parts_are_folded(codec_dir, tmp_path):
    state = load_file(str(codec_dir / "model.safetensors"))
    normed = dict(state)
    for key in [
        k for k in state if k.startswith("acoustic_decoder.") and k.endswith("conv1.weight")
    ]:
        w = state[key]
        norm = w.norm(dim=tuple(range(1, w.dim())), keepdim=True)
        del normed[key]
        normed[key[: -len("weight")] + "weight_g"] = norm
        normed[key[: -len("weight")] + "weight_v"] = w / norm * 3.0  # any scale of v
    out = shutil.copytree(codec_dir, tmp_path / "wn")
    save_file(normed, str(out / "model.safetensors"))
    cfg, plain = load_codec_state(codec_dir)
    _, folded = load_codec_state(out)
    codes = torch.randint(0, 1024, (2, 8, 12))
    a = build_decoder(cfg, plain, CPU, torch.float32)(codes)
    b = build_decoder(cfg, folded, CPU, torch.float32)(codes)
    assert _rel(b, a) <= 1e-6


def test_missing_decoder_key_is_named(codec_dir, tmp_path):
    state = load_file(str(codec_dir / "model.safetensors"))
    del state["quantizer.quantizers.5.project_out.bias"]
    out = shutil.copytree(codec_dir, tmp_path / "bad")
    save_file(state, str(out / "model.safetensors"))
    cfg, st = load_codec_state(out)
    with pytest.raises(ConfigError, match=r"quantizer\.quantizers\.5\.project_out\.bias"):
        build_decoder(cfg, st, CPU, torch.float32)


def test_codec_config_must_be_24k_hop_960_with_8_codebooks():
    bad_hop = copy.deepcopy(TINY_CODEC_CONFIG)
    bad_hop["acoustic_model_config"]["upsampling_ratios"] = [8, 5, 4, 2]
    bad_hop["acoustic_model_config"]["downsampling_ratios"] = [8, 5, 4, 2]
    with pytest.raises(ConfigError, match="hop 960"):
        CodecConfig.from_dict(bad_hop)
    bad_q = {**TINY_CODEC_CONFIG, "target_bandwidths": [0.5, 1, 1.5, 2, 4]}
    with pytest.raises(ConfigError, match="8 codebooks"):
        CodecConfig.from_dict(bad_q)


def test_checkpoint_without_codec_and_explicit_bad_codec(tiny_ckpt, tmp_path):
    with pytest.raises(ConfigError, match="bundles no codec"):
        load_codec_state(tiny_ckpt)
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=1))
    assert engine.codec is None  # codes only, with a warning
    with pytest.raises(ConfigError):
        Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=1), codec=tmp_path)


def test_decoder_only_codec_streams_but_cannot_encode(codec_dir, tmp_path):
    state = load_file(str(codec_dir / "model.safetensors"))
    keep = {
        k: v for k, v in state.items() if k.startswith(("quantizer.", "fc2.", "acoustic_decoder."))
    }
    out = tmp_path / "dec-only"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(TINY_CODEC_CONFIG))
    save_file(keep, str(out / "model.safetensors"))
    engine = Engine.from_pretrained(
        None, EngineConfig(max_num_seqs=1), codec=out, cache_dir=tmp_path / "c"
    )
    [r] = engine.generate(["hi"], params=SamplingParams(seed=1, max_rows=20))
    assert len(r.pcm) == 12 * 1920
    with pytest.raises(ConfigError, match="no encoder weights"):
        engine.encode_reference(waveform=torch.randn(24000) * 0.1, sample_rate=24000)


def test_channels_last_weights_follow_the_module(codec_dir):
    """The converted weights are non-persistent buffers: `.to()` casts them, the state dict
    keeps the checkpoint's keys, and they are copies taken when the mode is set."""
    cfg, state = load_codec_state(codec_dir)
    plain = build_decoder(cfg, state, CPU, torch.float32)
    nhwc = build_decoder(cfg, state, CPU, torch.float32, False, True)
    assert set(nhwc.state_dict()) == set(plain.state_dict())
    codes = torch.randint(0, 1024, (2, 8, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out64 = nhwc.to(torch.float64)(codes)
        assert out64.dtype == torch.float64
        assert _rel(out64.float(), plain(codes)) <= 1e-5


@pytest.mark.parametrize("channels_last", [False, True])
def test_convolutions_leave_out_their_bias_when_asked(channels_last):
    """`bias=False` leaves the bias out in both layouts (the folded path adds it itself)."""
    from engine.codec.decoder import Conv1d, ConvTranspose1d

    torch.manual_seed(2)
    for conv in (Conv1d(4, 6, 3, padding=1), ConvTranspose1d(4, 6, 6, stride=3, padding=2)):
        x = torch.randn(2, 4, 9)
        with torch.no_grad():
            conv.bias.uniform_(0.5, 1.0)
            with_bias = conv(x)
            conv.set_channels_last(channels_last)
            if channels_last:
                nhwc = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
                without = conv(nhwc, bias=False).squeeze(2)
            else:
                without = conv(x, bias=False)
        torch.testing.assert_close(without + conv.bias[:, None], with_bias, rtol=1e-5, atol=1e-5)


def test_channels_last_convolution_keeps_groups():
    from engine.codec.decoder import Conv1d

    conv = Conv1d(4, 6, 3, padding=1, groups=2)
    x = torch.randn(2, 4, 9)
    with torch.no_grad():
        ref = conv(x)
        conv.set_channels_last(True)
        got = conv(x.unsqueeze(2).contiguous(memory_format=torch.channels_last)).squeeze(2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_cudnn_autotuned_turns_benchmark_mode_on_inside_only():
    """The plan's codec_autotune: capture runs with cuDNN's benchmark mode on; every other
    cuDNN setting is kept (cuDNN's own flags() would reset the algorithm limit), and the
    mode is as it was afterwards, also after an error."""
    from engine.codec.codec_graphs import cudnn_autotuned

    cudnn = torch.backends.cudnn
    before = (cudnn.benchmark, cudnn.benchmark_limit, cudnn.allow_tf32, cudnn.deterministic)
    cudnn.benchmark_limit = 0  # a non-default setting that must survive
    try:
        with cudnn_autotuned(True):
            assert cudnn.benchmark is True and cudnn.benchmark_limit == 0
            assert (cudnn.allow_tf32, cudnn.deterministic) == before[2:]
        assert cudnn.benchmark is before[0]
        with pytest.raises(RuntimeError), cudnn_autotuned(True):
            raise RuntimeError("a capture failed")
        assert cudnn.benchmark is before[0]
        with cudnn_autotuned(False):
            assert cudnn.benchmark is before[0]
    finally:
        cudnn.benchmark_limit = before[1]


def test_overlapping_autotuned_captures_keep_benchmark_mode_until_the_last_leaves():
    """Engines of one process capture their codec graphs in threads of their own at once:
    the first to leave must not turn timing off under the other (its remaining shapes
    would be captured with cuDNN's untimed picks), and the last puts the mode back."""
    import threading

    from engine.codec.codec_graphs import cudnn_autotuned

    cudnn = torch.backends.cudnn
    before = cudnn.benchmark
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with cudnn_autotuned(True):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        with cudnn_autotuned(True):
            b_in.set()
            a_out.wait(5)
            seen["after a left"] = cudnn.benchmark
        seen["after both"] = cudnn.benchmark

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert a_out.is_set() and seen == {"after a left": True, "after both": before}


def test_codec_graph_batch_ladder_pads_to_the_next_rung():
    """Autotuned graphs come for a ladder of batch sizes, not each one: every size to 8,
    then a step that doubles with each doubling, and the maximum. A batch between rungs
    replays the next larger rung (never more than a quarter larger above 8); tails have
    only (1, T) graphs; a batch above the maximum, or a batched length that is not a
    window's, has none."""
    from engine.codec.codec_graphs import CodecGraphs, batch_ladder

    assert batch_ladder(64) == [*range(1, 9), 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert batch_ladder(5) == [1, 2, 3, 4, 5]
    assert batch_ladder(70) == [*batch_ladder(64), 70]
    for top in (1, 9, 37, 64, 70, 256):
        ladder = batch_ladder(top)
        assert ladder[-1] == top and ladder == sorted(set(ladder))
        rung = {b: min(r for r in ladder if r >= b) for b in range(1, top + 1)}
        assert all(rung[b] <= max(8, b * 1.25) for b in rung)
    every = CodecGraphs(decoder=None, max_batch=64)  # without autotuning: every size
    assert every.ladder == list(range(1, 65)) and every.graph_shape(9, 33) == (9, 33)
    graphs = CodecGraphs(None, 64, first_frames=8, window_frames=33, ladder=batch_ladder(64))
    assert graphs.graph_shape(9, 33) == (10, 33)
    assert graphs.graph_shape(33, 8) == (40, 8)
    assert graphs.graph_shape(64, 33) == (64, 33)
    assert graphs.graph_shape(65, 33) is None  # ChunkDecoder slices such batches
    assert graphs.graph_shape(1, 17) == (1, 17) and graphs.graph_shape(2, 17) is None
    assert graphs.graph_shape(3, 34) is None
    assert len(graphs.window_shapes) + len(graphs.tail_shapes) == 20 * 2 + 33 - 2
