"""FULL CUDA graphs of the forward pass (embedding + backbone) over token buckets, captured
once before serving; a step whose token count fits a bucket replays it, any other shape runs
eagerly. Serving never captures.

The safe capture bound (capture-bound.md): the attention kernel's launch is sized from
`max_query_len`, which a graph freezes. A graph captured without an explicit bound therefore
uses the bucket's token count (one request may own every token of the bucket); decode-only
graphs keep 1; an explicit bound is kept. Runtime metadata (query_start_loc, seq_lens,
block tables) is what replays read. The rule is always on: correctness never depends on a
performance flag.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger("clonecast.graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


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
        self.report = CaptureReport("backbone")

    def lookup(self, num_tokens: int, decode_only: bool) -> CapturedGraph | None:
        """The smallest captured bucket that holds the step; None means run eagerly."""
        family = self.decode if decode_only else self.mixed
        for bucket in self.buckets:
            if bucket >= num_tokens and bucket in family:
                return family[bucket]
        return self.lookup(num_tokens, False) if decode_only else None

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        torch.cuda.synchronize()
        start = time.perf_counter()
        alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        for bucket in sorted(self.buckets, reverse=True):  # large first: small ones reuse memory
            bound = capture_query_bound(bucket, False, self.query_bound)
            self.mixed[bucket] = self._capture_one(bucket, bound, self._spread(bucket))
        for bucket in sorted(self.decode_buckets, reverse=True):
            self.decode[bucket] = self._capture_one(
                bucket, capture_query_bound(bucket, True), [1] * bucket
            )
        torch.cuda.synchronize()
        r = self.report
        r.num_graphs = len(self.mixed) + len(self.decode)
        r.seconds = time.perf_counter() - start
        r.allocated_bytes = torch.cuda.memory_allocated() - alloc0
        r.reserved_bytes = torch.cuda.memory_reserved() - reserved0
        r.shapes = [("mixed", b) for b in self.mixed] + [("decode", b) for b in self.decode]
        log.info(
            "captured %d backbone graphs in %.2f s (+%.1f MiB allocated, +%.1f MiB reserved)",
            r.num_graphs,
            r.seconds,
            r.allocated_bytes / 2**20,
            r.reserved_bytes / 2**20,
        )
        return r

    def _spread(self, bucket: int) -> list[int]:
        """The dummy batch: the bucket's tokens spread evenly over as many sequences as fit."""
        seqs = min(bucket, self.runner.config.max_num_seqs)
        return [bucket // seqs + (1 if i < bucket % seqs else 0) for i in range(seqs)]

    def _capture_one(self, bucket: int, bound: int, q_lens: list[int]) -> CapturedGraph:
        runner = self.runner
        num_seqs = min(bucket, runner.config.max_num_seqs)  # a step has at most one per token
        runner.load_dummy_batch(q_lens, padded_tokens=bucket, padded_seqs=num_seqs)
        max_len = runner.config.max_model_len
        for _ in range(2):  # compile kernels and settle the allocator outside the capture
            runner.forward(bucket, num_seqs, bound, max_len)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = runner.forward(bucket, num_seqs, bound, max_len)
        return CapturedGraph(graph, bucket, num_seqs, bound, hidden)
