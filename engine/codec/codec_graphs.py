"""CUDA graphs of the codec decoder for the shapes streaming produces: (b, 8) first chunks
and (b, 33) steady windows for a ladder of batch sizes up to the maximum (every size, or
with autotuning a coarser one: a batch between two rungs replays the larger one, padded
with spare rows; ChunkDecoder splits batches above the maximum), and (1, 1..33) tails.
Never padded in time (the decoder is not causal: padding would change the audio); padding
in batch is safe, as each window's rows are convolved alone. Captured once at start-up;
any other shape runs eagerly."""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_left

import torch

from engine.codec.decoder import CodecDecoder
from engine.cuda_graphs import CaptureReport, capture_graph, measured_capture


def batch_ladder(max_batch: int) -> list[int]:
    """The coarse ladder of batch sizes, for autotuned graphs: each one to 8, then every
    2nd to 16, every 4th to 32, every 8th to 64 (the step doubles with each doubling), and
    `max_batch`. An autotuned graph costs start-up time (a cuDNN timing of every convolution:
    64 sizes took over 150 s on the H200, these 20 about 64 s); a padded rung is at most a
    quarter larger and costs a step about 1.5% with the fp32 codec (served, C = 128-256),
    so without autotuning every size gets its graph."""
    sizes = [b for b in range(1, max_batch + 1) if b % (1 << max(0, (b - 1).bit_length() - 3)) == 0]
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


_tuning = threading.Lock()
_tuners = 0  # captures inside cudnn_autotuned(True) now, in any thread
_flag_before = False  # cuDNN's benchmark flag before the first of them


@contextlib.contextmanager
def cudnn_autotuned(on: bool):
    """cuDNN's benchmark mode for the calls inside: the warm-up calls before each capture
    time the heuristic's leading candidates (`cudnn.benchmark_limit` of them) for their
    shape, and the capture keeps the fastest. Only the benchmark flag changes (cuDNN's own
    `flags()` would also reset the limit and the fp32 precision). The flag is process-wide
    and engines of one process capture in threads of their own at once: it is set by the
    first capture that wants it and put back by the last to leave, so none is left untimed
    by another's exit, nor the process timing for ever."""
    global _tuners, _flag_before
    if not on:
        yield
        return
    cudnn = torch.backends.cudnn
    with _tuning:
        if _tuners == 0:
            _flag_before = cudnn.benchmark
            cudnn.benchmark = True
        _tuners += 1
    try:
        yield
    finally:
        with _tuning:
            _tuners -= 1
            if _tuners == 0:
                cudnn.benchmark = _flag_before


class CodecGraphs:
    def __init__(
        self,
        decoder: CodecDecoder,
        max_batch: int,
        first_frames: int = 8,
        window_frames: int = 33,
        max_tail: int = 33,
        ladder: list[int] | None = None,
    ):
        """`ladder`: the batch sizes captured (ascending, ending at `max_batch`); every size
        by default."""
        self.decoder = decoder
        self.max_batch = max_batch  # larger batches are decoded in slices of this size
        self.ladder = ladder or list(range(1, max_batch + 1))
        assert self.ladder[-1] == max_batch and self.ladder == sorted(set(self.ladder))
        self.batched_frames = {first_frames, window_frames}
        self.window_shapes = {(b, t) for b in self.ladder for t in self.batched_frames}
        self.tail_shapes = {(1, t) for t in range(1, max_tail + 1)} - self.window_shapes
        self.graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self.report: CaptureReport | None = None

    def graph_shape(self, batch: int, frames: int) -> tuple[int, int] | None:
        """The captured shape that `(batch, frames)` windows replay (its batch may be
        larger: the spare rows are padding), or None when they run eagerly."""
        if frames in self.batched_frames and batch <= self.max_batch:
            return self.ladder[bisect_left(self.ladder, batch)], frames
        return (batch, frames) if (batch, frames) in self.tail_shapes else None

    def has(self, batch: int, frames: int) -> bool:
        """Whether `(batch, frames)` windows replay a graph (captured or to be captured)."""
        return self.graph_shape(batch, frames) is not None

    @torch.inference_mode()
    def capture(
        self, autotune: bool = False, stream: torch.cuda.Stream | None = None
    ) -> CaptureReport:
        """Every graph (the batched shapes largest first, then the tails), captured on
        `stream`: the stream they replay on (ChunkDecoder's), never the backbone's capture
        stream, whose cuBLAS workspace the codec's products would otherwise share while both
        run (see `capture_graph`).
        `autotune`: cuDNN times its algorithms for the batched shapes (not the tails: rare,
        small, and 33 more timings at start-up)."""
        device = self.decoder.codebooks.device
        pool = torch.cuda.graph_pool_handle()
        by_size = lambda shapes: sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)  # noqa: E731
        with measured_capture("codec") as report:
            with cudnn_autotuned(autotune):
                for shape in by_size(self.window_shapes):
                    self._capture(shape, device, pool, stream)
            for shape in by_size(self.tail_shapes):
                self._capture(shape, device, pool, stream)
            report.num_graphs, report.shapes = len(self.graphs), list(self.graphs)
        self.report = report
        return report

    def _capture(self, shape: tuple[int, int], device: torch.device, pool, stream) -> None:
        b, t = shape
        codes = torch.zeros(b, 8, t, dtype=torch.long, device=device)
        graph, audio = capture_graph(lambda: self.decoder(codes), pool, stream)
        self.graphs[shape] = (graph, codes, audio)

    def run(self, codes: torch.Tensor) -> torch.Tensor | None:
        """Replays the graph for this shape (`[B, 8, T]`); None when there is none. The
        result is a view of the graph's static output: read it before the next replay.
        Padding rows keep whatever codes they last held (valid codes, never read back)."""
        batch = codes.shape[0]
        entry = self.graphs.get(self.graph_shape(batch, codes.shape[2]))
        if entry is None:
            return None
        graph, inp, out = entry
        inp[:batch].copy_(codes, non_blocking=True)
        graph.replay()
        return out[:batch]
