"""CUDA graphs of the codec decoder for the exact shapes streaming produces: (b, 8) first
chunks and (b, 33) steady windows for every batch size up to the maximum (ChunkDecoder
splits larger batches), and (1, 1..33) tails. Never padded in time (the decoder is not
causal: padding would change the audio). Captured once at start-up; any other shape runs
eagerly."""

from __future__ import annotations

import torch

from engine.codec.decoder import CodecDecoder
from engine.cuda_graphs import CaptureReport, capture_graph, measured_capture


class CodecGraphs:
    def __init__(
        self,
        decoder: CodecDecoder,
        max_batch: int,
        first_frames: int = 8,
        window_frames: int = 33,
        max_tail: int = 33,
    ):
        self.decoder = decoder
        self.max_batch = max_batch  # larger batches are decoded in slices of this size
        shapes = {(b, t) for b in range(1, max_batch + 1) for t in (first_frames, window_frames)}
        shapes |= {(1, t) for t in range(1, max_tail + 1)}
        self.shapes = sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)  # large first
        self._shape_set = shapes
        self.graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self.report: CaptureReport | None = None

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        device = self.decoder.codebooks.device
        pool = torch.cuda.graph_pool_handle()
        with measured_capture("codec") as report:
            for b, t in self.shapes:
                codes = torch.zeros(b, 8, t, dtype=torch.long, device=device)
                graph, audio = capture_graph(lambda codes=codes: self.decoder(codes), pool)
                self.graphs[(b, t)] = (graph, codes, audio)
            report.num_graphs, report.shapes = len(self.graphs), list(self.graphs)
        self.report = report
        return report

    def has(self, batch: int, frames: int) -> bool:
        """Whether `(batch, frames)` windows replay a graph (captured or to be captured)."""
        return (batch, frames) in self._shape_set

    def run(self, codes: torch.Tensor) -> torch.Tensor | None:
        """Replays the graph of this exact shape (`[B, 8, T]`); None when there is none. The
        result is the graph's static output: read it before the next replay."""
        entry = self.graphs.get((codes.shape[0], codes.shape[2]))
        if entry is None:
            return None
        graph, inp, out = entry
        inp.copy_(codes, non_blocking=True)
        graph.replay()
        return out
