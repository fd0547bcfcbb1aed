"""Validation of engine, model and sampling configuration (engine.config)."""

from __future__ import annotations

import copy
import math

import pytest

from engine.config import (
    MAX_ROWS,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    VoiceReference,
)

# -- SamplingParams ------------------------------------------------------------------------


def test_sampling_defaults_match_spec():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_rows) == (1.0, 50, 0.95, None, 2048)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 3.5},
        {"top_k": 0},
        {"top_k": 5000},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"max_rows": 1},
        {"max_rows": MAX_ROWS},
    ],
)
def test_sampling_valid_edges(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_rows": 0}, "max_rows"),
        ({"max_rows": 2049}, "max_rows"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_sampling_invalid(kwargs, field):
    with pytest.raises(ConfigError, match=field) as err:
        SamplingParams(**kwargs)
    # The message shows the offending value too.
    assert repr(next(iter(kwargs.values()))) in str(err.value) or str(
        next(iter(kwargs.values()))
    ) in str(err.value)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_from_dict_accepts_known_fields():
    p = SamplingParams.from_dict(
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": 5, "max_rows": 100}
    )
    assert p == SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=5, max_rows=100)
    assert SamplingParams.from_dict({}) == SamplingParams()


@pytest.mark.parametrize(
    "name, value",
    [
        ("repetition_penalty", 1.1),
        ("frequency_penalty", 0.5),
        ("presence_penalty", 0.5),
        ("logprobs", 5),
        ("min_p", 0.05),
        ("logit_bias", {"1": 2.0}),
        ("grammar", "root ::= x"),
    ],
)
def test_from_dict_rejects_unsupported_by_name(name, value):
    with pytest.raises(ConfigError, match="unsupported") as err:
        SamplingParams.from_dict({"temperature": 0.5, name: value})
    assert name in str(err.value)


@pytest.mark.parametrize("name", ["temprature", "beam_width", "top_a"])
def test_from_dict_rejects_unknown_by_name(name):
    with pytest.raises(ConfigError, match="unknown") as err:
        SamplingParams.from_dict({name: 1})
    assert name in str(err.value)
    assert "temperature" in str(err.value)  # lists what is known


def test_from_dict_still_validates_values():
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})


# -- EngineConfig ---------------------------------------------------------------------------


def test_engine_config_defaults_valid():
    cfg = EngineConfig()
    assert cfg.max_blocks_per_seq == math.ceil(cfg.max_model_len / cfg.block_size)
    assert EngineConfig(block_size=1, max_model_len=33).max_blocks_per_seq == 33
    assert EngineConfig(block_size=32, max_model_len=33).max_blocks_per_seq == 2


@pytest.mark.parametrize("block_size", [0, 3, 12, 24, 100, -16])
def test_engine_config_block_size_power_of_two(block_size):
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 256])
def test_engine_config_block_size_ok(block_size):
    assert EngineConfig(block_size=block_size).block_size == block_size


def test_engine_config_batched_tokens_at_least_num_seqs():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=63)
    assert EngineConfig(max_num_seqs=64, max_num_batched_tokens=64).max_num_seqs == 64


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "float64", "", "Float32"])
def test_engine_config_bad_dtype(dtype):
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_engine_config_good_dtype(dtype):
    assert EngineConfig(dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"num_kv_blocks": 1},
        {"kv_cache_memory_fraction": 0.0},
        {"kv_cache_memory_fraction": 1.0},
        {"plan_overrides": {"codec_graph_max_batch": -1}},
        {"plan_overrides": {"fused_decode": True, "fused_ops": False}, "device": "cuda"},
        {"plan_overrides": {"fused_decode": True, "attention_backend": "torch"}},
        {"plan_overrides": {"fused_decode": True}},  # the CPU has no fused ops
        {"plan_overrides": {"kv_cache_layout": "hnd"}},  # no such plan field
        {"plan_overrides": {"cuda_graphs": False}},  # follows enforce_eager
        {"plan_overrides": {"fused_ops": "yes"}},
        {"plan_overrides": {"graph_buckets": (8, 4)}},
        {"plan_overrides": ["pdl"]},
        {"plan_overrides": {"fused_ops": True}, "device": "mps"},  # GPU kernels need CUDA
        {"plan_overrides": {"few_row_gemm_rows": 16}, "device": "cpu:0"},
    ],
)
def test_engine_config_other_invalid(kwargs):
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)


def test_fused_decode_goes_with_the_triton_backend():
    cuda = EngineConfig(device="cuda", plan_overrides={"fused_decode": True})  # auto backend
    assert cuda.plan_overrides["fused_decode"]
    # left out, it applies where it can and is no error where it cannot
    assert "fused_decode" not in EngineConfig().plan_overrides
    EngineConfig(device="cuda", plan_overrides={"fused_ops": False})
    EngineConfig(device="cuda", plan_overrides={"attention_backend": "varlen"})
    with pytest.raises(ConfigError, match="Triton attention backend"):
        EngineConfig(
            device="cuda", plan_overrides={"attention_backend": "varlen", "fused_decode": True}
        )


