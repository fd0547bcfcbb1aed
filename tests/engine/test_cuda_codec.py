"""On an NVIDIA GPU: our codec decoder against transformers' HiggsAudioV2TokenizerModel.decode
at the published codec size (random weights), in fp32 and in bf16."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint_writer import write_codec_dir
from engine.codec.config import STANDARD_CODEC_CONFIG
from engine.codec.loader import build_decoder, build_reference_model, load_codec_state

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def full_codec(tmp_path_factory):
    cfg, state = load_codec_state(
        write_codec_dir(tmp_path_factory.mktemp("codec"), STANDARD_CODEC_CONFIG, 9)
    )
    return cfg, state, build_reference_model(cfg, state, CUDA)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("shape", [(1, 8), (4, 33), (1, 17)])
def test_fp32_decoder_parity(full_codec, shape):
    cfg, state, ref = full_codec
    decoder = build_decoder(cfg, state, CUDA, torch.float32)
    codes = torch.randint(0, 1024, (shape[0], 8, shape[1]), device=CUDA)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # exact fp32 convolutions for the comparison
    try:
        with torch.no_grad():
            err = _rel(decoder(codes), ref.decode(codes, return_dict=False))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    print(f"codec fp32 {shape}: rel err {err:.2e}")
    assert err <= 1e-5


def test_bf16_decoder_against_fp32_reference(full_codec):
    cfg, state, ref = full_codec
    decoder = build_decoder(cfg, state, CUDA, torch.bfloat16)
    codes = torch.randint(0, 1024, (8, 8, 33), device=CUDA)
    with torch.no_grad():
        err = _rel(decoder(codes), ref.decode(codes, return_dict=False))
    print(f"codec bf16 (8, 33): rel err vs fp32 reference {err:.2e}")
    assert err <= 5e-2
