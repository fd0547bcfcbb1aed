"""Shape of the codec, read from a standalone tokenizer's config.json (transformers layout,
`model_type: higgs_audio_v2_tokenizer`) or from a v3 checkpoint.

A v3 checkpoint bundles the codec weights under `tied.embedding.modality_embeddings.0.model.`
but its config.json is not known to describe the codec; the published tokenizer's shape is
used unless `audio_encoder_config.codec_config` (written by our checkpoint writer, in the
standalone layout) says otherwise. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.config import ConfigError

# The published Higgs audio tokenizer (hop 8*5*4*2*3 = 960 at 24 kHz, 25 frames/s, 2 kbps).
STANDARD_CODEC_CONFIG: dict[str, Any] = {
    "model_type": "higgs_audio_v2_tokenizer",
    "sample_rate": 24000,
    "semantic_sample_rate": 16000,
    "downsample_factor": 320,
    "codebook_size": 1024,
    "codebook_dim": 64,
    "target_bandwidths": [0.5, 1, 1.5, 2],
    "acoustic_model_config": {
        "model_type": "dac",
        "encoder_hidden_size": 64,
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "decoder_hidden_size": 1024,
        "upsampling_ratios": [8, 5, 4, 2, 3],
        "hidden_size": 256,
    },
    "semantic_model_config": {"model_type": "hubert", "hidden_size": 768},
}

# A few channels everywhere: the embedded default model's codec, fast on a CPU.
TINY_CODEC_CONFIG: dict[str, Any] = {
    **STANDARD_CODEC_CONFIG,
    "codebook_dim": 16,
    "acoustic_model_config": {
        "model_type": "dac",
        "encoder_hidden_size": 4,
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "decoder_hidden_size": 64,
        "upsampling_ratios": [8, 5, 4, 2, 3],
        "hidden_size": 16,
    },
    "semantic_model_config": {
        "model_type": "hubert",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": [16] * 7,
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
    },
}


@dataclass(frozen=True)
class CodecConfig:
    """What the decoder needs, plus the full dict the reference encoder is built from."""

    sample_rate: int
    hop_length: int
    num_codebooks: int
    codebook_size: int
    codebook_dim: int
    hidden_size: int  # RVQ space: acoustic + semantic hidden sizes
    acoustic_hidden_size: int
    decoder_hidden_size: int
    upsampling_ratios: tuple[int, ...]
    raw: dict[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CodecConfig:
        if raw.get("model_type", "higgs_audio_v2_tokenizer") != "higgs_audio_v2_tokenizer":
            raise ConfigError(
                f"codec model_type {raw.get('model_type')!r} is not a Higgs tokenizer"
            )
        acoustic = raw.get("acoustic_model_config") or {}
        semantic = raw.get("semantic_model_config") or {}
        try:
            up = tuple(acoustic["upsampling_ratios"])
            down = tuple(acoustic["downsampling_ratios"])
            sr = int(raw["sample_rate"])
            bandwidth = float(raw["target_bandwidths"][-1])
            cb_size = int(raw["codebook_size"])
            hop = math.prod(down)
            frame_rate = math.ceil(sr / hop)
            num_q = int(1000 * bandwidth // (frame_rate * math.ceil(math.log2(cb_size))))
            cfg = cls(
                sample_rate=sr,
                hop_length=hop,
                num_codebooks=num_q,
                codebook_size=cb_size,
                codebook_dim=int(raw["codebook_dim"]),
                hidden_size=int(acoustic["hidden_size"]) + int(semantic.get("hidden_size", 768)),
                acoustic_hidden_size=int(acoustic["hidden_size"]),
                decoder_hidden_size=int(acoustic["decoder_hidden_size"]),
                upsampling_ratios=up,
                raw=raw,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"codec config is incomplete or malformed: {exc!r}") from exc
        cfg.validate(down)
        return cfg

    def validate(self, downsampling: tuple[int, ...]) -> None:
        if (self.sample_rate, self.hop_length) != (24000, 960) or math.prod(
            self.upsampling_ratios
        ) != 960:
            raise ConfigError(
                f"the codec must run at 24 kHz with hop 960 (25 frames/s); got "
                f"{self.sample_rate} Hz, hop {self.hop_length}, upsampling {self.upsampling_ratios}"
            )
        if self.num_codebooks != 8 or self.codebook_size != 1024:
            raise ConfigError(
                f"the codec must use 8 codebooks of 1024 (target_bandwidths ending in 2 kbps); "
                f"got {self.num_codebooks} x {self.codebook_size}"
            )
        if self.decoder_hidden_size % 2 ** len(self.upsampling_ratios):
            raise ConfigError(
                "decoder_hidden_size must halve cleanly through every upsampling block"
            )
