"""Batched decoding of streaming windows: each step, windows of the same length from
different requests are stacked along the batch dimension and decoded together.

A failure stays with its request: if a batch raises, its members are decoded one by one and
only those that still fail get an error; a window whose audio is not finite fails alone.

On CUDA the codec runs on its own stream: its work overlaps the backbone step that the engine
launched before decoding, and reading its audio back waits for the codec stream alone.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch

from engine.codec.decoder import CodecDecoder
from engine.streaming import ChunkWindow


@dataclass(frozen=True)
class DecodedChunk:
    window: ChunkWindow
    pcm: bytes  # PCM16 little-endian, 24 kHz mono
    error: str | None = None


class ChunkDecoder:
    def __init__(self, decoder: CodecDecoder):
        self.decoder = decoder
        self.device = decoder.codebooks.device
        self.hop = decoder.config.hop_length
        self.num_batches = 0
        self.graphs = None  # a CodecGraphs once captured (CUDA only)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    @torch.inference_mode()
    def decode(self, windows: list[ChunkWindow]) -> list[DecodedChunk]:
        """Decodes every window (grouped by length); returns results in input order."""
        results: dict[int, DecodedChunk] = {}
        groups: dict[int, list[int]] = defaultdict(list)
        for i, w in enumerate(windows):
            if w.num_frames == 0:
                results[i] = DecodedChunk(w, b"")
            else:
                groups[w.window_frames].append(i)
        for members in groups.values():
            batch = [windows[i] for i in members]
            try:
                decoded = self._decode_batch(batch)
            except Exception:
                decoded = [self._decode_one(w) for w in batch]
            results.update(zip(members, decoded, strict=True))
        return [results[i] for i in range(len(windows))]

    def _decode_one(self, window: ChunkWindow) -> DecodedChunk:
        try:
            return self._decode_batch([window])[0]
        except Exception as exc:
            return DecodedChunk(window, b"", f"codec decode failed: {type(exc).__name__}: {exc}")

    def _decode_batch(self, batch: list[ChunkWindow]) -> list[DecodedChunk]:
        on_stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with on_stream:
            return self._decode_on_stream(batch)

    def _decode_on_stream(self, batch: list[ChunkWindow]) -> list[DecodedChunk]:
        codes = torch.tensor([w.codes for w in batch], dtype=torch.long).to(self.device)
        audio = self.graphs.run(codes) if self.graphs is not None else None
        if audio is None:
            audio = self.decoder(codes)
        audio = audio[:, 0].float()  # [B, frames * hop]
        self.num_batches += 1
        finite = torch.isfinite(audio).all(dim=1)
        # PCM16 on the device, then one copy to the host for the whole batch.
        pcm = (audio.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
        pcm, finite = pcm.cpu().numpy(), finite.cpu().tolist()
        out = []
        for w, samples, ok in zip(batch, pcm, finite, strict=True):
            if not ok:
                out.append(DecodedChunk(w, b"", "codec produced non-finite audio"))
                continue
            keep = samples[w.context * self.hop : (w.context + w.num_frames) * self.hop]
            out.append(DecodedChunk(w, keep.astype("<i2", copy=False).tobytes()))
        return out
