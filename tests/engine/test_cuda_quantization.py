"""On an NVIDIA GPU: FP8 weights (`quantization="fp8"`). Every graph replay equals its eager
twin, graphs give the eager rows, a warmed decode step makes no host sync, and on the
full-size random checkpoint the error against fp32 is measured (printed) and bounded. (The
tiny model against the fake-quantized transformers reference runs on the CPU, through the
GPU kernels too, in tests/engine/test_quantization.py: in bf16 here, bf16 rounding moves
enough elements across e4m3 rounding boundaries to hide a wiring error.)"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.quantization import Fp8Linear, Fp8Ops
from kernels.skinny_gemm import TILE_ROWS
from tests.engine.test_cuda_parity import _factory, _scenarios, full_ckpt  # noqa: F401
from tests.engine.test_parity import make_reference

pytestmark = pytest.mark.cuda
FP8_TOL = 0.25  # measured 2026-12-02 on the full-size random checkpoint: docs/PERFORMANCE.md


def _engine(ckpt, **kw) -> Engine:
    base = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=32,
        max_num_batched_tokens=128,
        num_kv_blocks=1024,
        max_model_len=2048,
        quantization="fp8",
    )
    return Engine.from_pretrained(ckpt, EngineConfig(**{**base, **kw}))


@pytest.mark.parametrize("few_rows, pow2_rows", [(64, None), (64, True), (512, None)])
def test_every_fp8_replay_equals_its_eager_twin(tiny_ckpt, few_rows, pow2_rows):
    """Decode graphs of few rows (the fp8 weight in our GEMM) and of many (the quantizing
    norm and SiLU kernels and torch._scaled_mm, over the step's own rows by default or a
    power of two), and mixed graphs: each replay is checked against the eager forward over the
    same inputs, bit for bit. Our GEMM takes steps of up to 64 tokens (128 by default, this
    engine's whole token budget), so the larger mixed graphs take the other path; or of up to
    512, with a budget of 384 tokens: steps of more than 128 in its blocks of 128 rows."""
    overrides = {"few_row_fp8_rows": few_rows}
    overrides |= {} if pow2_rows is None else {"fp8_pow2_rows": pow2_rows}
    budget = {"max_num_batched_tokens": 384} if few_rows > 128 else {}
    engine = _engine(tiny_ckpt, plan_overrides=overrides, **budget)
    assert isinstance(engine.model.ops, Fp8Ops) and engine.model.ops.fused
    assert engine.plan.fp8_pow2_rows is engine.model.ops.pow2_rows is (pow2_rows is True)
    assert engine.model.ops.max_rows == few_rows
    runner = engine.runner
    checked = {"decode": 0, "mixed": 0, "large": 0}
    original = runner.graphs.lookup

    def lookup(num_tokens, decode_only):
        graph = original(num_tokens, decode_only)
        if graph is None:
            return graph
        replay = graph.replay

        def checked_replay():
            out = replay().clone()
            runner._copy_inputs()  # rewrite the same K/V, then the eager twin
            twin = runner.forward(
                graph.num_tokens, graph.num_seqs, graph.max_query_len, runner.config.max_model_len
            )
            assert torch.equal(out[:num_tokens], twin[:num_tokens])
            checked["decode" if graph.max_query_len == 1 else "mixed"] += 1
            # past our GEMM (torch._scaled_mm), or past its one tile (blocks of rows)
            checked["large"] += graph.num_tokens > min(engine.model.ops.max_rows, TILE_ROWS)
            return out

        graph = type(graph)(
            graph.graph, graph.num_tokens, graph.num_seqs, graph.max_query_len, graph.hidden
        )
        graph.replay = checked_replay
        return graph

    runner.graphs.lookup = lookup
    for i in range(24):
        ref = make_reference(i, 30 + 9 * i, "ref") if i % 2 else None
        params = SamplingParams(seed=i, max_rows=20 + i)
        engine.add_request(
            f"r{i}", f"request number {i}", reference=ref, params=params, audio=False
        )
    while engine.has_unfinished():
        engine.step()
    assert checked["decode"] > 5 and checked["mixed"] > 0 and checked["large"] > 0, checked


def test_fp8_graphs_give_the_eager_rows(tiny_ckpt):
    texts = [f"fp8 graphs {i}" for i in range(20)]
    params = [SamplingParams(seed=50 + i, max_rows=16 + 2 * i) for i in range(20)]
    rows = {}
    for eager in (False, True):
        engine = _engine(tiny_ckpt, enforce_eager=eager)
        rows[eager] = [r.rows for r in engine.generate(texts, params=params)]
    assert rows[True] == rows[False]


def test_a_warmed_fp8_decode_step_makes_no_implicit_host_sync(tiny_ckpt):
    engine = _engine(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256)
    for i in range(8):
        engine.add_request(
            f"s{i}", f"warm {i}", params=SamplingParams(seed=i, max_rows=60), audio=False
        )
    for _ in range(10):
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            outputs = engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outputs) == 8


def test_fp8_weights_parity_full_size_checkpoint(full_ckpt):  # noqa: F811
    """The fp8 model (bf16 activations) against the fp32 reference in the parity scenarios
    (single prefill + decode, split prefill, mixed batch, a prefix-cache hit)."""
    from tests.engine.reference import ReferenceModel

    reference = ReferenceModel(full_ckpt, dtype=torch.float32, device="cuda")
    factory = _factory(full_ckpt, 1024, quantization="fp8")
    engine = factory()
    assert isinstance(engine.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    del engine
    h, logits = _scenarios(factory, reference, ref_len=120, tol=FP8_TOL)
    print(f"full-size fp8 weights vs fp32: worst hidden rel err {h:.2e}, logits {logits:.2e}")