@pytest.mark.parametrize("backend", ["varlen", "flash"])
def test_flash_attention_backends_need_cuda(backend):
    with pytest.raises(ConfigError, match="needs CUDA"):
        EngineConfig(plan_overrides={"attention_backend": backend})
    cfg = EngineConfig(device="cuda", plan_overrides={"attention_backend": backend})
    assert cfg.plan_overrides["attention_backend"] == backend
    with pytest.raises(ConfigError, match="torch.*triton.*varlen.*flash"):
        EngineConfig(plan_overrides={"attention_backend": "flash3"})


def test_plan_overrides_are_copied_and_named():
    overrides = {"async_scheduling": False}
    cfg = EngineConfig(plan_overrides=overrides)
    overrides["async_scheduling"] = True  # the config keeps what it was given
    assert cfg.plan_overrides == {"async_scheduling": False}
    with pytest.raises(ConfigError, match="known: .*few_row_gemm_rows"):
        EngineConfig(plan_overrides={"skinny_gemm_rows": 8})


# -- ModelConfig.from_checkpoint_config -----------------------------------------------------

TEXT_CONFIG = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}

HIGGS_CONFIG = {
    "model_type": "higgs_multimodal_qwen3",
    "text_config": TEXT_CONFIG,
    "audio_encoder_config": {
        "encoder_type": "discrete",
        "num_codebooks": 8,
        "vocab_size": 1026,
        "out_dim": 2560,
        "tie_word_embeddings": True,
        "use_delay_pattern": True,
    },
}


def higgs(**text_changes) -> dict:
    cfg = copy.deepcopy(HIGGS_CONFIG)
    cfg["text_config"].update(text_changes)
    return cfg


def check_full_shape(m: ModelConfig) -> None:
    assert m.hidden_size == 2560
    assert m.num_layers == 36
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (32, 8, 128)
    assert m.intermediate_size == 9728
    assert m.vocab_size == 151936
    assert m.rms_norm_eps == 1e-6
    assert m.rope_theta == 1_000_000.0 and isinstance(m.rope_theta, float)
    assert m.max_position_embeddings == 32768
    assert (m.num_codebooks, m.codebook_size) == (8, 1026)
    assert m.tie_word_embeddings is True
    assert m.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2


def test_model_config_rope_theta_style():
    check_full_shape(ModelConfig.from_checkpoint_config(higgs()))


def test_model_config_rope_parameters_style():
    cfg = higgs()
    del cfg["text_config"]["rope_theta"]
    cfg["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000}
    check_full_shape(ModelConfig.from_checkpoint_config(cfg))


def test_model_config_rope_parameters_take_precedence():
    cfg = higgs(
        rope_theta=10_000.0, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}
    )
    assert ModelConfig.from_checkpoint_config(cfg).rope_theta == 500_000.0


def test_model_config_derived_defaults():
    cfg = higgs()
    del cfg["text_config"]["num_key_value_heads"]
    del cfg["text_config"]["head_dim"]
    m = ModelConfig.from_checkpoint_config(cfg)
    assert m.num_kv_heads == 32
    assert m.head_dim == 2560 // 32


@pytest.mark.parametrize("model_type", ["qwen3", "higgs_audio_v2", None])
def test_model_config_wrong_model_type(model_type):
    cfg = copy.deepcopy(HIGGS_CONFIG)
    if model_type is None:
        del cfg["model_type"]
    else:
        cfg["model_type"] = model_type
    with pytest.raises(ConfigError, match="higgs_multimodal_qwen3") as err:
        ModelConfig.from_checkpoint_config(cfg)
    assert repr(model_type) in str(err.value)


@pytest.mark.parametrize(
    "key",
    [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
    ],
)
def test_model_config_missing_text_config_key(key):
    cfg = higgs()
    del cfg["text_config"][key]
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_checkpoint_config(cfg)


def test_model_config_missing_rope_theta():
    cfg = higgs()
    del cfg["text_config"]["rope_theta"]
    with pytest.raises(ConfigError, match="rope_theta"):
        ModelConfig.from_checkpoint_config(cfg)


@pytest.mark.parametrize("section", ["text_config", "audio_encoder_config"])
def test_model_config_missing_section(section):
    cfg = copy.deepcopy(HIGGS_CONFIG)
    del cfg[section]
    with pytest.raises(ConfigError, match=section):
        ModelConfig.from_checkpoint_config(cfg)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ],
)
def test_model_config_non_default_rope_rejected(changes):
    with pytest.raises(ConfigError, match="rope type") as err:
        ModelConfig.from_checkpoint_config(higgs(**changes))
    kind = next(iter(changes.values())).get("rope_type") or next(iter(changes.values()))["type"]
    assert kind in str(err.value)


