"""The execution plan resolved from a configuration on the CPU (the GPU's own resolution, PDL
and TMA against the compute capability, runs in the CUDA tests), and handed to the parts
that run it."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError, Engine, EngineConfig, ExecutionPlan
from engine.attention import TorchAttention, TritonAttention
from engine.loader import read_config
from engine.plan import DEFAULT_BUCKETS, resolve

CPU = torch.device("cpu")


def test_the_cpu_plan_is_the_plain_torch_path(tiny_ckpt):
    _, model_config = read_config(tiny_ckpt)
    plan = resolve(EngineConfig(), model_config, CPU)
    assert plan == ExecutionPlan()
    assert plan.attention_backend == "torch" and not plan.fused_ops and not plan.cuda_graphs
    assert plan.graph_buckets == DEFAULT_BUCKETS and plan.async_scheduling


def test_overrides_reach_the_plan_and_the_plan_follows_the_backend(tiny_ckpt):
    _, model_config = read_config(tiny_ckpt)
    overrides = {
        "attention_backend": "triton",
        "async_scheduling": False,
        "graph_buckets": (1, 8),
        "codec_dtype": "bfloat16",
    }
    plan = resolve(EngineConfig(plan_overrides=overrides), model_config, CPU)
    assert plan.attention_backend == "triton" and plan.page_prefetch  # a Triton setting
    assert not plan.fused_decode  # no fused ops on the CPU
    assert plan.async_scheduling is False and plan.graph_buckets == (1, 8)
    assert plan.codec_dtype == "bfloat16"
    assert not plan.cuda_graphs and not plan.sampler_graphs  # graphs need CUDA
    described = plan.describe()
    assert described["graph_buckets"] == [1, 8] and described["attention_backend"] == "triton"


def test_the_engine_builds_its_parts_from_its_plan(tiny_ckpt):
    overrides = {"attention_backend": "triton", "page_prefetch": False}
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(plan_overrides=overrides))
    backend = engine.model.layers[0].self_attn.backend
    assert isinstance(backend, TritonAttention) and backend.prefetch_pages is False
    assert engine.plan.page_prefetch is False and engine.runner.plan is engine.plan
    assert engine.runner.graphs is None and engine.runner.sampler_graphs is None
    plain = Engine.from_pretrained(tiny_ckpt, EngineConfig())
    assert isinstance(plain.model.layers[0].self_attn.backend, TorchAttention)
    assert plain.plan == ExecutionPlan()


def test_a_triton_setting_without_the_triton_backend_is_refused(tiny_ckpt):
    import pytest

    from engine import ConfigError

    _, model_config = read_config(tiny_ckpt)
    config = EngineConfig(plan_overrides={"page_prefetch": True})  # the CPU's backend: torch
    with pytest.raises(ConfigError, match="Triton attention backend"):
        resolve(config, model_config, CPU)


def test_codec_autotune_is_refused_where_no_codec_graphs_are_captured(tiny_ckpt):
    """It tunes while the codec graphs are captured: without CUDA graphs there is nothing to
    tune, which resolving the plan for a GPU (no GPU touched before the refusal) says."""
    _, model_config = read_config(tiny_ckpt)
    eager = EngineConfig(device="cuda", enforce_eager=True, plan_overrides={"codec_autotune": True})
    with pytest.raises(ConfigError, match="codec_autotune needs codec graphs"):
        resolve(eager, model_config, torch.device("cuda"))


def test_fp8_row_padding_is_a_cuda_setting(tiny_ckpt):
    """Padding torch._scaled_mm's rows to a power of two applies to CUDA fp8 weights only: on
    the CPU the plan leaves it off, and forcing it there is refused."""
    _, model_config = read_config(tiny_ckpt)
    plan = resolve(EngineConfig(quantization="fp8"), model_config, CPU)
    assert plan.fp8_pow2_rows is False
    with pytest.raises(ConfigError, match="fp8_pow2_rows is a setting of the CUDA fp8 matmul"):
        EngineConfig(plan_overrides={"fp8_pow2_rows": True})


@pytest.mark.parametrize(
    "overrides, eager, want",
    [
        ({}, False, ("float16", True)),  # served: the codec graphs are timed, fp16
        ({}, True, ("float32", False)),  # no codec graphs: nothing to time, fp32
        ({"codec_autotune": False}, False, ("float32", False)),  # fast start-up
        ({"codec_graph_max_batch": 0}, False, ("float32", False)),
        ({"codec_dtype": "bfloat16"}, False, ("bfloat16", True)),
        ({"codec_dtype": "float32"}, False, ("float32", False)),  # the fp32 of before
        ({"codec_dtype": "float32", "codec_autotune": True}, False, ("float32", True)),
    ],
)
def test_the_gpu_codec_is_fp16_only_where_its_algorithms_are_timed(
    tiny_ckpt, monkeypatch, overrides, eager, want
):
    """cuDNN's heuristic picks make fp16 codec graphs 6-10x slower than fp32 at some batch
    sizes, timed ones faster than fp32 at every size: the GPU's default codec is fp16 only
    together with autotuning, which needs codec graphs, and float32 asked for by name is
    untimed. Resolved for a GPU without touching one (the compute-capability probes are
    stood in for)."""
    import engine.plan as plan_module

    monkeypatch.setattr(plan_module, "resolve_pdl", lambda setting, fused, device: False)
    monkeypatch.setattr(plan_module, "resolve_tma", lambda *args: False)
    _, model_config = read_config(tiny_ckpt)
    config = EngineConfig(device="cuda", enforce_eager=eager, plan_overrides=overrides)
    plan = resolve(config, model_config, torch.device("cuda"))
    assert (plan.codec_dtype, plan.codec_autotune) == want
    no_graphs = eager or "codec_graph_max_batch" in overrides
    assert plan.codec_graph_max_batch == (0 if no_graphs else 64)


def test_a_half_precision_codec_without_timing_is_warned_about(tiny_ckpt, monkeypatch, caplog):
    """fp16 forced untimed on a GPU runs, but some of its batch sizes are 6-10x slower than
    fp32: the start-up log says so; the default (timed) says nothing."""
    import engine.plan as plan_module

    monkeypatch.setattr(plan_module, "resolve_pdl", lambda setting, fused, device: False)
    monkeypatch.setattr(plan_module, "resolve_tma", lambda *args: False)
    _, model_config = read_config(tiny_ckpt)
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING", logger="clonecast.engine"):
        resolve(EngineConfig(device="cuda"), model_config, cuda)
        assert not caplog.records
        forced = {"codec_dtype": "float16", "codec_autotune": False}
        resolve(EngineConfig(device="cuda", plan_overrides=forced), model_config, cuda)
    assert [r.getMessage() for r in caplog.records] == [
        "codec in float16 without timed cuDNN algorithms (the plan's codec_autotune, "
        "with codec graphs): "
        "some batch sizes run 6-10x slower than in float32"
    ]


@pytest.mark.parametrize(
    "quantization, overrides, want",
    [
        ("fp8", {}, 128),
        ("fp8", {"few_row_fp8_rows": 64}, 64),
        ("fp8", {"few_row_fp8_rows": 512}, 512),
        ("none", {}, 0),
    ],
)
def test_fp8_steps_of_up_to_128_tokens_take_our_gemm_on_the_gpu(
    tiny_ckpt, monkeypatch, quantization, overrides, want
):
    """On the H200 our GEMM over float8 operands beats torch._scaled_mm at every Higgs
    projection up to 128 rows, the most its tiles take: fp8 weights on a GPU route steps of
    up to 128 tokens through it (taller steps may be asked for: the kernel takes up to 512
    rows in blocks of 128); bf16 weights never do. Resolved for a GPU without one."""
    import engine.plan as plan_module
    from kernels.skinny_gemm import MAX_ROWS, TILE_ROWS

    monkeypatch.setattr(plan_module, "resolve_pdl", lambda setting, fused, device: False)
    monkeypatch.setattr(plan_module, "resolve_tma", lambda *args: False)
    _, model_config = read_config(tiny_ckpt)
    config = EngineConfig(device="cuda", quantization=quantization, plan_overrides=overrides)
    plan = resolve(config, model_config, torch.device("cuda"))
    assert plan.few_row_fp8_rows == want and plan_module.DEFAULT_FEW_ROW_FP8_ROWS == TILE_ROWS
    assert plan_module.MAX_FEW_ROW_FP8_ROWS == MAX_ROWS  # what the kernel takes


@pytest.mark.parametrize(
    "device, eager, overrides, want",
    [
        ("cuda", False, {}, 3),  # graphs: prompts share mixed steps
        ("cuda", True, {}, 0),  # no graphs, no decode graph to leave
        ("cpu", False, {}, 0),
        ("cuda", False, {"admission_wait_steps": 0}, 0),
    ],
)
def test_admissions_wait_for_company_where_graphs_run(
    tiny_ckpt, monkeypatch, device, eager, overrides, want
):
    import engine.plan as plan_module

    monkeypatch.setattr(plan_module, "resolve_pdl", lambda setting, fused, device: False)
    monkeypatch.setattr(plan_module, "resolve_tma", lambda *args: False)
    _, model_config = read_config(tiny_ckpt)
    config = EngineConfig(device=device, enforce_eager=eager, plan_overrides=overrides)
    assert resolve(config, model_config, torch.device(device)).admission_wait_steps == want
    with pytest.raises(ConfigError, match="admission_wait_steps must be in 0..16"):
        EngineConfig(plan_overrides={"admission_wait_steps": 17})


def test_the_flat_attention_grid_is_a_triton_setting(tiny_ckpt):
    """On with the Triton backend, off with the others; it reaches the Triton backend's
    mixed launches of more than 128 tokens (where it was measured faster), never smaller
    ones or decode launches, and asking it of another backend is refused."""
    from engine.attention import FLAT_GRID_MIN_TOKENS

    _, model_config = read_config(tiny_ckpt)
    assert resolve(EngineConfig(), model_config, CPU).flat_attention_grid is False
    triton = {"attention_backend": "triton"}
    plan = resolve(EngineConfig(plan_overrides=triton), model_config, CPU)
    assert plan.flat_attention_grid and FLAT_GRID_MIN_TOKENS == 129
    attention = TritonAttention(plan)
    assert attention._mixed_knobs(144)["flat_grid"] and attention._mixed_knobs(512)["flat_grid"]
    assert "flat_grid" not in attention._mixed_knobs(128)
    assert "flat_grid" not in attention._decode_knobs()
    off = resolve(
        EngineConfig(plan_overrides=triton | {"flat_attention_grid": False}), model_config, CPU
    )
    assert "flat_grid" not in TritonAttention(off)._mixed_knobs(512)
    with pytest.raises(ConfigError, match="flat_attention_grid is a setting of the Triton"):
        EngineConfig(plan_overrides={"attention_backend": "torch", "flat_attention_grid": True})
    with pytest.raises(ConfigError, match="flat_attention_grid must be a bool, got 1"):
        EngineConfig(plan_overrides={"flat_attention_grid": 1})


def test_split_mixed_attention_is_an_opt_in_triton_setting(tiny_ckpt):
    """Off by default (not yet served faster), asked for only of the Triton backend."""
    _, model_config = read_config(tiny_ckpt)
    triton = {"attention_backend": "triton"}
    assert not resolve(EngineConfig(plan_overrides=triton), model_config, CPU).split_mixed_attention
    on = triton | {"split_mixed_attention": True}
    assert resolve(EngineConfig(plan_overrides=on), model_config, CPU).split_mixed_attention
    with pytest.raises(ConfigError, match="split_mixed_attention is a setting of the Triton"):
        EngineConfig(plan_overrides={"attention_backend": "torch", "split_mixed_attention": True})
    with pytest.raises(ConfigError, match="split_mixed_attention must be a bool, got 'yes'"):
        EngineConfig(plan_overrides={"split_mixed_attention": "yes"})


@pytest.mark.parametrize("split", [False, True])
def test_split_mixed_attention_launches_decode_rows_apart(split, monkeypatch):
    """With the setting, a mixed step's attention is two launches (prompt rows, then decode
    rows) and a decode-only step's stays one; either way every row is the torch backend's
    (the Triton interpreter, fp32)."""
    import kernels.paged_attention as pa
    from engine.attention import AttentionMetadata

    launches = []
    original = pa.paged_attention

    def counted(*args, **kwargs):
        launches.append(kwargs.get("rows", pa.ALL_ROWS))
        return original(*args, **kwargs)

    monkeypatch.setattr(pa, "paged_attention", counted)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 9, 4, 2, 16, generator=g)
    plan = ExecutionPlan(attention_backend="triton", split_mixed_attention=split)
    triton, torch_ref = TritonAttention(plan), TorchAttention(plan)
    triton.split_target = 1  # these few decodes in the one-pass kernel, not the split-KV one
    # a prompt of 5 beside two decodes, a padding sequence and a padding token; then decodes
    steps = [([0, 5, 6, 7, 7], [5, 9, 3, 0], 5), ([0, 1, 2, 2], [6, 10, 0], 1)]
    for qsl, seq_lens, max_q in steps:
        t, b = qsl[-1] + 1, len(seq_lens)
        meta = AttentionMetadata(
            num_tokens=t,
            num_seqs=b,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 0], [0, 0, 0]][:b]).int(),
            slot_mapping=torch.zeros(t, dtype=torch.int64),
            max_query_len=max_q,
            max_seq_len=max(seq_lens),
        )
        q = torch.randn(t, 4, 16, generator=g)
        out = triton.attend(q, cache, meta, 0.25)[: qsl[-1]]
        torch.testing.assert_close(out, torch_ref.attend(q, cache, meta, 0.25)[: qsl[-1]])
    mixed = [pa.PROMPT_ROWS, pa.DECODE_ROWS] if split else [pa.ALL_ROWS]
    assert launches == mixed + [pa.ALL_ROWS]
