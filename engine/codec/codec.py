"""The codec as the engine uses it: the streaming decoder, batched window decoding, the
reference encoder and the voice cache, loaded together from one source."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from engine.codec.audio_io import AudioLimits, decode_audio, prepare_waveform
from engine.codec.chunk_decoder import ChunkDecoder
from engine.codec.config import CodecConfig
from engine.codec.loader import build_decoder, load_codec_state
from engine.codec.reference_encoder import ReferenceEncoder
from engine.codec.voice_cache import Frames, VoiceCache


class Codec:
    def __init__(
        self,
        cfg: CodecConfig,
        state: dict,
        device: torch.device,
        dtype: torch.dtype,
        voice_cache_bytes: int,
        fused: bool = False,
        channels_last: bool = False,
    ):
        self.config = cfg
        self.decoder = build_decoder(cfg, state, device, dtype, fused, channels_last)
        self.chunks = ChunkDecoder(self.decoder)
        self.encoder = ReferenceEncoder(cfg, state, device)
        self.voices = VoiceCache(voice_cache_bytes)

    @classmethod
    def load(
        cls,
        path: Path,
        device: torch.device,
        dtype: torch.dtype,
        voice_cache_bytes: int,
        fused: bool = False,
        channels_last: bool = False,
    ) -> Codec:
        """`fused`: Triton Snake activations in the decoder (CUDA only); `channels_last`: its
        activations in NHWC memory."""
        cfg, state = load_codec_state(path)
        return cls(cfg, state, device, dtype, voice_cache_bytes, fused, channels_last)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[B, 8, T]` -> waveform `[B, T * 960]` (fp32)."""
        return self.decoder(codes.to(self.decoder.codebooks.device))[:, 0].float()

    def encode_file(self, data: bytes, limits: AudioLimits) -> tuple[Frames, bool]:
        """An uploaded audio file -> reference frames; (frames, was_cached)."""
        key = hashlib.sha256(b"file:" + data).digest()
        return self.voices.get_or_encode(
            key, lambda: self.encoder.encode(decode_audio(data, limits))
        )

    def encode_waveform(
        self, waveform: torch.Tensor, sample_rate: int, limits: AudioLimits
    ) -> tuple[Frames, bool]:
        samples = waveform.detach().float().contiguous().cpu()
        key = hashlib.sha256(
            f"wave:{sample_rate}:{tuple(samples.shape)}:".encode() + samples.numpy().tobytes()
        ).digest()
        return self.voices.get_or_encode(
            key, lambda: self.encoder.encode(prepare_waveform(samples, sample_rate, limits))
        )
