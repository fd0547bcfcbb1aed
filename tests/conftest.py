"""Shared fixtures: small random checkpoints written in the real Higgs v3 layout."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before
# triton is first imported.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.checkpoint_writer import TINY_TEXT_CONFIG, write_checkpoint

# A little wider than the embedded default so parity tests exercise GQA and several layers.
TEST_TEXT_CONFIG = {
    **TINY_TEXT_CONFIG,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


# The tiny test models run many small ops: one thread avoids pool contention on small CPUs.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _return_gpu_memory():
    """After each test that touched a GPU: what it left in reference cycles collected and the
    cached blocks returned, so no test inherits another's memory (the one place that does
    it). Added when, on an 80 GB H100, every test after the full-size bucket test (two
    engines of about 30 GB) ran out of memory; with it, every test of tests/engine and the fp8
    kernels passed on that card (docs/perf-log/2026-12-06-session-25.md)."""
    yield
    if torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _interpreter_decode_splits():
    """In Triton's CPU interpreter every program runs one after another. The split-KV decode
    target is sized for the H200 (264 programs: two per multiprocessor), which gives a decode
    launch of a few short sequences 32 splits, nearly all empty, and made the interpreted
    engine tests spend most of their time there; 16 programs still take the split path (2 to
    8 splits) and the one-pass kernel from 8 sequences and KV heads on. Kernel tests choose
    their splits explicitly and are unaffected."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from engine.attention import TritonAttention

    saved, TritonAttention.split_target = TritonAttention.split_target, 16
    yield
    TritonAttention.split_target = saved


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), TEST_TEXT_CONFIG, seed=7)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL on loopback for the whole run (tests/postgres_server.py); each test
    takes a database of its own with `postgres.new_database()`. Skips without the binaries."""
    from tests.postgres_server import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()
