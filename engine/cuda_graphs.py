"""FULL CUDA graphs of the forward pass (embedding + backbone) over token buckets, captured
once before serving; a step whose token count fits a bucket replays it, any other shape runs
eagerly. Serving never captures.

The safe capture bound (docs/graphs.md): the attention kernel's launch is sized from
`max_query_len`, which a graph freezes. A graph captured without an explicit bound therefore
uses the bucket's token count (one request may own every token of the bucket); decode-only
graphs keep 1; an explicit bound is kept. Runtime metadata (query_start_loc, seq_lens,
block tables) is what replays read. The rule is always on: correctness never depends on a
performance flag.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.plan import DEFAULT_BUCKETS
from engine.stats import GRAPH_FAMILIES

log = logging.getLogger("clonecast.graphs")


def capture_query_bound(num_tokens: int, decode_only: bool, explicit: int | None = None) -> int:
    """The `max_query_len` a graph of `num_tokens` tokens is captured with."""
    if explicit is not None:
        return explicit
    if decode_only:
        return 1
    return num_tokens


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    num_tokens: int
    num_seqs: int  # launch size of the attention (sequences beyond the real ones are empty)
    max_query_len: int
    hidden: torch.Tensor  # static output [num_tokens, H]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.hidden


@dataclass
class CaptureReport:
    family: str
    num_graphs: int = 0
    seconds: float = 0.0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    shapes: list = field(default_factory=list)


@contextlib.contextmanager
def measured_capture(family: str) -> Iterator[CaptureReport]:
    """Times a capture and measures its allocated/reserved memory deltas into a report (the
    caller fills `num_graphs` and `shapes`); logs it at the end."""
    assert family in GRAPH_FAMILIES, family  # the metrics show each family from the start
    report = CaptureReport(family)
    torch.cuda.synchronize()
    start = time.perf_counter()
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    yield report
    torch.cuda.synchronize()
    report.seconds = time.perf_counter() - start
    report.allocated_bytes = torch.cuda.memory_allocated() - alloc0
    report.reserved_bytes = torch.cuda.memory_reserved() - reserved0
    log.info(
        "captured %d %s graphs in %.2f s (+%.1f MiB allocated, +%.1f MiB reserved)",
        report.num_graphs,
        family,
        report.seconds,
        report.allocated_bytes / 2**20,
        report.reserved_bytes / 2**20,
    )


def capture_graph(fn, pool=None, stream=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn()` captured as a CUDA graph: two eager calls first (compile kernels, settle the
    allocator outside the capture), then the capture, on `stream` (default: torch's one
    capture stream). Returns the graph and `fn`'s static output, which every replay
    overwrites.

    Graphs that may replay at the same time on different streams are captured on different
    streams: torch keys the cuBLAS / cuBLASLt workspace by (handle, stream) and bakes its
    address into each captured GEMM, so graphs captured on one stream share one workspace
    (pytorch/pytorch#193402), and two replaying at once may overwrite each other's scratch
    (split-K partial sums, flags). That race was the fp8 engine's fault under served load:
    on the H200, 92 of 200 codec replays beside fp8 projections came out wrong with one
    capture stream, none with two (benchmarks/workspace_race_probe.py)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


class CudaGraphs:
    """Decode-only graphs for buckets up to max_num_seqs, mixed graphs for every bucket."""

    def __init__(self, runner, buckets=DEFAULT_BUCKETS, query_bound: int | None = None):
        self.runner = runner
        limit = runner.config.max_num_batched_tokens
        self.buckets = tuple(b for b in buckets if b <= limit)
        self.decode_buckets = tuple(b for b in self.buckets if b <= runner.config.max_num_seqs)
        self.query_bound = query_bound  # None: the safe rule; tests pass a naive bound
        self.decode: dict[int, CapturedGraph] = {}
        self.mixed: dict[int, CapturedGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.report: CaptureReport | None = None

    def lookup(self, num_tokens: int, decode_only: bool) -> CapturedGraph | None:
        """The smallest captured bucket that holds the step; None means run eagerly."""
        family = self.decode if decode_only else self.mixed
        for bucket in self.buckets:
            if bucket >= num_tokens and bucket in family:
                return family[bucket]
        return self.lookup(num_tokens, False) if decode_only else None

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        with measured_capture("backbone") as report:
            for bucket in sorted(self.buckets, reverse=True):  # large first: small ones reuse
                bound = capture_query_bound(bucket, False, self.query_bound)
                self.mixed[bucket] = self._capture_one(bucket, bound, self._spread(bucket))
            for bucket in sorted(self.decode_buckets, reverse=True):
                bound = capture_query_bound(bucket, True)
                self.decode[bucket] = self._capture_one(bucket, bound, [1] * bucket)
            report.num_graphs = len(self.mixed) + len(self.decode)
            report.shapes = [("mixed", b) for b in self.mixed] + [
                ("decode", b) for b in self.decode
            ]
        self.report = report
        return report

    def _spread(self, bucket: int) -> list[int]:
        """The dummy batch: the bucket's tokens spread evenly over as many sequences as fit."""
        seqs = min(bucket, self.runner.config.max_num_seqs)
        return [bucket // seqs + (1 if i < bucket % seqs else 0) for i in range(seqs)]

    def _capture_one(self, bucket: int, bound: int, q_lens: list[int]) -> CapturedGraph:
        runner = self.runner
        num_seqs = min(bucket, runner.config.max_num_seqs)  # a step has at most one per token
        runner.load_dummy_batch(q_lens, padded_tokens=bucket, padded_seqs=num_seqs)
        max_len = runner.config.max_model_len
        graph, hidden = capture_graph(
            lambda: runner.forward(bucket, num_seqs, bound, max_len), self.pool
        )
        return CapturedGraph(graph, bucket, num_seqs, bound, hidden)


@dataclass
class CapturedSampler:
    graph: torch.cuda.CUDAGraph
    rows: int
    packed: torch.Tensor  # static output [rows, 9]: 8 codes and the done flag

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.packed


class SamplerGraphs:
    """One graph per sampler row bucket: audio head, masks, sampling and the state update.
    Captured with every row pointing at the runner's padding slot, so capture changes no
    live state; replays read the runtime sample slots and hidden rows."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, CapturedSampler] = {}
        self.report: CaptureReport | None = None

    def get(self, rows: int) -> CapturedSampler | None:
        return self.graphs.get(rows)

    @torch.inference_mode()
    def capture(self, pool=None) -> CaptureReport:
        runner = self.runner
        with measured_capture("sampler") as report:
            for rows in sorted(runner.sample_buckets, reverse=True):
                runner.load_dummy_samples(rows)
                graph, packed = capture_graph(lambda rows=rows: runner.sample(rows), pool)
                self.graphs[rows] = CapturedSampler(graph, rows, packed)
            runner.delay.reset(runner.pad_slot)
            report.num_graphs, report.shapes = len(self.graphs), list(self.graphs)
        self.report = report
        return report
