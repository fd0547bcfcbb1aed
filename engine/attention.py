"""Paged attention: the per-step metadata, the forward context that carries it, and the
backend interface with its plain torch reference implementation.

The runner builds one `AttentionMetadata` per step and sets it around the forward with
`attention_context(...)`; every layer reads it from there. Backends receive only tensors and
that metadata, never requests or the scheduler.

KV cache per layer, as every backend sees it: `[2, num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous; position p of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import ConfigError
from engine.plan import ExecutionPlan


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step. Tensors live on the model's device.

    Sequence b's query tokens are `query_start_loc[b]:query_start_loc[b+1]`; they are the
    last `q_len` positions of its `seq_lens[b]` positions. `max_query_len` sizes kernel
    launches: a captured graph freezes it (see docs/graphs.md).
    """

    num_tokens: int
    num_seqs: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64 (views of the runner's staging buffer)
    seq_lens: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64; padding rows point into block 0
    max_query_len: int
    max_seq_len: int


# Per thread: several engines (each stepping on its own thread) may share a process.
_local = threading.local()


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[None]:
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(meta)
    try:
        yield
    finally:
        stack.pop()


def current_metadata() -> AttentionMetadata:
    stack = _local.__dict__.get("stack")
    if not stack:
        raise RuntimeError("attention called outside attention_context(...)")
    return stack[-1]


class AttentionBackend(Protocol):
    """`forward` writes this step's K/V into the cache, then attends each query over its
    sequence; `attend` is the second half alone, for a model that has already written K/V
    (the fused q/k-norm+RoPE kernel stores them itself)."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...  # [T, Hq, D]

    def fuses_decode(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool: ...

    def decode_fused(
        self, norm_args: tuple, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...  # [T, Hq, D]; only called when fuses_decode() says so


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    hkv, d = kv_cache.shape[3:]
    if kv_cache.dtype == torch.float8_e4m3fn:
        # saturate as the kernels do (torch's cast gives NaN), then copy bytes: the CPU has no
        # float8 index_copy_
        top = torch.finfo(kv_cache.dtype).max
        k, v = (x.clamp(-top, top).to(kv_cache.dtype).view(torch.uint8) for x in (k, v))
        kv_cache = kv_cache.view(torch.uint8)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    flat = kv_cache.view(2, -1, hkv, d)  # a slot is one row of the flattened cache
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)  # about twice as fast as indexing (block, row)


class _StoreThenAttend:
    """`forward` of every backend: this step's K/V into the cache (`store`, the torch
    reference unless a backend has its own), then `attend`."""

    store = staticmethod(store_kv)

    def __init__(self, plan: ExecutionPlan | None = None):
        self.plan = plan or ExecutionPlan()

    def fuses_decode(self, meta, kv_cache) -> bool:
        """Whether `decode_fused` (q/k-norm + RoPE, K/V store and attention in one launch)
        serves this step; only the Triton backend has it."""
        return False

    def forward(self, q, k, v, kv_cache, meta, scale):
        self.store(k, v, kv_cache, meta.slot_mapping[: meta.num_tokens])
        return self.attend(q, kv_cache, meta, scale)


class TorchAttention(_StoreThenAttend):
    """Reference backend in plain torch: gathers each sequence's blocks into a padded batch
    and runs masked softmax attention in fp32. Works on any device and any batch; slow."""

    name = "torch"

    def attend(self, q, kv_cache, meta, scale):
        b, t = meta.num_seqs, meta.num_tokens
        hq, d = q.shape[1], q.shape[2]
        block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
        num_ctx_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:b, :num_ctx_blocks].long()
        keys = kv_cache[0][tables].reshape(b, num_ctx_blocks * block_size, hkv, d)
        values = kv_cache[1][tables].reshape(b, num_ctx_blocks * block_size, hkv, d)

        starts = meta.query_start_loc[:b].long()
        q_lens = (meta.query_start_loc[1 : b + 1] - meta.query_start_loc[:b]).long()
        steps = torch.arange(meta.max_query_len, device=q.device)
        q_valid = steps[None, :] < q_lens[:, None]  # [B, Mq]
        token_idx = torch.where(q_valid, starts[:, None] + steps[None, :], t)  # t = dummy row
        q_pad = torch.cat([q, q.new_zeros(1, hq, d)])[token_idx]  # [B, Mq, Hq, D]
        q_pos = meta.seq_lens[:b, None].long() - q_lens[:, None] + steps[None, :]
        key_pos = torch.arange(keys.shape[1], device=q.device)
        allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # causal, implies < seq_len

        group = hq // hkv
        qg = q_pad.float().view(b, -1, hkv, group, d)
        scores = torch.einsum("bmhgd,bnhd->bhgmn", qg, keys.float()) * scale
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgmn,bnhd->bmhgd", probs, values.float()).reshape(b, -1, hq, d)
        result = q.new_zeros(t + 1, hq, d)
        result[token_idx.reshape(-1)] = out.reshape(-1, hq, d).to(q.dtype)
        return result[:t]


# The flat grid's programs find their sequence by a binary search over query_start_loc: a
# few dependent loads before any work. Measured per graph (benchmarks/bucket_cost.py, H100,
# bf16 and fp8 weights): from 144 tokens on it wins in every shape, 0.07-3.1 ms a step (256
# decodes beside a clone prompt, the 512-token graph: 14.7 -> 11.6 ms with fp8); at 128 and
# fewer it loses up to 0.13 ms (64 decodes leave few empty programs to save).
FLAT_GRID_MIN_TOKENS = 129


class TritonAttention(_StoreThenAttend):
    """Our Triton paged-attention kernel: one launch for mixed prefill and decode rows (two
    with the plan's split_mixed_attention), its grid sized from `meta.max_query_len` (so graph
    capture must respect the capture bound)."""

    name = "triton"
    split_target = 264  # decode splits each context until about this many programs run

    def __init__(self, plan: ExecutionPlan | None = None):
        super().__init__(plan)
        self.fuse_decode = self.plan.fused_decode  # one launch: decode steps that do not split
        self.prefetch_pages = self.plan.page_prefetch  # page ids a tile ahead (one-pass)
        self.flat_grid = self.plan.flat_attention_grid  # mixed steps: no empty programs
        self.split_mixed = self.plan.split_mixed_attention  # mixed steps: decode rows apart

    @staticmethod
    def store(k, v, kv_cache, slots):
        from kernels.kv_store import store_kv_fused

        store_kv_fused(k, v, kv_cache, slots)

    def _splits(self, meta, kv_cache) -> int:
        from kernels.paged_decode import decode_splits

        return decode_splits(meta.num_seqs, kv_cache.shape[3], self.split_target)

    def _decode_knobs(self) -> dict:
        """Tiles of decode-only one-pass launches: with `prefetch_pages`, 32 keys a tile and
        page ids read a tile ahead, so the K/V loads are pipelined (the H200 sweep's best for
        decode; docs/perf-log/)."""
        return dict(block_n=32, num_stages=3, prefetch_pages=True) if self.prefetch_pages else {}

    def _mixed_knobs(self, num_tokens: int) -> dict:
        """Tiles of launches with prefill rows: with `prefetch_pages`, the kernel's 64-key
        tiles with page ids read a tile ahead (the H200 sweep's best for mixed steps;
        docs/perf-log/); with `flat_grid`, one program per query block that can exist, for
        steps of `FLAT_GRID_MIN_TOKENS` tokens (padded) or more."""
        knobs = dict(block_n=64, num_stages=3, prefetch_pages=True) if self.prefetch_pages else {}
        flat = self.flat_grid and num_tokens >= FLAT_GRID_MIN_TOKENS
        return knobs | ({"flat_grid": True} if flat else {})

    def fuses_decode(self, meta, kv_cache) -> bool:
        """Decode-only steps that run the one-pass kernel (enough sequences not to split)."""
        return self.fuse_decode and meta.max_query_len == 1 and self._splits(meta, kv_cache) == 1

    def decode_fused(self, norm_args, kv_cache, meta, scale):
        """`norm_args`: the q/k-norm + RoPE kernel's arguments (qkv, q and k norm weights,
        cos, sin, positions, heads, KV heads, eps); K/V stored at the step's slots."""
        from kernels.paged_attention import paged_decode_attention_fused

        slots = meta.slot_mapping[: meta.num_tokens]
        cache = (kv_cache[0], kv_cache[1], slots)
        index = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
        knobs = self._decode_knobs()
        return paged_decode_attention_fused(*norm_args, *cache, *index, scale, **knobs)

    def attend(self, q, kv_cache, meta, scale):
        from kernels.paged_attention import DECODE_ROWS, PROMPT_ROWS, paged_attention
        from kernels.paged_decode import paged_decode_attention

        knobs = self._mixed_knobs(q.shape[0])
        if meta.max_query_len == 1:  # decode only: split the context when sequences are few
            knobs = self._decode_knobs()
            splits = self._splits(meta, kv_cache)
            if splits > 1:
                return paged_decode_attention(
                    q,
                    kv_cache[0],
                    kv_cache[1],
                    meta.query_start_loc,
                    meta.seq_lens,
                    meta.block_tables,
                    scale,
                    splits,
                )
        index = (meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
        if not self.split_mixed or meta.max_query_len == 1:
            return paged_attention(q, *kv_cache, *index, meta.max_query_len, **knobs)
        # Prompt rows in tall query tiles, then decode rows in the decode launch's small ones:
        # in one launch a decode row takes a tall tile too, which does the softmax of BLOCK_M
        # rows for one and gains nothing from a float8 cache's halved bytes.
        out = paged_attention(q, *kv_cache, *index, meta.max_query_len, rows=PROMPT_ROWS, **knobs)
        knobs = self._decode_knobs()
        return paged_attention(q, *kv_cache, *index, 1, out=out, rows=DECODE_ROWS, **knobs)


class _PackedContext(_StoreThenAttend):
    """Backends whose kernel takes packed K/V, not pages: `attend` gathers each sequence's
    whole context from the cache into one packed tensor (extra reads and writes of the
    context, so these are comparison backends) and calls `_varlen` with the cumulative query
    and key lengths; causal, queries aligned to the end of their sequence. Eager only: the
    packed length changes every step, and the engine captures graphs for the Triton backend
    alone. No host sync: the packed buffer is sized by `num_seqs * max_seq_len`, sequences
    placed at the cumulative lengths computed on the device."""

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        raise NotImplementedError

    def attend(self, q, kv_cache, meta, scale):
        b, t = meta.num_seqs, meta.num_tokens
        _, _, block_size, hkv, d = kv_cache.shape
        width = meta.max_seq_len
        lens = meta.seq_lens[:b].long()
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(lens, 0, out=cu_k[1:])
        pos = torch.arange(width, device=q.device)
        valid = pos[None, :] < lens[:, None]  # [B, W]
        tables = meta.block_tables[:b, : -(-width // block_size)].long()
        blocks = tables[:, pos // block_size].reshape(-1)  # [B * W]
        rows = (pos % block_size).repeat(b)
        dest = torch.where(valid, cu_k[:b, None].long() + pos[None, :], b * width)  # spare row
        packed = kv_cache.new_empty(2, b * width + 1, hkv, d)
        packed[:, dest.reshape(-1)] = kv_cache[:, blocks, rows]
        cu_q = meta.query_start_loc[: b + 1].to(torch.int32)
        return self._varlen(
            q[:t], packed[0], packed[1], cu_q, cu_k, meta.max_query_len, width, scale
        )


class VarlenAttention(_PackedContext):
    """PyTorch's FlashAttention variable-length kernel (`torch.nn.attention.varlen`, CUDA,
    bf16/fp16; in torch 2.11 it takes packed K/V, not pages)."""

    name = "varlen"

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


class FlashAttnAttention(_PackedContext):
    """The flash-attn package's variable-length kernel (`flash_attn_varlen_func`; the optional
    `flash` extra, CUDA, bf16/fp16), on the packed context (its own paged mode needs pages of
    256 tokens). Causal masks align to the end of each sequence (flash-attn >= 2.1)."""

    name = "flash"

    def __init__(self, plan: ExecutionPlan | None = None):
        super().__init__(plan)
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as exc:
            raise ConfigError(
                "attention_backend 'flash' needs the flash-attn package "
                "(pip install 'clonecast[flash]' on a CUDA machine)"
            ) from exc
        self._kernel = flash_attn_varlen_func

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return self._kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)


BACKENDS = {
    "torch": TorchAttention,
    "triton": TritonAttention,
    "varlen": VarlenAttention,
    "flash": FlashAttnAttention,
}


def make_backend(plan: ExecutionPlan) -> AttentionBackend:
    """The plan's attention backend, set up as the plan says."""
    return BACKENDS[plan.attention_backend](plan)
