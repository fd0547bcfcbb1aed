"""Configuration of the engine: the model's shape (read from a checkpoint's config.json),
the engine's capacity, and per-request sampling parameters.

Owns validation and defaults. Reads no environment variables (only the service's config
module does) and imports no torch, so the bookkeeping modules can use it freely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

NUM_CODEBOOKS = 8
CODEBOOK_SIZE = 1026  # 1024 real codes + BOC + EOC
BOC = 1024  # pad before a codebook starts
EOC = 1025  # pad after a codebook ends
FRAMES_PER_SECOND = 25
SAMPLE_RATE = 24000  # the codec's audio, Hz
FRAME_SAMPLES = SAMPLE_RATE // FRAMES_PER_SECOND  # 960: one frame, 40 ms
FRAME_MS = 1000 // FRAMES_PER_SECOND
MAX_ROWS = 2048  # 2048 rows -> 2040 frames -> 81.6 s
MAX_AUDIO_SECONDS = (MAX_ROWS - NUM_CODEBOOKS) / FRAMES_PER_SECOND  # 81.6
MAX_TEMPERATURE = 100.0

QUANTIZATIONS = ("none", "fp8")  # EngineConfig.quantization

ADDED_TOKENS = ("<|tts|>", "<|text|>", "<|audio|>", "<|ref_audio|>", "<|ref_text|>")


class ConfigError(ValueError):
    """A configuration or checkpoint that cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the Qwen3 backbone and its audio modules, from config.json's text_config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_codebooks: int = NUM_CODEBOOKS
    codebook_size: int = CODEBOOK_SIZE
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"text_config.{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_codebooks != NUM_CODEBOOKS or self.codebook_size != CODEBOOK_SIZE:
            raise ConfigError(
                f"audio_encoder_config must have num_codebooks={NUM_CODEBOOKS} and "
                f"vocab_size={CODEBOOK_SIZE}, got {self.num_codebooks} x {self.codebook_size}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies over all layers at 2 bytes per element."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_checkpoint_config(cls, config: dict[str, Any]) -> ModelConfig:
        """Builds the shape from a Higgs v3 config.json dict; missing fields are errors."""
        if config.get("model_type") != "higgs_multimodal_qwen3":
            raise ConfigError(
                f"config.json model_type is {config.get('model_type')!r}; this engine loads "
                "Higgs Audio v3 checkpoints (model_type 'higgs_multimodal_qwen3')"
            )
        text = config.get("text_config")
        audio = config.get("audio_encoder_config")
        if not isinstance(text, dict) or not isinstance(audio, dict):
            raise ConfigError("config.json needs both 'text_config' and 'audio_encoder_config'")
        if audio.get("encoder_type", "discrete") != "discrete" or not audio.get(
            "use_delay_pattern", True
        ):
            raise ConfigError("audio_encoder_config must be discrete with use_delay_pattern")
        if not audio.get("tie_word_embeddings", True):
            raise ConfigError("only a tied audio head is supported (tie_word_embeddings: true)")

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json text_config is missing {key!r}")
            return text[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope = _rope_theta(text)
        if audio.get("out_dim", hidden) != hidden:
            raise ConfigError(
                f"audio_encoder_config.out_dim ({audio.get('out_dim')}) != hidden_size ({hidden})"
            )
        return cls(
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads", heads),
            head_dim=text.get("head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=rope,
            max_position_embeddings=need("max_position_embeddings"),
            num_codebooks=audio.get("num_codebooks", NUM_CODEBOOKS),
            codebook_size=audio.get("vocab_size", CODEBOOK_SIZE),
            tie_word_embeddings=text.get("tie_word_embeddings", True),
        )


def _rope_theta(text: dict[str, Any]) -> float:
    """Reads the RoPE base from either config style; only the default rope type is supported."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json text_config has no rope_theta")
    return float(theta)


@dataclass(frozen=True)
class StreamConfig:
    """Streaming chunk sizes in frames (40 ms each); the defaults are the required profile."""

    first_chunk_frames: int = 8
    chunk_frames: int = 25
    left_context_frames: int = 8
    holdback_frames: int = 0

    def __post_init__(self) -> None:
        if self.first_chunk_frames < 1 or self.chunk_frames < 1:
            raise ConfigError("first_chunk_frames and chunk_frames must be >= 1")
        if self.left_context_frames < 0 or self.holdback_frames < 0:
            raise ConfigError("left_context_frames and holdback_frames must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance serves: capacity and correctness. How it runs on its device
    is the execution plan (engine/plan.py), resolved from `device`, `enforce_eager` and
    `plan_overrides` (field name -> value, for A/B runs; checked against the plan's fields).

    `num_kv_blocks=None` sizes the cache from `kv_cache_memory_fraction` of free GPU memory on
    CUDA, or `max_num_seqs * max_model_len` tokens on the CPU.
    """

    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.6
    # The cache's element type: "auto" (the model's dtype) or "fp8" (float8 e4m3, no scale,
    # saturating at +-448): half the cache memory (twice the blocks) and half the bytes
    # attention reads each step; lossy. Triton or torch attention backends only.
    kv_cache_dtype: str = "auto"
    # The decoder's projection weights: "none" (the model dtype) or "fp8" (float8 e4m3, one
    # scale per output channel; inputs quantized per token; engine/quantization.py): about
    # half the bytes a decode step reads; lossy, opt-in. CUDA: bf16 only.
    quantization: str = "none"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs (debugging, comparison)
    # Each step's events include one per generated row (`new_rows`); False: only audio chunks
    # and finishes (all a streaming server reads; saves building an event per row per step).
    row_events: bool = True
    stream: StreamConfig = StreamConfig()
    voice_cache_bytes: int = 64 * 1024 * 1024
    plan_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from engine.plan import check_overrides

        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks must be >= 2 (block 0 is reserved for padding)")
        if not 0.0 < self.kv_cache_memory_fraction < 1.0:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1)")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if (
            self.quantization == "fp8"
            and self.device.startswith("cuda")
            and self.dtype not in ("auto", "bfloat16")
        ):
            raise ConfigError(
                f"quantization='fp8' on CUDA needs dtype bfloat16 (or auto), got {self.dtype!r}"
            )
        if not isinstance(self.plan_overrides, Mapping):
            raise ConfigError("plan_overrides must be a mapping of plan field -> value")
        # a copy: later changes to the caller's dict do not reach this config
        object.__setattr__(self, "plan_overrides", dict(self.plan_overrides))
        check_overrides(self.plan_overrides, self.device)
        backend = self.plan_overrides.get("attention_backend")
        if self.kv_cache_dtype == "fp8" and backend in ("varlen", "flash"):
            raise ConfigError(
                "kv_cache_dtype='fp8' needs the triton (or torch) attention backend; the "
                f"{backend} backend reads a cache of the model's dtype"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


UNSUPPORTED_SAMPLING = (
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "min_p",
    "logit_bias",
    "grammar",
    "guided_json",
    "response_format_schema",
)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, shared by the 8 codebooks (spec section 4).

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed None draws
    a fresh seed when the request is added; max_rows caps the generated audio rows.
    """

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.95
    seed: int | None = None
    max_rows: int = MAX_ROWS

    def __post_init__(self) -> None:
        if (
            not isinstance(self.temperature, (int, float))
            or isinstance(self.temperature, bool)
            or not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE)
        ):
            raise ConfigError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {self.temperature!r}"
            )
        if type(self.top_k) is not int or not 0 <= self.top_k <= 2**31:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if (
            not isinstance(self.top_p, (int, float))
            or isinstance(self.top_p, bool)
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.max_rows, int) or not 1 <= self.max_rows <= MAX_ROWS:
            raise ConfigError(f"max_rows must be in [1, {MAX_ROWS}], got {self.max_rows}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Builds params from user input, rejecting unsupported and unknown fields by name."""
        known = {f.name for f in fields(cls)}
        unsupported = sorted(k for k in values if k in UNSUPPORTED_SAMPLING)
        if unsupported:
            raise ConfigError(
                f"unsupported sampling parameter(s) {unsupported}: Higgs v3 audio sampling "
                f"supports only {sorted(known)}"
            )
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise ConfigError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class VoiceReference:
    """A reference voice for cloning: its codes `[T_ref, 8]` (rows of 0..1023) and transcript."""

    codes: tuple[tuple[int, ...], ...]
    text: str | None = None

    def __post_init__(self) -> None:
        if not self.codes:
            raise ConfigError("a reference voice needs at least one frame of codes")
        for t, row in enumerate(self.codes):
            if len(row) != NUM_CODEBOOKS:
                raise ConfigError(f"reference frame {t} has {len(row)} codes, expected 8")
            if any(not 0 <= c < 1024 for c in row):
                raise ConfigError(f"reference frame {t} has codes outside [0, 1023]: {row}")
