"""The codec as the engine uses it: the streaming decoder, batched window decoding, the
reference encoder and the voice cache, loaded together from one source."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from engine.codec.audio_io import AudioLimits, decode_audio, prepare_waveform
from engine.codec.chunk_decoder import ChunkDecoder
from engine.codec.codec_graphs import CodecGraphs, batch_ladder
from engine.codec.config import CodecConfig
from engine.codec.loader import build_decoder, load_codec_state
from engine.codec.reference_encoder import ReferenceEncoder
from engine.codec.voice_cache import Frames, VoiceCache
from engine.config import StreamConfig
from engine.cuda_graphs import CaptureReport
from engine.plan import ExecutionPlan

log = logging.getLogger("clonecast.engine")


class Codec:
    def __init__(
        self,
        cfg: CodecConfig,
        state: dict,
        device: torch.device,
        voice_cache_bytes: int,
        plan: ExecutionPlan | None = None,
    ):
        """`plan`: codec_dtype, fused_ops (Triton Snake), codec_channels_last (NHWC
        activations), codec_graph_max_batch and codec_autotune (see `capture_graphs`)."""
        self.plan = plan = plan or ExecutionPlan()
        self.config = cfg
        dtype = getattr(torch, plan.codec_dtype)
        self.decoder = build_decoder(
            cfg, state, device, dtype, plan.fused_ops, plan.codec_channels_last
        )
        self.chunks = ChunkDecoder(self.decoder)
        self.encoder = ReferenceEncoder(cfg, state, device)
        self.voices = VoiceCache(voice_cache_bytes)

    @classmethod
    def load(
        cls,
        path: Path,
        device: torch.device,
        voice_cache_bytes: int,
        plan: ExecutionPlan | None = None,
    ) -> Codec:
        cfg, state = load_codec_state(path)
        return cls(cfg, state, device, voice_cache_bytes, plan)

    def capture_graphs(self, stream: StreamConfig) -> CaptureReport | None:
        """Decoder graphs for the window shapes `stream` produces, batches up to the plan's
        codec_graph_max_batch (none when it is 0); before any request."""
        max_batch = self.plan.codec_graph_max_batch
        if not max_batch:
            return None
        window = stream.left_context_frames + stream.chunk_frames + stream.holdback_frames
        autotune = self.plan.codec_autotune
        ladder = batch_ladder(max_batch) if autotune else None  # see batch_ladder
        graphs = CodecGraphs(
            self.decoder, max_batch, stream.first_chunk_frames, window, ladder=ladder
        )
        if autotune:  # the longest part of a GPU server's start: say what it is and its remedy
            log.info(
                "codec: timing cuDNN's algorithms for %d %s graph shapes (about 0.6 s each on "
                "an H100; the plan's codec_autotune false starts faster with the fp32 codec)",
                len(graphs.window_shapes),
                self.plan.codec_dtype,
            )
        shared = torch.cuda.graph.default_capture_stream  # the backbone's (see capture_graph)
        if shared is not None and shared == self.chunks.stream:  # torch's pool of 32 wrapped
            self.chunks.stream = torch.cuda.Stream(self.chunks.device)
        report = graphs.capture(autotune=autotune, stream=self.chunks.stream)
        self.chunks.graphs = graphs
        return report

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
