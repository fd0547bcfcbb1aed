"""FP8 weights on the CPU (engine/quantization.py): the quantization math, the config's
checks, and the wiring of the tiny model against an independent reference, transformers'
Qwen3 with the same quantization applied by hooks to its separate q/k/v/o/gate/up/down."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import ConfigError, Engine, EngineConfig, SamplingParams
from engine.quantization import (
    FP8_MAX,
    Fp8Linear,
    quantize_rows,
    quantize_weight,
    scaled_matmul,
)
from tests.engine.parity import HiddenRecorder, check_all_chunks
from tests.engine.reference import ReferenceModel
from tests.engine.test_parity import make_reference, run

E4M3_STEP = 2.0**-3  # relative spacing of e4m3 values (3 mantissa bits)


def test_weights_keep_one_scale_per_output_channel():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very unequal size
    w[5] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1, 48)
    peaks = q.float().abs().amax(1)
    assert torch.equal(peaks[torch.arange(48) != 5], torch.full((47,), FP8_MAX))
    assert torch.equal(q.float()[5], torch.zeros(64))  # a zero channel: zeros, no NaN
    deq = q.float() * scale.t()
    # normal e4m3 values are within half a step of the original; tiny ones within the
    # subnormal spacing (2**-9 of a scale unit)
    bound = 0.5 * E4M3_STEP * w.abs() + 2.0**-10 * scale.t()
    assert ((deq - w).abs() <= bound + 1e-12).all()


def test_activations_are_scaled_per_token():
    x = torch.randn(6, 32) * torch.tensor([1e-3, 1e-1, 1.0, 10.0, 100.0, 1e4])[:, None]
    rows = quantize_rows(x)
    assert rows.scale.shape == (6, 1)
    torch.testing.assert_close(rows.scale[:, 0], x.abs().amax(1) / FP8_MAX)
    rel = (rows.data.float() * rows.scale - x).norm(dim=1) / x.norm(dim=1)
    assert (rel < 0.05).all() and (rel > 0).all()  # every row as precise, whatever its size


def test_scaled_matmul_on_the_cpu_sums_the_dequantized_operands():
    w8, ws = quantize_weight(torch.randn(16, 32))
    layer = Fp8Linear(w8, ws)
    rows = quantize_rows(torch.randn(3, 32))
    want = (rows.data.double() * rows.scale.double()) @ (w8.double() * ws.double().t()).t()
    out = scaled_matmul(rows, layer, torch.float32)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_config_checks_the_setting():
    assert EngineConfig().quantization == "none"
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="needs dtype bfloat16"):
        EngineConfig(device="cuda", dtype="float32", quantization="fp8")
    EngineConfig(device="cuda", quantization="fp8")  # auto: bf16 on CUDA


def _fake_quant_reference(ckpt, device: str = "cpu") -> ReferenceModel:
    """transformers' model with every decoder projection's weight replaced by its fp8
    dequantization and each input quantized per token by a hook: what the engine computes,
    reached without the engine's fused weights, ops or kernels."""
    reference = ReferenceModel(ckpt, device=device)

    def quantize_input(module, args):
        rows = quantize_rows(args[0].reshape(-1, args[0].shape[-1]))
        return ((rows.data.float() * rows.scale).reshape(args[0].shape).to(args[0].dtype),)

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    count = 0
    for name, module in reference.model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in names:
            q, scale = quantize_weight(module.weight.data)
            module.weight.data = q.float() * scale.t()
            module.register_forward_pre_hook(quantize_input)
            count += 1
    assert count == 7 * len(reference.model.layers)
    return reference


def _requests():
    voice = make_reference(2, 24, "a reference")
    return [
        ("a", "Hello there, friend.", None, SamplingParams(seed=3, max_rows=10)),
        ("b", "Cloned, and decoded beside a.", voice, SamplingParams(temperature=0, max_rows=8)),
    ]


