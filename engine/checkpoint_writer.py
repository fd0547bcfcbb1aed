"""Writing random-weight checkpoints in the real Higgs v3 layout, and the embedded default.

The embedded default model is a small deterministic random checkpoint (tokenizer included)
written into a cache directory on first use and then loaded through the normal loader. It is
untrained: its audio is not speech. The same writer makes full-size random checkpoints for GPU
benchmarks (same cost per step as the real weights) and small ones for tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.codec.config import STANDARD_CODEC_CONFIG, TINY_CODEC_CONFIG
from engine.config import ADDED_TOKENS, CODEBOOK_SIZE, NUM_CODEBOOKS
from engine.loader import (
    AUDIO_TABLE_KEY,
    CODEC_PREFIX,
    FINAL_NORM_KEY,
    LAYER_KEYS,
    TEXT_EMBED_KEY,
)

DEFAULT_MODEL_VERSION = "v3"
UNTRAINED_NOTICE = (
    "the embedded default model has random weights: its audio is not speech. "
    "Pass a real Higgs Audio v3 checkpoint to hear a voice."
)

TINY_TEXT_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 8192,
}

FULL_TEXT_CONFIG = {  # Higgs v3 4B shape (spec section 1)
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "vocab_size": 151936,
}


def random_codec_weights(
    codec_config: dict, seed: int, decoder_std: float | None = 0.6
) -> dict[str, torch.Tensor]:
    """A seeded random codec in transformers' HiggsAudioV2TokenizerModel naming, with random
    codebooks (its own init leaves them zero, which would make every code sound the same).

    With `decoder_std`, the decoder-side weights are redrawn at decoder_std / sqrt(fan_in):
    transformers' init (std 0.02) leaves the audio almost independent of the codes (changing
    every code of a frame moves it by ~0.1 % of its RMS, below one PCM16 step), so mixed-up
    windows would go unnoticed; redrawn, one code moves it by ~30 % with activations O(1).
    """
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    raw = {k: v for k, v in codec_config.items() if k != "model_type"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**raw))
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        for key, t in state.items():
            if key.endswith("codebook.embed"):
                state[key] = torch.randn(t.shape) * 0.5
            elif key.endswith(".alpha"):
                state[key] = 1.0 + 0.2 * torch.rand(t.shape)
    if decoder_std is not None:
        gen = torch.Generator().manual_seed(seed)
        for key, w in sorted(state.items()):
            decoder_side = key.startswith(("fc2.", "acoustic_decoder.")) or "project_out" in key
            if decoder_side and key.endswith(".weight") and w.dim() >= 2:
                fan_in = 2 * w.shape[0] if ".conv_t1." in key else w[0].numel()
                state[key] = torch.randn(w.shape, generator=gen) * decoder_std / fan_in**0.5
    return state


def write_codec_dir(
    directory: Path, codec_config: dict, seed: int = 0, decoder_std: float | None = 0.6
) -> Path:
    """A standalone tokenizer directory (transformers layout) with random weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(codec_config, indent=2))
    weights = random_codec_weights(codec_config, seed, decoder_std)
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def make_config(text_config: dict, codec_config: dict | None = None) -> dict:
    text = {
        "model_type": "qwen3",
        "architectures": ["Qwen3Model"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        **text_config,
    }
    audio = {
        "encoder_type": "discrete",
        "num_codebooks": NUM_CODEBOOKS,
        "vocab_size": CODEBOOK_SIZE,
        "out_dim": text["hidden_size"],
        "tie_word_embeddings": True,
        "use_delay_pattern": True,
    }
    if codec_config is not None:  # our extension: the real file's codec description is unknown
        audio["codec_config"] = codec_config
    return {
        "model_type": "higgs_multimodal_qwen3",
        "text_config": text,
        "audio_encoder_config": audio,
    }


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) with `<|endoftext|>`,
    `<|audio_end|>` and the five added tokens. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|audio_end|>", *ADDED_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def random_weights(
    text: dict, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint's own key names, deterministic for a seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = text["hidden_size"], text["head_dim"]
    nq, nkv, inter = (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["intermediate_size"],
    )

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g, device=device) * 0.1).to(dtype)

    shapes = {
        "self_attn.q_proj.weight": (nq * d, h),
        "self_attn.k_proj.weight": (nkv * d, h),
        "self_attn.v_proj.weight": (nkv * d, h),
        "self_attn.o_proj.weight": (h, nq * d),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    tensors = {
        TEXT_EMBED_KEY: normal(text["vocab_size"], h, std=0.5),
        AUDIO_TABLE_KEY: normal(NUM_CODEBOOKS * CODEBOOK_SIZE, h, std=0.2),
        FINAL_NORM_KEY: norm(h),
    }
    for i in range(text["num_hidden_layers"]):
        for sub in LAYER_KEYS:
            key = f"body.layers.{i}.{sub}"
            if sub in shapes:
                rows, cols = shapes[sub]
                tensors[key] = normal(rows, cols, std=cols**-0.5)
            else:
                tensors[key] = norm(d if "_norm." in sub and "self_attn" in sub else h)
    return tensors


def write_full_size_checkpoint(directory: Path, *, with_codec: bool = True) -> Path:
    """The Higgs v3 4B shape with random bf16 weights, made on the GPU (about 8 GB in two
    shards), with a random codec of the published size unless `with_codec=False`: what the
    GPU tests and benchmarks load. A directory that already holds a checkpoint is kept."""
    if (directory / "config.json").is_file():
        return directory
    return write_checkpoint(
        directory,
        FULL_TEXT_CONFIG,
        seed=11,
        max_shard_bytes=4 << 30,
        device="cuda",
        dtype=torch.bfloat16,
        codec_config=STANDARD_CODEC_CONFIG if with_codec else None,
    )


def write_checkpoint(
    directory: Path,
    text_config: dict,
    seed: int = 0,
    *,
    max_shard_bytes: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    codec_config: dict | None = None,
) -> Path:
    """Writes config.json, tokenizer files and (possibly sharded) safetensors weights; with a
    codec config, a random codec bundled under the v3 codec prefix."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory)
    text = dict(text_config)
    text.setdefault("vocab_size", -(-vocab // 64) * 64)
    if text["vocab_size"] < vocab:
        raise ValueError(f"vocab_size {text['vocab_size']} < tokenizer size {vocab}")
    (directory / "config.json").write_text(json.dumps(make_config(text, codec_config), indent=2))
    tensors = {
        k: v.contiguous().cpu() for k, v in random_weights(text, seed, device, dtype).items()
    }
    if codec_config is not None:
        codec = random_codec_weights(codec_config, seed + 1)
        tensors.update({CODEC_PREFIX + k: v for k, v in codec.items()})
    _save_shards(directory, tensors, max_shard_bytes)
    return directory


def _save_shards(directory: Path, tensors: dict[str, torch.Tensor], max_bytes: int | None) -> None:
    if max_bytes is None:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update({k: name for k in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def default_model_dir(cache_root: Path | None = None) -> Path:
    """The embedded default checkpoint, written on first use (atomically) and reused after."""
    root = cache_root or Path.home() / ".cache" / "clonecast"
    target = root / f"default-model-{DEFAULT_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".default-model-", dir=root))
    try:
        write_checkpoint(tmp, TINY_TEXT_CONFIG, seed=1234, codec_config=TINY_CODEC_CONFIG)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
