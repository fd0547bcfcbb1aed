"""On an NVIDIA GPU: the parity tests in bf16 against fp32 references, with the embedded-size
test model and with a full-size (Higgs v3 4B shape) random checkpoint in the real layout.

The full-size checkpoint is written once per session (about 8 GB); set CLONECAST_FULL_CKPT to
an existing directory to reuse one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.checkpoint_writer import write_full_size_checkpoint
from tests.engine.parity import HiddenRecorder, check_all_chunks
from tests.engine.reference import ReferenceModel
from tests.engine.test_parity import make_reference, run

pytestmark = pytest.mark.cuda
BF16_TOL = 3e-2
FP8_KV_TOL = 1e-1  # bf16 model with a float8 (e4m3, unscaled) KV cache


def _scenarios(engine_factory, reference, ref_len, tol=BF16_TOL):
    """Single prefill + decode, split prefill, mixed batch and a prefix-cache hit, on one engine
    per scenario; returns the worst (hidden, logits) relative errors."""
    worst = []
    e = engine_factory(max_num_batched_tokens=512)
    rec = HiddenRecorder(e)
    prompts, rows = run(e, [("a", "A single request.", None, SamplingParams(seed=1, max_rows=6))])
    worst.append(check_all_chunks(e, rec, reference, prompts, rows, tol)[:2])

    e = engine_factory(max_num_batched_tokens=64)
    rec = HiddenRecorder(e)
    voice = make_reference(3, ref_len, "a shared transcript")
    reqs = [  # p1 decodes while c0's long prompt is prefilled in chunks: mixed steps
        ("p1", "plain", None, SamplingParams(seed=3, max_rows=8)),
        ("c0", "Clone one, with a long reference.", voice, SamplingParams(seed=2, max_rows=5)),
        ("c2", "Clone two shares the voice.", voice, SamplingParams(temperature=0, max_rows=4)),
    ]
    prompts, rows = run(e, reqs[:2])
    p2, r2 = run(e, reqs[2:])  # after c0 finished: its prefix blocks are cached
    prompts.update(p2)
    rows.update(r2)
    assert e.stats.num_prefix_cached_tokens > 0
    assert any(len(c) > 1 and any(n > 1 for _, _, n in c) for c, _ in rec.steps)
    worst.append(check_all_chunks(e, rec, reference, prompts, rows, tol)[:2])
    return max(w[0] for w in worst), max(w[1] for w in worst)


def _factory(ckpt, num_kv_blocks, **fixed):
    def make(**kw):
        # Eager (graph replays do not run the forward hook the recorder uses); every replay
        # is checked against its eager twin in test_cuda_graphs.py.
        cfg = EngineConfig(
            device="cuda",
            dtype="bfloat16",
            block_size=16,
            max_num_seqs=16,
            num_kv_blocks=num_kv_blocks,
            max_model_len=4096,
            enforce_eager=True,
            **fixed,
            **kw,
        )
        return Engine.from_pretrained(ckpt, cfg)

    return make


def test_bf16_parity_small_model(tiny_ckpt):
    reference = ReferenceModel(tiny_ckpt, dtype=torch.float32, device="cuda")
    h, logits = _scenarios(_factory(tiny_ckpt, 512), reference, ref_len=40)
    print(f"small model bf16 vs fp32: worst hidden rel err {h:.2e}, logits {logits:.2e}")


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory):
    given = os.environ.get("CLONECAST_FULL_CKPT")
    path = Path(given) if given else tmp_path_factory.mktemp("full-ckpt")
    return write_full_size_checkpoint(path, with_codec=False)


def test_bf16_parity_full_size_checkpoint(full_ckpt):
    reference = ReferenceModel(full_ckpt, dtype=torch.float32, device="cuda")
    h, logits = _scenarios(_factory(full_ckpt, 1024), reference, ref_len=120)
    print(f"full-size bf16 vs fp32: worst hidden rel err {h:.2e}, logits {logits:.2e}")


def test_fp8_kv_cache_parity_full_size_checkpoint(full_ckpt):
    """The bf16 model with a float8 KV cache (`kv_cache_dtype="fp8"`) against the fp32
    reference, same scenarios: the error the cache's rounding adds, measured and bounded."""
    reference = ReferenceModel(full_ckpt, dtype=torch.float32, device="cuda")
    factory = _factory(full_ckpt, 1024, kv_cache_dtype="fp8")
    h, logits = _scenarios(factory, reference, ref_len=120, tol=FP8_KV_TOL)
    print(f"full-size bf16 + fp8 KV vs fp32: worst hidden rel err {h:.2e}, logits {logits:.2e}")
