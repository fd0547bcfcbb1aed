"""Engine API behaviour on the CPU: events, abort, seeded batch independence, length cap."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError, Engine, EngineConfig, SamplingParams, VoiceReference
from engine.config import EOC
from tests.engine.test_parity import make_reference


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine.from_pretrained(
        tiny_ckpt, EngineConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    )


def test_events_stream_one_row_per_step_then_finish(engine):
    engine.add_request("ev", "Events please.", params=SamplingParams(seed=1, max_rows=5))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert [len(e.new_rows) for e in events] == [1] * 5
    assert [e.finished for e in events] == [False] * 4 + [True]
    assert events[-1].finish_reason == "length"
    assert events[-1].rows == [e.new_rows[0] for e in events]


def test_without_row_events_a_step_reports_only_finishes_with_the_same_rows(tiny_ckpt, engine):
    """row_events=False (the service's setting): no event per generated row, the finishing
    event still carries every row, identical to the same seeded request with row events."""
    quiet = Engine.from_pretrained(
        tiny_ckpt,
        EngineConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=64, row_events=False),
    )
    results = {}
    for name, eng in (("rows", engine), ("quiet", quiet)):
        eng.add_request(name, "Quiet steps.", params=SamplingParams(seed=9, max_rows=6))
        events = []
        while eng.has_unfinished():
            events += eng.step()
        results[name] = events
    assert len(results["rows"]) == 6
    (last,) = results["quiet"]
    assert last.finished and last.finish_reason == "length" and len(last.rows) == 6
    assert last.rows == results["rows"][-1].rows


def test_step_time_is_split_into_phases(engine):
    """stats.phase_seconds_total (engine.STEP_PHASES) accounts for the host time in step():
    every phase counted, none negative, together about the step time itself."""
    from engine import STEP_PHASES

    before = engine.stats
    engine.add_request("ph", "Phases.", params=SamplingParams(seed=4, max_rows=12))
    while engine.has_unfinished():
        engine.step()
    after = engine.stats
    totals = zip(before.phase_seconds_total, after.phase_seconds_total, strict=True)
    grown = [b - a for a, b in totals]
    assert len(grown) == len(STEP_PHASES) == 5
    assert all(g >= 0 for g in grown)
    named = dict(zip(STEP_PHASES, grown, strict=True))
    assert named["schedule"] > 0 and named["launch"] > 0 and named["rows"] > 0
    in_steps = after.step_seconds_total - before.step_seconds_total
    assert 0.5 * in_steps <= sum(grown) <= in_steps


def test_abort_frees_blocks_and_slot(engine):
    free_before = engine.stats.num_free_kv_blocks
    engine.add_request("ab", "Abort me soon.", params=SamplingParams(seed=1, max_rows=100))
    engine.step()
    engine.step()
    assert engine.stats.num_free_kv_blocks < free_before
    assert engine.abort("ab") is True
    assert engine.abort("ab") is False
    assert not engine.has_unfinished()
    assert engine.stats.num_free_kv_blocks == free_before
    assert engine.step() == []


def test_rejects_bad_requests(engine):
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request("x", "   ")
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplingParams.from_dict({"repetition_penalty": 1.1})
    engine.add_request("dup", "once", params=SamplingParams(max_rows=1))
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request("dup", "twice")
    engine.abort("dup")
    assert not engine.has_unfinished()


def _mixed_batch(n: int):
    reqs = []
    for i in range(n):
        ref = make_reference(100 + i, 5 + 3 * i, "ref" if i % 2 else None) if i % 3 else None
        params = SamplingParams(
            temperature=0.7 + 0.05 * i,
            top_k=[0, 5, 50][i % 3],
            top_p=[1.0, 0.9, 0.5][i % 3],
            seed=1000 + i,
            max_rows=6 + i,
        )
        reqs.append((f"m{i}", f"mixed request number {i}" * (1 + i % 3), ref, params))
    return reqs


def test_seeded_rows_identical_alone_and_in_batch_of_16(tiny_ckpt):
    target = (
        "target",
        "The same seed, alone or not.",
        make_reference(5, 17, "voice"),
        SamplingParams(seed=424242, max_rows=24),
    )
    alone = Engine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4))
    [solo] = alone.generate([target[1]], references=[target[2]], params=target[3])

    batch = Engine.from_pretrained(
        tiny_ckpt, EngineConfig(block_size=8, max_num_seqs=16, max_num_batched_tokens=40)
    )
    reqs = _mixed_batch(15)
    reqs.insert(7, target)
    results = batch.generate(
        [r[1] for r in reqs], references=[r[2] for r in reqs], params=[r[3] for r in reqs]
    )
    assert results[7].rows == solo.rows
    assert len({tuple(r.rows[0]) for r in results}) > 8  # the batch really was mixed


def _staggered(tiny_ckpt, admission_wait_steps: int) -> tuple[dict, dict]:
    """One request every other step for 12 steps beside the earlier ones: each request's rows
    and the step of its first row."""
    overrides = {"admission_wait_steps": admission_wait_steps}
    config = EngineConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, plan_overrides=overrides
    )
    engine = Engine.from_pretrained(tiny_ckpt, config)
    rows, first, step = {}, {}, 0
    while step < 12 or engine.has_unfinished():
        if step < 12 and step % 2 == 0:
            params = SamplingParams(seed=step, max_rows=20)
            engine.add_request(f"r{step}", f"Request {step} arrives.", params=params)
        for event in engine.step():
            if event.new_rows:
                first.setdefault(event.request_id, step)
            if event.finished:
                rows[event.request_id] = event.rows
        step += 1
    return rows, first


def test_admission_wait_moves_when_prompts_run_not_the_rows(tiny_ckpt):
    """Prompts held for company (the plan's admission_wait_steps) start up to that many steps
    later, with the same seeded rows."""
    rows, first = _staggered(tiny_ckpt, 0)
    held_rows, held_first = _staggered(tiny_ckpt, 3)
    assert held_rows == rows and len(rows) == 6
    delays = [held_first[rid] - first[rid] for rid in first]
    assert all(0 <= d <= 3 for d in delays) and max(delays) > 0


def test_length_cap_is_2048_rows(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=1))
    [result] = engine.generate(["cap me"], params=SamplingParams(temperature=0))
    assert result.finish_reason == "length"
    assert len(result.rows) == 2048
    assert all(row[0] != EOC for row in result.rows)
    frames = len(result.rows) - 7 - 1  # undo the delay, drop the last frame
    assert frames / 25 == pytest.approx(81.6)


def test_default_model_is_used_without_a_path(tmp_path):
    engine = Engine.from_pretrained(None, EngineConfig(max_num_seqs=2), cache_dir=tmp_path)
    assert engine.is_default_model
    [r] = engine.generate(["hi"], params=SamplingParams(seed=0, max_rows=3))
    assert len(r.rows) == 3


def test_voice_reference_type_checked():
    with pytest.raises(ConfigError):
        VoiceReference(((1, 2, 3),), "bad width")


def test_a_float8_kv_cache_serves_requests_end_to_end(tiny_ckpt):
    """`kv_cache_dtype="fp8"` on the CPU (torch reference attention): float8 caches, the
    activations stay in the model's dtype, and every request runs to its row cap; the
    Triton kernels' float8 path runs in the CUDA tests."""
    config = EngineConfig(block_size=4, max_num_seqs=4, kv_cache_dtype="fp8")
    engine = Engine.from_pretrained(tiny_ckpt, config)
    assert all(c.dtype == torch.float8_e4m3fn for c in engine.runner.kv_caches)
    params = [SamplingParams(seed=i, max_rows=12 + i) for i in range(3)]
    results = engine.generate([f"float8 {i}" for i in range(3)], params=params)
    assert [len(r.rows) for r in results] == [12, 13, 14]
    assert engine.runner.kv_caches[0][:, 1:].float().abs().sum() > 0


def test_pdl_resolves_off_without_a_hopper_gpu_and_refuses_to_be_forced():
    from engine.config import ConfigError
    from engine.plan import resolve_pdl

    cpu = torch.device("cpu")
    assert resolve_pdl(None, False, cpu) is False and resolve_pdl(False, True, cpu) is False
    with pytest.raises(ConfigError, match="compute capability 9.0"):
        resolve_pdl(True, True, cpu)


def test_skinny_tma_resolves_off_where_it_cannot_apply_and_refuses_to_be_forced():
    """`few_row_gemm_tma`: None -> off without a Hopper GPU (here the CPU) or with projection
    rows that are not whole 16-byte units; True there is a configuration error."""
    from engine.config import ConfigError, ModelConfig
    from engine.plan import resolve_tma
    from kernels.skinny_gemm import tma_supported

    cfg = ModelConfig(
        hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=100, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=64,
    )  # fmt: skip
    cpu = torch.device("cpu")
    assert resolve_tma(None, cfg, 4, cpu) is False
    assert resolve_tma(False, cfg, 4, cpu) is False
    with pytest.raises(ConfigError, match="compute capability 9.0"):
        resolve_tma(True, cfg, 4, cpu)
    assert not tma_supported(cpu, 4, 64)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert tma_supported("cuda", 2, 2560, 4096) and not tma_supported("cuda", 2, 2562)
