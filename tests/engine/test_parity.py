"""Backbone and greedy parity on the CPU in fp32 against transformers' Qwen3Model."""

from __future__ import annotations

import os
import random

import pytest

from engine import Engine, EngineConfig, SamplingParams, VoiceReference
from tests.engine.parity import HiddenRecorder, check_all_chunks
from tests.engine.reference import ReferenceModel, greedy_reference

TOL = 1e-4


def _skip_unless_interpreted(backend: str) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for the GPU here; the CUDA tests cover this backend")


def make_reference(seed: int, frames: int, text: str | None = "a reference") -> VoiceReference:
    rng = random.Random(seed)
    return VoiceReference(
        tuple(tuple(rng.randrange(1024) for _ in range(8)) for _ in range(frames)), text
    )


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return ReferenceModel(tiny_ckpt)


def run(engine, requests):
    """Adds (rid, text, ref, params) requests, runs to completion; returns prompts and rows."""
    prompts, rows = {}, {}
    for rid, text, ref, params in requests:
        engine.add_request(rid, text, reference=ref, params=params)
        prompts[rid] = engine.scheduler.requests[rid].prompt
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                rows[out.request_id] = out.rows
    return prompts, rows


def test_single_prefill_and_decode(tiny_ckpt, reference):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, max_num_seqs=4))
    rec = HiddenRecorder(engine)
    prompts, rows = run(
        engine, [("a", "Hello there, friend.", None, SamplingParams(seed=3, max_rows=12))]
    )
    worst_h, worst_l, checked = check_all_chunks(engine, rec, reference, prompts, rows, TOL)
    assert checked == 12  # one prefill step + 11 decode steps
    assert rec.steps[0][0] == [("a", 0, len(prompts["a"]))]


def test_prefill_split_over_steps(tiny_ckpt, reference):
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=7)
    engine = Engine.from_pretrained(tiny_ckpt, cfg)
    rec = HiddenRecorder(engine)
    ref = make_reference(1, 20)
    prompts, rows = run(
        engine, [("a", "Split me into chunks.", ref, SamplingParams(seed=5, max_rows=6))]
    )
    first_chunks = [chunks[0] for chunks, _ in rec.steps]
    assert sum(1 for _, start, n in first_chunks if n == 7) >= 5  # the prompt took several steps
    check_all_chunks(engine, rec, reference, prompts, rows, TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_prefill_and_decode_batch(tiny_ckpt, reference, backend):
    _skip_unless_interpreted(backend)
    cfg = EngineConfig(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        plan_overrides={"attention_backend": backend},
    )
    engine = Engine.from_pretrained(tiny_ckpt, cfg)
    rec = HiddenRecorder(engine)
    reqs = [
        ("p0", "short", None, SamplingParams(seed=1, max_rows=10)),
        ("c1", "a clone request", make_reference(2, 13), SamplingParams(seed=2, max_rows=9)),
        (
            "p2",
            "another plain request that is longer",
            None,
            SamplingParams(temperature=0, max_rows=8),
        ),
        (
            "c3",
            "clone without transcript",
            make_reference(3, 9, None),
            SamplingParams(seed=4, max_rows=7),
        ),
    ]
    prompts, rows = run(engine, reqs)
    mixed = [
        c
        for c, _ in rec.steps
        if len(c) > 1 and any(n > 1 for _, _, n in c) and any(n == 1 for _, _, n in c)
    ]
    assert mixed, "no step mixed prefill chunks with decode rows"
    check_all_chunks(engine, rec, reference, prompts, rows, TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefix_cache_hit(tiny_ckpt, reference, backend):
    _skip_unless_interpreted(backend)
    cfg = EngineConfig(block_size=4, max_num_seqs=4, plan_overrides={"attention_backend": backend})
    engine = Engine.from_pretrained(tiny_ckpt, cfg)
    rec = HiddenRecorder(engine)
    voice = make_reference(9, 30, "the same transcript")
    prompts, rows = run(engine, [("first", "One text.", voice, SamplingParams(seed=1, max_rows=4))])
    computed = engine.stats.num_prefill_tokens_computed
    p2, r2 = run(
        engine, [("second", "A different text.", voice, SamplingParams(seed=2, max_rows=4))]
    )
    prompts.update(p2)
    rows.update(r2)
    second_computed = engine.stats.num_prefill_tokens_computed - computed
    cached = engine.stats.num_prefix_cached_tokens
    assert cached >= prompts["second"].prefix_len - 4  # all full blocks of the shared prefix
    assert second_computed == len(prompts["second"]) - cached < computed
    hit_chunk = next(c for chunks, _ in rec.steps for c in chunks if c[0] == "second")
    assert hit_chunk[1] == cached  # the first chunk started after the cached prefix
    check_all_chunks(engine, rec, reference, prompts, rows, TOL)


@pytest.mark.parametrize(
    "text, ref",
    [
        ("Greedy plain text.", None),
        ("Greedy clone.", make_reference(11, 12, "ref words")),
        ("Clone, no transcript", make_reference(12, 5, None)),
    ],
)
def test_greedy_matches_full_recompute_loop(tiny_ckpt, reference, text, ref):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(block_size=8))
    [result] = engine.generate(
        [text], references=[ref], params=SamplingParams(temperature=0, max_rows=20)
    )
    prompt_ids, prompt_rows = _prompt_of(engine, text, ref)
    expected = greedy_reference(reference, prompt_ids, prompt_rows, max_rows=20)
    assert result.rows == expected


def _prompt_of(engine, text, ref):
    from engine.prompt import build_prompt

    p = build_prompt(engine.tokenizer, engine.tokenizer.special, text, ref)
    return list(p.token_ids), list(p.audio_rows)
