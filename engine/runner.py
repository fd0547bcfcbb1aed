"""The model runner: turns a scheduled step into one forward pass and one sampled row per
finishing request.

Owns the device: model, KV cache, persistent input buffers (allocated once, sliced per step),
the slot-indexed delay state and sampler. Per step it fills one host staging buffer, makes one
host-to-device copy, runs the forward and the sampler, and makes the one designated
device-to-host copy of the sampled rows. Knows requests only through the scheduler's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, attention_context
from engine.block_manager import NULL_BLOCK
from engine.config import NUM_CODEBOOKS, EngineConfig
from engine.delay_state import DelayState
from engine.model import HiggsModel
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput


@dataclass
class SampledRows:
    """Host result of one step: `codes[i]` (8 ints) and `done[i]` for `requests[i]`."""

    requests: list[Request]
    codes: np.ndarray  # [R, 8] int64
    done: np.ndarray  # [R] bool


class _Layout:
    """Offsets of each input field inside the one int64 staging buffer."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int):
        sizes = {
            "token_ids": max_tokens,
            "audio_rows": max_tokens * NUM_CODEBOOKS,  # -1 at text positions
            "feedback_slot": max_tokens,  # slot whose last row is this input, else -1
            "positions": max_tokens,
            "slot_mapping": max_tokens,
            "query_start_loc": max_seqs + 1,
            "seq_lens": max_seqs,
            "logits_index": max_seqs,
            "sample_slots": max_seqs,
            "block_tables": max_seqs * max_blocks,
        }
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self.offsets[name] = (start, start + size)
            start += size
        self.total = start

    def view(self, buffer, name: str):
        start, end = self.offsets[name]
        return buffer[start:end]


