"""Batched decoding of streaming windows: each step, windows of the same length from
different requests are stacked along the batch dimension and decoded together.

A failure stays with its request: if a batch raises, its members are decoded one by one and
only those that still fail get an error; a window whose audio is not finite fails alone.

On CUDA the codec runs on its own stream: its work overlaps the backbone step that the engine
launched before decoding. `submit` only queues the work and the copies of the PCM to pinned
host memory; `PendingChunks.result()` waits for them, so the engine can read a step's audio
one step later instead of stalling its thread while the codec runs.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from engine.codec.decoder import CodecDecoder
from engine.streaming import ChunkWindow


@dataclass(frozen=True)
class DecodedChunk:
    window: ChunkWindow
    pcm: bytes  # PCM16 little-endian, 24 kHz mono
    error: str | None = None


class PendingChunks:
    """Windows submitted for decoding: some already decoded (empty, or decoded one by one
    after a failure), the rest in launched batches. `result()` waits for the batches (the
    copies to pinned host memory) and returns the decoded chunks in submission order."""

    def __init__(self, windows: list[ChunkWindow], hop: int):
        self.windows = windows
        self._hop = hop
        self._done: dict[int, DecodedChunk] = {}
        self._launched: list[tuple[list[int], torch.Tensor, torch.Tensor, object]] = []

    def set_done(self, index: int, chunk: DecodedChunk) -> None:
        self._done[index] = chunk

    def add_batch(self, members: list[int], pcm, finite, event) -> None:
        """Windows `members` decode into PCM16 rows `pcm` with finite flags `finite`, both
        valid once `event` has completed (None: valid now)."""
        self._launched.append((members, pcm, finite, event))

    def result(self) -> list[DecodedChunk]:
        for members, pcm, finite, event in self._launched:
            if event is not None:
                event.synchronize()
            rows, oks = pcm.numpy(), finite.tolist()
            for i, samples, ok in zip(members, rows, oks, strict=True):
                self._done[i] = _to_chunk(self.windows[i], samples, ok, self._hop)
        self._launched = []
        return [self._done[i] for i in range(len(self.windows))]


def _to_chunk(w: ChunkWindow, samples, ok: bool, hop: int) -> DecodedChunk:
    """A window's decoded PCM16 samples (context included) -> its chunk."""
    if not ok:
        return DecodedChunk(w, b"", "codec produced non-finite audio")
    keep = samples[w.context * hop : (w.context + w.num_frames) * hop]
    return DecodedChunk(w, keep.astype("<i2", copy=False).tobytes())


class ChunkDecoder:
    def __init__(self, decoder: CodecDecoder):
        self.decoder = decoder
        self.device = decoder.codebooks.device
        self.hop = decoder.config.hop_length
        self.num_batches = 0
        self.graphs = None  # a CodecGraphs once captured (CUDA only)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def decode(self, windows: list[ChunkWindow]) -> list[DecodedChunk]:
        """Decodes every window (grouped by length) and waits; results in input order."""
        return self.submit(windows).result()

    @torch.inference_mode()
    def submit(self, windows: list[ChunkWindow]) -> PendingChunks:
        """Queues every window's decoding (one batch per window length, on the codec stream)
        and the copy of its PCM to pinned host memory; returns without waiting on CUDA."""
        pending = PendingChunks(windows, self.hop)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, w in enumerate(windows):
            if w.num_frames == 0:
                pending.set_done(i, DecodedChunk(w, b""))
            else:
                groups[w.window_frames].append(i)
        graphs = self.graphs
        limit = graphs.max_batch if graphs is not None else len(windows)
        for frames, group in groups.items():
            batches = [group[i : i + limit] for i in range(0, len(group), limit)]
            if graphs is not None and graphs.has(1, frames):
                # e.g. two last chunks of one length (only (1, T) is captured for them): a
                # graph replay each costs the host far less than one eager decode of both
                batches = [
                    part
                    for b in batches
                    for part in ([b] if graphs.has(len(b), frames) else [[i] for i in b])
                ]
            for members in batches:
                try:
                    pcm, finite, event = self._launch_batch([windows[i] for i in members])
                    pending.add_batch(members, pcm, finite, event)
                except Exception:
                    for i in members:
                        pending.set_done(i, self._decode_one(windows[i]))
        return pending

    def _decode_one(self, window: ChunkWindow) -> DecodedChunk:
        try:
            pcm, finite, event = self._launch_batch([window])
            if event is not None:
                event.synchronize()
            return _to_chunk(window, pcm.numpy()[0], bool(finite[0]), self.hop)
        except Exception as exc:
            return DecodedChunk(window, b"", f"codec decode failed: {type(exc).__name__}: {exc}")

    def _launch_batch(self, batch: list[ChunkWindow]):
        """(PCM16 `[B, samples]` and finite flags `[B]` in host memory, the event after which
        they are valid; None on the CPU, where they are valid at once)."""
        on_stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with on_stream:
            codes = torch.from_numpy(np.stack([w.codes for w in batch]))
            codes = codes.pin_memory().to(self.device, non_blocking=True) if self.stream else codes
            audio = self.graphs.run(codes) if self.graphs is not None else None
            if audio is None:
                audio = self.decoder(codes)
            audio = audio[:, 0].float()  # [B, frames * hop]
            self.num_batches += 1
            finite = torch.isfinite(audio).all(dim=1)
            pcm = (audio.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
            if self.stream is None:
                return pcm, finite, None
            pcm_host = torch.empty(pcm.shape, dtype=torch.int16, pin_memory=True)
            finite_host = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
            pcm_host.copy_(pcm, non_blocking=True)
            finite_host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
            return pcm_host, finite_host, event