@pytest.mark.parametrize("heads, kv", [(32, 6), (32, 64), (10, 4)])
def test_model_config_heads_not_multiple_of_kv(heads, kv):
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_checkpoint_config(higgs(num_attention_heads=heads, num_key_value_heads=kv))


@pytest.mark.parametrize(
    "audio_changes",
    [
        {"num_codebooks": 12},
        {"vocab_size": 1024},
        {"out_dim": 2048},
        {"encoder_type": "continuous"},
        {"use_delay_pattern": False},
        {"tie_word_embeddings": False},
    ],
)
def test_model_config_bad_audio_config(audio_changes):
    cfg = copy.deepcopy(HIGGS_CONFIG)
    cfg["audio_encoder_config"].update(audio_changes)
    with pytest.raises(ConfigError):
        ModelConfig.from_checkpoint_config(cfg)


def test_model_config_odd_head_dim_rejected():
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig.from_checkpoint_config(higgs(head_dim=127))


# -- VoiceReference -------------------------------------------------------------------------


def test_voice_reference_valid():
    ref = VoiceReference(((0,) * 8, (1023,) * 8), "hi")
    assert len(ref.codes) == 2 and ref.text == "hi"
    assert VoiceReference(((5,) * 8,)).text is None


def test_voice_reference_empty_codes():
    with pytest.raises(ConfigError, match="at least one frame"):
        VoiceReference(())


@pytest.mark.parametrize("width", [0, 7, 9, 16])
def test_voice_reference_wrong_width(width):
    with pytest.raises(ConfigError, match="frame 1") as err:
        VoiceReference(((1,) * 8, (1,) * width))
    assert str(width) in str(err.value)


@pytest.mark.parametrize("bad", [-1, 1024, 1025, 5000])
def test_voice_reference_codes_out_of_range(bad):
    row = [3] * 8
    row[5] = bad
    with pytest.raises(ConfigError, match=r"outside \[0, 1023\]"):
        VoiceReference(((3,) * 8, (3,) * 8, tuple(row)))


def _cuda(**overrides) -> EngineConfig:
    return EngineConfig(device="cuda", plan_overrides=overrides)


def test_pdl_setting_is_validated():
    with pytest.raises(ConfigError, match="pdl"):
        EngineConfig(plan_overrides={"pdl": True})  # the CPU has no dependent launch
    with pytest.raises(ConfigError, match="pdl"):
        _cuda(pdl=True, fused_ops=False)
    assert _cuda(pdl=True).plan_overrides["pdl"] is True


def test_few_row_gemm_rows_is_validated():
    assert _cuda(few_row_gemm_rows=64).plan_overrides["few_row_gemm_rows"] == 64
    with pytest.raises(ConfigError, match="0..64"):
        _cuda(few_row_gemm_rows=65)
    with pytest.raises(ConfigError, match="CUDA"):
        EngineConfig(plan_overrides={"few_row_gemm_rows": 8})  # the CPU
    with pytest.raises(ConfigError, match="fused_ops"):
        _cuda(few_row_gemm_rows=8, fused_ops=False)
    with pytest.raises(ConfigError, match="CUDA"):
        EngineConfig(plan_overrides={"few_row_gemm_tma": True})  # the CPU
    with pytest.raises(ConfigError, match="few_row_gemm_rows > 0"):
        _cuda(few_row_gemm_rows=0, few_row_gemm_tma=True)
    assert "few_row_gemm_tma" not in _cuda(few_row_gemm_rows=0).plan_overrides


def test_few_row_fp8_rows_reaches_512():
    """Our fp8 GEMM takes up to 512 rows (a step's default token budget), in blocks of 128."""
    assert _cuda(few_row_fp8_rows=512).plan_overrides["few_row_fp8_rows"] == 512
    with pytest.raises(ConfigError, match="0..512"):
        _cuda(few_row_fp8_rows=513)


def test_codec_autotune_is_validated():
    assert _cuda(codec_autotune=True).plan_overrides == {"codec_autotune": True}
    with pytest.raises(ConfigError, match="codec_autotune needs a CUDA device"):
        EngineConfig(plan_overrides={"codec_autotune": True})
    with pytest.raises(ConfigError, match="needs codec graphs"):
        _cuda(codec_autotune=True, codec_graph_max_batch=0)
    with pytest.raises(ConfigError, match="must be a bool"):
        _cuda(codec_autotune=1)


def test_kv_cache_dtype_is_validated():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="auto or fp8"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="triton"):
        EngineConfig(
            device="cuda", plan_overrides={"attention_backend": "varlen"}, kv_cache_dtype="fp8"
        )
