"""Checkpoint loading in the real layout: sharded or not, errors naming keys, the default."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ConfigError, Engine, EngineConfig, SamplingParams
from engine.attention import TorchAttention
from engine.checkpoint_writer import TINY_TEXT_CONFIG, default_model_dir, write_checkpoint
from engine.loader import AUDIO_TABLE_KEY, CODEC_PREFIX, load_model
from engine.plan import ExecutionPlan
from engine.tokenizer import HiggsTokenizer

CPU = torch.device("cpu")


def _load(path):
    return load_model(path, TorchAttention(), CPU, torch.float32, ExecutionPlan())


def test_layout_has_399_lm_tensors_for_36_layers():
    from engine.checkpoint_writer import random_weights

    full = {
        **TINY_TEXT_CONFIG,
        "num_hidden_layers": 36,
        "hidden_size": 8,
        "head_dim": 2,
        "intermediate_size": 8,
        "vocab_size": 16,
    }
    assert len(random_weights(full, seed=0)) == 1 + 36 * 11 + 1 + 1


def test_sharded_checkpoint_loads_identically(tmp_path):
    single = write_checkpoint(tmp_path / "single", TINY_TEXT_CONFIG, seed=3)
    sharded = write_checkpoint(
        tmp_path / "sharded", TINY_TEXT_CONFIG, seed=3, max_shard_bytes=100_000
    )
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    a, _ = _load(single)
    b, _ = _load(sharded)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_fused_weights_hold_the_checkpoint_tensors(tiny_ckpt):
    model, _ = _load(tiny_ckpt)
    raw = load_file(str(tiny_ckpt / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj.weight
    q, k, v = (raw[f"body.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))
    gate_up = model.layers[2].mlp.gate_up_proj.weight
    assert torch.equal(
        gate_up,
        torch.cat(
            [raw["body.layers.2.mlp.gate_proj.weight"], raw["body.layers.2.mlp.up_proj.weight"]]
        ),
    )
    assert torch.equal(model.audio_embed.weight, raw[AUDIO_TABLE_KEY])


def _edit(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_unknown_key_is_an_error_naming_it(tiny_ckpt, tmp_path):
    bad = _edit(
        tiny_ckpt,
        tmp_path / "bad",
        lambda t: t.update({"body.layers.0.mystery.weight": torch.zeros(2)}),
    )
    with pytest.raises(ConfigError, match=r"body\.layers\.0\.mystery\.weight"):
        _load(bad)


def test_missing_key_is_an_error_naming_it(tiny_ckpt, tmp_path):
    bad = _edit(tiny_ckpt, tmp_path / "bad", lambda t: t.pop("body.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"body\.layers\.2\.mlp\.up_proj\.weight"):
        _load(bad)


def test_wrong_shape_is_an_error(tiny_ckpt, tmp_path):
    bad = _edit(
        tiny_ckpt, tmp_path / "bad", lambda t: t.update({"body.norm.weight": torch.ones(3)})
    )
    with pytest.raises(ConfigError, match="body.norm.weight"):
        _load(bad)


def test_codec_and_tied_head_keys_are_accepted(tiny_ckpt, tmp_path):
    def add(t):
        t[CODEC_PREFIX + "fc2.weight"] = torch.zeros(2, 2)
        t["tied.head.modality_heads.0.weight"] = torch.zeros(2, 2)

    ok = _edit(tiny_ckpt, tmp_path / "ok", add)
    _, codec_keys = _load(ok)
    assert codec_keys == [CODEC_PREFIX + "fc2.weight"]


def test_wrong_model_type_and_missing_config(tiny_ckpt, tmp_path):
    bad = shutil.copytree(tiny_ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="higgs_multimodal_qwen3"):
        _load(bad)
    (bad / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        _load(bad)


def test_nonexistent_path_or_offline_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a directory|neither"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(ConfigError, match="hub id"):
        Engine.from_pretrained("someone/not-a-real-higgs-model")


def test_tokenizer_resolves_the_added_tokens(tiny_ckpt, tmp_path):
    tok = HiggsTokenizer(tiny_ckpt)
    ids = [
        tok.special.tts,
        tok.special.text,
        tok.special.audio,
        tok.special.ref_audio,
        tok.special.ref_text,
    ]
    assert len(set(ids)) == 5 and all(i >= 256 for i in ids)
    assert tok.decode(tok.encode("Grüße, world")) == "Grüße, world"
    bad = shutil.copytree(tiny_ckpt, tmp_path / "bad")
    data = json.loads((bad / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|ref_text|>"]
    (bad / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="ref_text"):
        HiggsTokenizer(bad)


def test_tokenizer_remembers_texts_without_sharing_its_lists(tiny_ckpt, monkeypatch):
    import engine.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_CACHE_ENTRIES", 2)
    tok = HiggsTokenizer(tiny_ckpt)
    first = tok.encode("hello there")
    first.append(-1)  # a caller's list is its own
    assert (
        tok.encode("hello there")
        == first[:-1]
        == tok._tok.encode("hello there", add_special_tokens=False)
    )
    tok.encode("a")
    tok.encode("b")  # the oldest entry makes room
    assert list(tok._cache) == ["a", "b"]


def test_tokenizer_cache_is_safe_across_threads(tiny_ckpt, monkeypatch):
    """The event loop (checking texts) and the engine thread (building prompts) both encode;
    evicting from a full cache at the same time must not fail either of them."""
    import sys
    import threading

    import engine.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_CACHE_ENTRIES", 4)
    tok = HiggsTokenizer(tiny_ckpt)
    errors = []

    def work(prefix):
        try:
            for i in range(1500):
                tok.encode(f"{prefix} text {i}")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in ("a", "b", "c")]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [] and len(tok._cache) <= 4


def test_structural_tokens_in_text_are_rejected(tiny_ckpt):
    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=1))
    with pytest.raises(ConfigError, match="structural"):
        engine.add_request("x", "say <|audio|> now")


def test_default_model_is_written_once_and_deterministic(tmp_path):
    a = default_model_dir(tmp_path / "a")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = default_model_dir(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    engine = Engine.from_pretrained(None, EngineConfig(max_num_seqs=1), cache_dir=tmp_path / "a")
    assert engine.is_default_model
    assert len(engine.generate(["x"], params=SamplingParams(seed=1, max_rows=2))[0].rows) == 2