def test_fp8_engine_matches_a_fake_quantized_transformers_model(tiny_ckpt):
    """Every step's hidden states and audio logits: equal to the hooked reference within
    fp32 rounding (a rare activation on a rounding boundary may land one e4m3 step apart),
    and visibly apart from the unquantized reference (the quantization really runs)."""
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, quantization="fp8")
    engine = Engine.from_pretrained(tiny_ckpt, cfg)
    layer = engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    assert engine.model.audio_embed.weight.dtype == torch.float32  # head and embeddings kept
    recorder = HiddenRecorder(engine)
    prompts, rows = run(engine, _requests())
    worst_h, worst_l, checked = check_all_chunks(
        engine, recorder, _fake_quant_reference(tiny_ckpt), prompts, rows, tol=5e-3
    )
    assert checked > 10
    print(f"fp8 engine vs fake-quantized reference: hidden {worst_h:.2e}, logits {worst_l:.2e}")
    with pytest.raises(AssertionError):  # the plain model is far from it
        check_all_chunks(engine, recorder, ReferenceModel(tiny_ckpt), prompts, rows, tol=5e-3)


def test_fp8_rows_do_not_depend_on_how_prompts_are_split(tiny_ckpt):
    """Seeded rows of the fp8 engine are the same whether prompts are prefilled in chunks of
    16 tokens beside the other request's decodes or whole (per-token scales: a row's numbers
    never depend on the other rows of its step, as one scale per tensor would)."""
    cfg = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, quantization="fp8")
    rows = []
    for batched in (16, 64):
        engine = Engine.from_pretrained(
            tiny_ckpt, EngineConfig(**{**cfg, "max_num_batched_tokens": batched})
        )
        rows.append(run(engine, _requests())[1])
    assert rows[0] == rows[1]


@pytest.mark.parametrize("max_rows", [0, 16])
def test_the_gpu_paths_in_the_triton_interpreter(tiny_ckpt, max_rows):
    """The ops a GPU runs, on the CPU: quantization in the norm and SiLU kernels (max_rows 0:
    every step), the float8 weight in the few-row GEMM (16: steps of up to 16 tokens), the
    Triton attention; fp32, since the interpreter's bf16 products are wrong. The matmul is the
    CPU's dequantized one. Against the same hooked reference as the torch path."""
    import os

    from engine.model import TorchOps
    from engine.quantization import Fp8Ops

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for the GPU here; the CUDA tests cover these paths")
    cfg = EngineConfig(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        quantization="fp8",
        plan_overrides={"attention_backend": "triton"},
    )
    engine = Engine.from_pretrained(tiny_ckpt, cfg)
    cpu = torch.device("cpu")
    engine.model.ops = Fp8Ops(TorchOps, True, torch.float32, cpu, max_rows=max_rows)
    recorder = HiddenRecorder(engine)
    prompts, rows = run(engine, _requests())
    reference = _fake_quant_reference(tiny_ckpt)
    _, _, checked = check_all_chunks(engine, recorder, reference, prompts, rows, tol=5e-3)
    sizes = [sum(n for _, _, n in chunks) for chunks, _ in recorder.steps]
    assert checked > 10 and min(sizes) <= 16 < max(sizes)


def test_scaled_mm_rows_pads_to_the_next_power_of_two():
    from engine.quantization import scaled_mm_rows

    assert [scaled_mm_rows(n) for n in (1, 2, 3, 64, 65, 128, 272, 512, 513)] == [
        1, 2, 4, 64, 128, 128, 512, 512, 1024,
    ]  # fmt: skip


def test_the_bf16_projections_are_gone_when_their_memory_is_returned(tiny_ckpt, monkeypatch):
    """fp8 weights free the bf16 projections' memory, and the KV cache is sized from the
    device's free memory: when quantize_model hands the cache back to the device, no bf16
    projection weight may still be referenced (earlier, the loader's parameter table kept
    all of them alive, so the cache could return nothing and fp8 got fewer KV blocks)."""
    import gc
    import weakref

    from engine import quantization
    from engine.attention import TorchAttention
    from engine.loader import load_model
    from engine.plan import ExecutionPlan

    originals = []
    from_linear = Fp8Linear.from_linear.__func__

    def recording(cls, linear):
        originals.append(weakref.ref(linear.weight))
        return from_linear(cls, linear)

    alive_at_return = []

    def returned(device):
        gc.collect()
        alive_at_return.append(sum(ref() is not None for ref in originals))

    monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(recording))
    monkeypatch.setattr(quantization, "return_cached_memory", returned)
    model, _ = load_model(
        tiny_ckpt, TorchAttention(), torch.device("cpu"), torch.float32, ExecutionPlan(), "fp8"
    )
    assert len(originals) == 4 * len(model.layers)
    assert alive_at_return == [0]
