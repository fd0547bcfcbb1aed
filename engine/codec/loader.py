"""Loading codec weights: from a v3 checkpoint's bundled codec (keys under
`tied.embedding.modality_embeddings.0.model.`) or from a standalone tokenizer directory in
the transformers layout (`model_type: higgs_audio_v2_tokenizer`).

Weight-normalised convolutions (`weight_g`/`weight_v`, or torch parametrizations) are folded
into plain weights. Names follow transformers' `HiggsAudioV2TokenizerModel`; missing decoder
keys are errors naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.codec.config import STANDARD_CODEC_CONFIG, CodecConfig
from engine.codec.decoder import CodecDecoder
from engine.config import ConfigError
from engine.loader import CODEC_PREFIX, iter_tensors

# Buffers of the training-time EMA codebook and HuBERT's masking vector: unused at inference.
_OPTIONAL = ("codebook.inited", "codebook.cluster_size", "codebook.embed_avg", "masked_spec_embed")


def load_codec_state(path: Path) -> tuple[CodecConfig, dict[str, torch.Tensor]]:
    """Reads the codec's config and tensors (weight norm folded) from either layout."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{path} has no config.json")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") == "higgs_audio_v2_tokenizer":
        tensors = dict(iter_tensors(path))
        codec_raw = raw
    else:
        codec_raw = (raw.get("audio_encoder_config") or {}).get(
            "codec_config"
        ) or STANDARD_CODEC_CONFIG
        tensors = {
            k[len(CODEC_PREFIX) :]: t for k, t in iter_tensors(path) if k.startswith(CODEC_PREFIX)
        }
        if not tensors:
            raise ConfigError(
                f"{path} bundles no codec (no keys under {CODEC_PREFIX!r}); pass a standalone "
                "Higgs audio tokenizer directory as the codec"
            )
    return CodecConfig.from_dict(codec_raw), tensors


def fold_weight_norm(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """weight = g * v / ||v|| (norm over every dim but 0), for both naming styles; keeps
    every other tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    pairs = {
        ".weight_g": ".weight_v",
        ".parametrizations.weight.original0": ".parametrizations.weight.original1",
    }
    for key, t in tensors.items():
        for g_suffix, v_suffix in pairs.items():
            if key.endswith(g_suffix):
                base = key[: -len(g_suffix)]
                v = tensors[base + v_suffix].float()
                norm = v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
                out[base + ".weight"] = (t.float() * v / norm).to(t.dtype)
                break
            if key.endswith(v_suffix):
                break
        else:
            out[key] = t
    return out


def build_decoder(
    cfg: CodecConfig,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    fused: bool = False,
    channels_last: bool = False,
) -> CodecDecoder:
    """The decoder with these weights; `fused` runs its Snake activations as one Triton kernel
    each (CUDA only); `channels_last` keeps its activations in NHWC memory."""
    state = fold_weight_norm(state)
    with torch.device(device):
        decoder = CodecDecoder(cfg)
    params = dict(decoder.named_parameters())
    filled: set[str] = set()

    def put(name: str, key: str, index: int | None = None) -> None:
        if key not in state:
            raise ConfigError(f"codec weights are missing key {key!r}")
        dest = params[name].data if index is None else params[name].data[index]
        if tuple(dest.shape) != tuple(state[key].shape):
            raise ConfigError(
                f"codec key {key!r} has shape {tuple(state[key].shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(state[key])
        filled.add(name)

    for q in range(cfg.num_codebooks):
        prefix = f"quantizer.quantizers.{q}."
        put("codebooks", prefix + "codebook.embed", q)
        put("project_out_weight", prefix + "project_out.weight", q)
        put("project_out_bias", prefix + "project_out.bias", q)
    for name in params:
        if name.startswith(("fc2.", "acoustic_decoder.")):
            put(name, name)
    decoder.to(dtype).eval().requires_grad_(False)
    return decoder.use_fused_kernels(fused).use_channels_last(channels_last)


_WEIGHT_NORM_SUFFIXES = (
    ".weight_g",
    ".weight_v",
    ".parametrizations.weight.original0",
    ".parametrizations.weight.original1",
)


def _weight_of(key: str) -> str | None:
    """The plain weight a weight-norm part folds into; None for other keys."""
    for suffix in _WEIGHT_NORM_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)] + ".weight"
    return None


def build_reference_model(cfg: CodecConfig, state: dict[str, torch.Tensor], device: torch.device):
    """transformers' HiggsAudioV2TokenizerModel (encoder and decoder) with these weights, fp32."""
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    hf_cfg = HiggsAudioV2TokenizerConfig(**{k: v for k, v in cfg.raw.items() if k != "model_type"})
    with torch.device(device):
        model = HiggsAudioV2TokenizerModel(hf_cfg)
    # Take each tensor in whichever form the model expects: plain, or weight-normalised (its
    # HuBERT keeps a parametrised positional convolution).
    expected = set(model.state_dict())
    folded = fold_weight_norm(state)
    usable = {k: v for k, v in folded.items() if k in expected}
    usable.update({k: v for k, v in state.items() if k in expected})
    unexpected = [k for k in state if k not in expected and _weight_of(k) not in usable]
    missing, _ = model.load_state_dict(usable, strict=False)
    missing = [k for k in missing if not k.endswith(_OPTIONAL)]
    if missing or unexpected:
        key = (missing or unexpected)[0]
        kind = "missing" if missing else "unknown"
        raise ConfigError(
            f"codec weights: {kind} key {key!r} ({len(missing)} missing, {len(unexpected)} unknown)"
        )
    return model.eval().requires_grad_(False)