class ModelRunner:
    def __init__(self, model: HiggsModel, config: EngineConfig, num_kv_blocks: int):
        self.model = model
        self.config = config
        cfg = model.config
        self.device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        self.kv_caches = [
            torch.zeros(
                2,
                num_kv_blocks,
                config.block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=dtype,
                device=self.device,
            )
            for _ in range(cfg.num_layers)
        ]
        self.max_blocks = config.max_blocks_per_seq
        self.layout = _Layout(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks)
        pin = self.device.type == "cuda"
        self.host = torch.zeros(self.layout.total, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.inputs = (
            self.host
            if self.device.type == "cpu"
            else torch.zeros_like(self.host, device=self.device)
        )
        self.out_host = torch.zeros(
            config.max_num_seqs, NUM_CODEBOOKS + 1, dtype=torch.long, pin_memory=pin
        )
        self.delay = DelayState(config.max_num_seqs, self.device)
        self.sampler = Sampler(config.max_num_seqs, self.device)
        self._prompt_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.graphs = None  # a CudaGraphs once captured (CUDA and the Triton backend only)
        # Recorded after each host-to-device copy: the staging buffer is reused next step. A
        # step that samples ends with the designated sync, which covers it; only a step without
        # sampling (pure chunked prefill) leaves the event to be waited on.
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copy_pending = False

    # -- request hooks -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Takes the request's slot: fresh delay state and its sampling parameters."""
        assert request.slot is not None
        self.delay.reset(request.slot)
        self.sampler.set_params(request.slot, request.params, request.seed)
        ids = np.asarray(request.prompt.token_ids, dtype=np.int64)
        rows = np.full((len(ids), NUM_CODEBOOKS), -1, dtype=np.int64)
        for i, row in enumerate(request.prompt.audio_rows):
            if row is not None:
                rows[i] = row
        self._prompt_arrays[request.request_id] = (ids, rows)

    def has_request(self, request: Request) -> bool:
        return request.request_id in self._prompt_arrays

    def remove_request(self, request: Request) -> None:
        self._prompt_arrays.pop(request.request_id, None)

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SampledRows:
        num_tokens, num_samples = self._prepare(sched)
        num_seqs = len(sched.chunks)
        max_query_len = max(c.num_tokens for c in sched.chunks)
        graph = None
        if self.graphs is not None:
            graph = self.graphs.lookup(num_tokens, decode_only=max_query_len == 1)
        if graph is not None:
            self._pad(num_tokens, graph.num_tokens, num_seqs, graph.num_seqs)
        self._copy_inputs()
        if graph is not None:
            hidden = graph.replay()[:num_tokens]
        else:
            max_seq_len = max(c.start + c.num_tokens for c in sched.chunks)
            hidden = self.forward(num_tokens, num_seqs, max_query_len, max_seq_len)
        sampling = [c.request for c in sched.chunks if c.samples]
        if not sampling:
            self._copy_pending = self._copied is not None
            return SampledRows([], np.zeros((0, NUM_CODEBOOKS), np.int64), np.zeros(0, bool))
        buf, lay = self.inputs, self.layout
        slots = lay.view(buf, "sample_slots")[:num_samples]
        logits = self.model.audio_logits(hidden[lay.view(buf, "logits_index")[:num_samples]])
        codes = self.sampler.sample(
            logits, self.delay.masks(slots), slots, self.delay.num_rows[slots]
        )
        self.delay.advance(slots, codes)
        return self._to_host(sampling, codes, self.delay.done[slots])

    def forward(
        self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int
    ) -> torch.Tensor:
        """Embedding and backbone over the first `num_tokens` inputs of the device buffer
        (eagerly, or while a graph is captured): hidden states `[num_tokens, H]`."""
        buf, lay = self.inputs, self.layout
        token_ids = lay.view(buf, "token_ids")[:num_tokens]
        rows = lay.view(buf, "audio_rows")[: num_tokens * NUM_CODEBOOKS].view(num_tokens, -1)
        feedback = lay.view(buf, "feedback_slot")[:num_tokens]
        # Decode inputs come from GPU-resident state, not from the host copy of the rows.
        rows = torch.where(
            feedback[:, None] >= 0, self.delay.last_codes[feedback.clamp(min=0)], rows
        )
        embeds = self.model.embed(token_ids, rows.clamp(min=0), rows[:, 0] >= 0)
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            query_start_loc=lay.view(buf, "query_start_loc")[: num_seqs + 1],
            seq_lens=lay.view(buf, "seq_lens")[:num_seqs],
            block_tables=lay.view(buf, "block_tables").view(-1, self.max_blocks)[:num_seqs],
            slot_mapping=lay.view(buf, "slot_mapping")[:num_tokens],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        with attention_context(meta):
            return self.model(embeds, lay.view(buf, "positions")[:num_tokens], self.kv_caches)

    def load_dummy_batch(self, q_lens: list[int], padded_tokens: int, padded_seqs: int) -> None:
        """Inputs for graph capture: sequences of `q_lens` new tokens with no context, every
        K/V write going to the reserved block 0."""
        lay, h = self.layout, self.host_np
        bs = self.config.block_size
        qsl, t = lay.view(h, "query_start_loc"), 0
        qsl[0] = 0
        for b, n in enumerate(q_lens):
            lay.view(h, "positions")[t : t + n] = np.arange(n)
            lay.view(h, "slot_mapping")[t : t + n] = np.arange(n) % bs + NULL_BLOCK * bs
            lay.view(h, "seq_lens")[b] = n
            t += n
            qsl[b + 1] = t
        lay.view(h, "token_ids")[:t] = 0
        lay.view(h, "audio_rows")[: t * NUM_CODEBOOKS] = -1
        lay.view(h, "feedback_slot")[:t] = -1
        lay.view(h, "block_tables")[:] = NULL_BLOCK
        self._pad(t, padded_tokens, len(q_lens), padded_seqs)
        self._copy_inputs()

    def _copy_inputs(self) -> None:
        if self.inputs is not self.host:
            self.inputs.copy_(self.host, non_blocking=True)
            self._copied.record()

    def _pad(self, num_tokens: int, padded_tokens: int, num_seqs: int, padded_seqs: int) -> None:
        """Padding rows write their K/V into the reserved block 0 and belong to no sequence;
        padding sequences have no queries, so the attention kernel skips them."""
        lay, h = self.layout, self.host_np
        t, tp = num_tokens, padded_tokens
        lay.view(h, "token_ids")[t:tp] = 0
        lay.view(h, "audio_rows")[t * NUM_CODEBOOKS : tp * NUM_CODEBOOKS] = -1
        lay.view(h, "feedback_slot")[t:tp] = -1
        lay.view(h, "positions")[t:tp] = 0
        lay.view(h, "slot_mapping")[t:tp] = NULL_BLOCK * self.config.block_size
        lay.view(h, "query_start_loc")[num_seqs + 1 : padded_seqs + 1] = t
        lay.view(h, "seq_lens")[num_seqs:padded_seqs] = 0

    def _prepare(self, sched: SchedulerOutput) -> tuple[int, int]:
        """Fills the host staging buffer for this step; returns (tokens, sampled rows)."""
        lay, h = self.layout, self.host_np
        if self._copy_pending:
            self._copied.synchronize()  # last step's copy has left the staging buffer
            self._copy_pending = False
        token_ids, positions = lay.view(h, "token_ids"), lay.view(h, "positions")
        rows = lay.view(h, "audio_rows").reshape(-1, NUM_CODEBOOKS)
        feedback, slot_mapping = lay.view(h, "feedback_slot"), lay.view(h, "slot_mapping")
        qsl, seq_lens = lay.view(h, "query_start_loc"), lay.view(h, "seq_lens")
        logits_index, sample_slots = lay.view(h, "logits_index"), lay.view(h, "sample_slots")
        tables = lay.view(h, "block_tables").reshape(-1, self.max_blocks)
        bs = self.config.block_size
        t = r = 0
        qsl[0] = 0
        for b, chunk in enumerate(sched.chunks):
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            end = start + n
            self._fill_inputs(req, start, end, token_ids[t : t + n], rows[t : t + n])
            feedback[t : t + n] = -1
            if chunk.samples and end > len(req.prompt):
                feedback[t + n - 1] = req.slot  # the row sampled last step, still on the GPU
            pos = np.arange(start, end)
            positions[t : t + n] = pos
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            slot_mapping[t : t + n] = blocks[pos // bs] * bs + pos % bs
            tables[b, : len(blocks)] = blocks
            tables[b, len(blocks) :] = NULL_BLOCK
            seq_lens[b] = end
            t += n
            qsl[b + 1] = t
            if chunk.samples:
                logits_index[r] = t - 1
                sample_slots[r] = req.slot
                r += 1
        return t, r

    def _fill_inputs(self, req: Request, start: int, end: int, ids_out, rows_out) -> None:
        ids, rows = self._prompt_arrays[req.request_id]
        p = len(ids)
        if start < p:
            k = min(end, p)
            ids_out[: k - start] = ids[start:k]
            rows_out[: k - start] = rows[start:k]
        if end > p:  # generated rows fed back as inputs (decode, or recompute after preemption)
            g0 = max(start, p)
            ids_out[g0 - start :] = 0
            rows_out[g0 - start :] = np.asarray(req.output_rows[g0 - p : end - p], dtype=np.int64)

    def _to_host(
        self, requests: list[Request], codes: torch.Tensor, done: torch.Tensor
    ) -> SampledRows:
        r = len(requests)
        packed = torch.cat([codes, done[:, None].long()], dim=1)
        out = self.out_host[:r]
        out.copy_(packed, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the one designated sync per step
        arr = out.numpy()
        return SampledRows(
            requests, arr[:, :NUM_CODEBOOKS].copy(), arr[:, NUM_CODEBOOKS].astype(bool)
        )
