"""The capture query bound (capture-bound.md) and graph replay against eager execution."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.cuda_graphs import DEFAULT_BUCKETS, capture_query_bound
from tests.engine.test_parity import make_reference


def test_unconstrained_capture_uses_the_bucket_token_count():
    for bucket in DEFAULT_BUCKETS:
        assert capture_query_bound(bucket, decode_only=False) == bucket


def test_decode_only_capture_keeps_one_and_explicit_bounds_are_kept():
    for bucket in DEFAULT_BUCKETS:
        assert capture_query_bound(bucket, decode_only=True) == 1
        assert capture_query_bound(bucket, decode_only=False, explicit=7) == 7
        assert capture_query_bound(bucket, decode_only=True, explicit=3) == 3


def _engines(ckpt, **kw):
    base = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=256,
                num_kv_blocks=1024, max_model_len=2048, **kw)
    return (Engine.from_pretrained(ckpt, EngineConfig(cuda_graphs=True, **base)),
            Engine.from_pretrained(ckpt, EngineConfig(cuda_graphs=False, **base)))


def _run_all(engine, reqs):
    for rid, text, ref, params in reqs:
        engine.add_request(rid, text, reference=ref, params=params, audio=False)
    rows = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                rows[out.request_id] = out.rows
    return rows


@pytest.mark.cuda
def test_graph_replay_matches_eager_rows_under_fixed_seeds(tiny_ckpt):
    graphed, eager = _engines(tiny_ckpt)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    reqs = [(f"r{i}", f"request number {i}", make_reference(i, 40 + 7 * i, "ref") if i % 2 else None,
             SamplingParams(seed=i, max_rows=30 + i)) for i in range(12)]
    assert _run_all(graphed, reqs) == _run_all(eager, reqs)
    report = graphed.capture_reports[0]
    assert report.num_graphs > 0 and report.seconds > 0
