"""Loading a Higgs v3 checkpoint in its real layout: config.json, safetensors (one file or
sharded with an index) with the `tied.*` / `body.*` keys, and tokenizer files.

Owns key mapping and weight fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Unknown and
missing keys are errors that name the key. The codec keys under the bundled codec prefix are
left for the codec loader. A hub id is resolved with huggingface_hub when a network exists.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention import AttentionBackend
from engine.config import ConfigError, ModelConfig
from engine.model import HiggsModel
from engine.plan import ExecutionPlan
from engine.quantization import quantize_model

TEXT_EMBED_KEY = "tied.embedding.text_embedding.weight"
AUDIO_TABLE_KEY = "tied.embedding.modality_embeddings.0.embedding.weight"
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
HEAD_PREFIXES = ("tied.head.text_head.", "tied.head.modality_heads.0.")
FINAL_NORM_KEY = "body.norm.weight"

# Checkpoint sub-key of each decoder-layer tensor -> (our parameter, part of a fused weight).
LAYER_KEYS: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
}


def refuse_hugging_faces_kernels() -> None:
    """Hugging Face's `kernels` distribution has our `kernels` package's import name: beside
    it, transformers imports ours as its own and fails deep inside model loading (the
    embedded model is written through transformers' codec). Say so before anything loads."""
    try:
        found = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise ConfigError(
        f"Hugging Face's `kernels` package ({found}) is installed in this Python environment; "
        "its import name is clonecast's own `kernels`, so the two cannot share an environment: "
        "install clonecast in a virtual environment of its own (docs/deploy.md)"
    )


def resolve_checkpoint(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub id downloaded with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ConfigError(f"checkpoint {model!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model)))
    except Exception as exc:
        raise ConfigError(
            f"{model!r} is neither a local checkpoint directory nor a downloadable hub id "
            f"({type(exc).__name__}: {exc}); download it and pass its directory"
        ) from exc


def read_config(ckpt: Path) -> tuple[dict, ModelConfig]:
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{ckpt} has no config.json; is it a Higgs Audio v3 checkpoint?")
    raw = json.loads(config_path.read_text())
    return raw, ModelConfig.from_checkpoint_config(raw)


def safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [ckpt / name for name in sorted(set(weight_map.values()))]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{ckpt} holds no *.safetensors weights")
    return files


def iter_tensors(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(ckpt):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _target(key: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Our parameter for a checkpoint key; None for keys that are skipped by design."""
    if key == TEXT_EMBED_KEY:
        return "embed_tokens.weight", None
    if key == AUDIO_TABLE_KEY:
        return "audio_embed.weight", None
    if key == FINAL_NORM_KEY:
        return "norm.weight", None
    if key.startswith(CODEC_PREFIX):
        return None
    if key.startswith(HEAD_PREFIXES):
        if cfg.tie_word_embeddings:
            return None
        raise ConfigError(f"untied head key {key!r}: only tied heads are supported")
    if key.startswith("body.layers."):
        rest = key[len("body.layers.") :]
        index, _, sub = rest.partition(".")
        if index.isdigit() and int(index) < cfg.num_layers and sub in LAYER_KEYS:
            name, part = LAYER_KEYS[sub]
            return f"layers.{index}.{name}", part
    raise ConfigError(f"unknown checkpoint key {key!r}")


def _part_slice(param_name: str, part: int, cfg: ModelConfig) -> slice:
    if "qkv_proj" in param_name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bounds = [0, q, q + kv, q + 2 * kv]
    else:
        bounds = [0, cfg.intermediate_size, 2 * cfg.intermediate_size]
    return slice(bounds[part], bounds[part + 1])


def expected_keys(cfg: ModelConfig) -> set[str]:
    keys = {TEXT_EMBED_KEY, AUDIO_TABLE_KEY, FINAL_NORM_KEY}
    for i in range(cfg.num_layers):
        keys |= {f"body.layers.{i}.{sub}" for sub in LAYER_KEYS}
    return keys


def load_model(
    ckpt: Path,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    plan: ExecutionPlan | None = None,
    quantization: str = "none",
) -> tuple[HiggsModel, list[str]]:
    """Builds the model on `device` in `dtype` as `plan` says (default: the plain torch path)
    and fills it from the checkpoint, then quantizes its projections if `quantization` is
    "fp8" (engine/quantization.py). Returns the model and the names of the codec keys found
    (loaded by the codec, not here)."""
    _, cfg = read_config(ckpt)
    with torch.device(device):
        model = HiggsModel(cfg, backend, plan or ExecutionPlan())
    for p in model.parameters():
        p.data = p.data.to(dtype)
    del p  # no local may hold a weight that quantize_model frees
    codec_keys = _fill(model, ckpt, cfg)
    model.eval().requires_grad_(False)
    if quantization == "fp8":  # after _fill's references to the bf16 weights are gone
        quantize_model(model, plan or ExecutionPlan())
    return model, codec_keys


def _fill(model: HiggsModel, ckpt: Path, cfg) -> list[str]:
    """Copies every checkpoint tensor into the model's parameters; returns the codec keys
    seen. Its own function so that nothing here outlives the copy: quantize_model can only
    return the bf16 projections' memory when nothing else holds them."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    codec_keys: list[str] = []
    for key, tensor in iter_tensors(ckpt):
        target = _target(key, cfg)
        if target is None:
            if key.startswith(CODEC_PREFIX):
                codec_keys.append(key)
            continue
        name, part = target
        dest = params[name].data
        if part is not None:
            dest = dest[_part_slice(name, part, cfg)]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint key {key!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} from config.json"
            )
        dest.copy_(tensor)
        seen.add(key)
    missing = sorted(expected_keys(cfg) - seen)
    if missing:
        raise ConfigError(f"checkpoint is missing key {missing[0]!r} ({len(missing)} missing)")
    return codec_keys
