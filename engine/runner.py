"""The model runner: turns a scheduled step into one forward pass and one sampled row per
finishing request.

Owns the device: model, KV cache, persistent input buffers (allocated once, sliced per step),
the slot-indexed delay state and sampler. Per step it fills a host staging buffer, makes one
host-to-device copy, runs the forward and the sampler, and queues the one device-to-host copy
of the sampled rows; `launch()` returns without waiting, and the step's `result()` is the one
designated wait. Two staging and two result buffers alternate, so the host can fill step N+1
while the GPU still runs step N. Knows requests only through the scheduler's chunks.

Sampled rows are padded to a bucket of rows (`sample_bucket`); padding rows read hidden row 0
and sample for a reserved slot past the real ones, so the sampler (eager or a CUDA graph per
bucket) never touches a live request's state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, attention_context
from engine.block_manager import NULL_BLOCK
from engine.config import NUM_CODEBOOKS, EngineConfig
from engine.delay_state import DelayState
from engine.model import HiggsModel
from engine.plan import ExecutionPlan
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput

log = logging.getLogger("clonecast.engine")


@dataclass
class SampledRows:
    """Host result of one step: `codes[i]` (8 ints) and `done[i]` for `requests[i]`."""

    requests: list[Request]
    codes: np.ndarray  # [R, 8] int64
    done: np.ndarray  # [R] bool


class PendingStep:
    """A launched step. `result()` waits for its rows (the step's one designated wait: an
    event, not a device or stream synchronisation) and reads them from pinned memory."""

    def __init__(self, requests: list[Request], out: torch.Tensor | None, event):
        self.requests = requests
        self._out = out
        self._event = event

    def result(self) -> SampledRows:
        if self._out is None:
            return SampledRows([], np.zeros((0, NUM_CODEBOOKS), np.int64), np.zeros(0, bool))
        if self._event is not None:
            self._event.synchronize()
        arr = self._out.numpy()
        return SampledRows(
            self.requests, arr[:, :NUM_CODEBOOKS].copy(), arr[:, NUM_CODEBOOKS].astype(bool)
        )


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type (EngineConfig.kv_cache_dtype)."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else model_dtype


def auto_num_kv_blocks(config: EngineConfig, model, device: torch.device) -> int:
    """On CUDA, a fraction of free memory, but never more than every sequence at full length
    four times over (room for the prefix cache): a small model must not get millions of
    blocks. On the CPU, every sequence at full length once."""
    cfg = model.config
    elem = kv_cache_dtype(config, model.embed_tokens.weight.dtype).itemsize
    block_bytes = cfg.num_layers * 2 * config.block_size * cfg.num_kv_heads * cfg.head_dim * elem
    full = config.max_num_seqs * config.max_blocks_per_seq
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fits = int(free * config.kv_cache_memory_fraction) // block_bytes
        return max(2, min(fits, 4 * full + 1))
    return 1 + full


def sample_buckets(max_rows: int) -> tuple[int, ...]:
    """Row counts the sampler runs at: 1, 2, 4, then multiples of 8, and `max_rows`."""
    buckets = {b for b in (1, 2, 4) if b < max_rows} | set(range(8, max_rows, 8)) | {max_rows}
    return tuple(sorted(buckets))


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
            # requests admitted this step: their slots' fresh delay state and sampling
            # parameters (floats as float32 bit patterns), applied on the GPU before the step
            "new_slots": max_seqs,
            "new_seeds": max_seqs,
            "new_top_k": max_seqs,
            "new_temperature": max_seqs,
            "new_top_p": max_seqs,
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
    def __init__(
        self, model: HiggsModel, config: EngineConfig, plan: ExecutionPlan, num_kv_blocks: int
    ):
        self.model = model
        self.config = config
        self.plan = plan
        cfg = model.config
        self.device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        cache_dtype = kv_cache_dtype(config, dtype)
        shape = (2, num_kv_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(cfg.num_layers)
        ]
        log.info(
            "KV cache: %d blocks of %d positions (%d tokens), %.2f GiB of %s",
            num_kv_blocks,
            config.block_size,
            num_kv_blocks * config.block_size,
            sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**30,
            cache_dtype,
        )
        self.max_blocks = config.max_blocks_per_seq
        self.layout = _Layout(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks)
        cuda = self.device.type == "cuda"
        # Two staging buffers and two result buffers, used by alternate steps (on the CPU the
        # one staging buffer is the input buffer itself).
        first = torch.zeros(self.layout.total, dtype=torch.long, pin_memory=cuda)
        self._hosts = [first, torch.zeros_like(first).pin_memory() if cuda else first]
        self._host_nps = [h.numpy() for h in self._hosts]
        self._outs = [
            torch.zeros(config.max_num_seqs, NUM_CODEBOOKS + 1, dtype=torch.long, pin_memory=cuda)
            for _ in range(2)
        ]
        # Recorded after each host-to-device copy: a staging buffer is refilled only after
        # its last copy left it.
        self._copied = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._k = 0
        self.inputs = torch.zeros_like(first, device=self.device) if cuda else first
        self.pad_slot = config.max_num_seqs  # sampler state of padding rows
        self.delay = DelayState(config.max_num_seqs + 1, self.device)
        self.sampler = Sampler(config.max_num_seqs + 1, self.device, plan.noise_kernel)
        self.sample_buckets = sample_buckets(config.max_num_seqs)
        self.sample_hidden = torch.zeros(
            config.max_num_seqs, cfg.hidden_size, dtype=dtype, device=self.device
        )
        self._prompt_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._admitted: list[Request] = []  # slots to initialise at the next launch
        # Each slot's block table, kept in step with its request's block list (the list
        # object itself marks a new one: it is replaced on admission and on release).
        self._tables = np.full((config.max_num_seqs, self.max_blocks), NULL_BLOCK, np.int64)
        self._table_lists: list[list[int] | None] = [None] * config.max_num_seqs
        self._table_lens = [0] * config.max_num_seqs
        self.graphs = None  # a CudaGraphs once captured (plan.cuda_graphs)
        self.sampler_graphs = None  # a SamplerGraphs once captured (plan.sampler_graphs)

    def capture_graphs(self) -> list:
        """Captures the graphs the plan asks for, before any request; their reports."""
        from engine.cuda_graphs import CudaGraphs, SamplerGraphs

        reports = []
        if self.plan.cuda_graphs:
            self.graphs = CudaGraphs(self, self.plan.graph_buckets)
            reports.append(self.graphs.capture())
        if self.plan.sampler_graphs:
            self.sampler_graphs = SamplerGraphs(self)
            # Sharing the backbone pool: a sampler output may sit where a backbone graph
            # keeps temporaries. Safe because each step copies it to pinned memory before the
            # next backbone replay (same stream); nothing may read it later than that.
            pool = self.graphs.pool if self.graphs is not None else None
            reports.append(self.sampler_graphs.capture(pool))
        return reports

    @property
    def host(self) -> torch.Tensor:
        """The staging buffer of the step being prepared."""
        return self._hosts[self._k]

    @property
    def host_np(self) -> np.ndarray:
        return self._host_nps[self._k]

    # -- request hooks -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Takes the request's slot: fresh delay state and its sampling parameters, set on
        the GPU by the next `launch` for every request admitted before it at once (per
        request, element writes from Python cost about a millisecond a request on the H200
        under load)."""
        assert request.slot is not None
        self._admitted.append(request)
        ids = np.asarray(request.prompt.token_ids, dtype=np.int64)
        self._prompt_arrays[request.request_id] = (ids, request.prompt.audio_array())

    def has_request(self, request: Request) -> bool:
        return request.request_id in self._prompt_arrays

    def remove_request(self, request: Request) -> None:
        self._prompt_arrays.pop(request.request_id, None)

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queues one step on the GPU (forward, sampling, state update, the copy of the rows
        to pinned memory) and returns without waiting for it."""
        self._next_staging_buffer()
        num_tokens, num_samples = self._prepare(sched)
        num_admitted = self._stage_admitted()
        num_seqs = len(sched.chunks)
        max_query_len = max(c.num_tokens for c in sched.chunks)
        graph = None
        if self.graphs is not None:
            graph = self.graphs.lookup(num_tokens, decode_only=max_query_len == 1)
        if graph is not None:
            self._pad(num_tokens, graph.num_tokens, num_seqs, graph.num_seqs)
        self._copy_inputs()
        self._init_admitted(num_admitted)
        if graph is not None:
            hidden = graph.replay()[:num_tokens]
        else:
            max_seq_len = max(c.start + c.num_tokens for c in sched.chunks)
            hidden = self.forward(num_tokens, num_seqs, max_query_len, max_seq_len)
        sampling = [c.request for c in sched.chunks if c.samples]
        if not sampling:
            return PendingStep([], None, None)
        rows = self.sample_bucket(num_samples)
        index = self.layout.view(self.inputs, "logits_index")[:rows]
        torch.index_select(hidden, 0, index, out=self.sample_hidden[:rows])
        graph = self.sampler_graphs.get(rows) if self.sampler_graphs is not None else None
        packed = graph.replay() if graph is not None else self.sample(rows)
        out = self._outs[self._k][:rows]
        out.copy_(packed, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingStep(sampling, out[:num_samples], event)

    def _stage_admitted(self) -> int:
        """Writes the slots and sampling parameters of the requests admitted since the last
        launch into the staging buffer; returns their number."""
        admitted, self._admitted = self._admitted, []
        n = len(admitted)
        if n:
            lay, h = self.layout, self.host_np
            lay.view(h, "new_slots")[:n] = [r.slot for r in admitted]
            lay.view(h, "new_seeds")[:n] = [r.seed for r in admitted]
            lay.view(h, "new_top_k")[:n] = [Sampler.top_k_of(r.params) for r in admitted]
            for name, attr in (("new_temperature", "temperature"), ("new_top_p", "top_p")):
                floats = np.array([getattr(r.params, attr) for r in admitted], np.float32)
                lay.view(h, name)[:n] = floats.view(np.int32)
        return n

    def _init_admitted(self, n: int) -> None:
        """Fresh delay state and sampling parameters for the `n` staged slots (on the device
        buffer, so in stream order before this step's forward and sampler)."""
        if not n:
            return
        lay, buf = self.layout, self.inputs
        slots = lay.view(buf, "new_slots")[:n]
        self.delay.reset_many(slots)
        floats = [
            lay.view(buf, k)[:n].to(torch.int32).view(torch.float32)
            for k in ("new_temperature", "new_top_p")
        ]
        self.sampler.set_many(
            slots,
            floats[0],
            lay.view(buf, "new_top_k")[:n],
            floats[1],
            lay.view(buf, "new_seeds")[:n],
        )

    def sample_bucket(self, num_rows: int) -> int:
        return next(b for b in self.sample_buckets if b >= num_rows)

    def sample(self, rows: int) -> torch.Tensor:
        """Audio head, masks, sampling and state update for the first `rows` rows of
        `sample_hidden` (eagerly, or while a sampler graph is captured): `[rows, 9]` int64,
        the 8 codes and the done flag."""
        slots = self.layout.view(self.inputs, "sample_slots")[:rows]
        logits = self.model.audio_logits(self.sample_hidden[:rows])
        codes = self.sampler.sample(
            logits, self.delay.masks(slots), slots, self.delay.num_rows[slots]
        )
        self.delay.advance(slots, codes)
        return torch.cat([codes, self.delay.done[slots][:, None].long()], dim=1)

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

    def load_dummy_samples(self, rows: int) -> None:
        """Inputs for sampler-graph capture: every row samples for the padding slot."""
        lay, h = self.layout, self.host_np
        lay.view(h, "logits_index")[:rows] = 0
        lay.view(h, "sample_slots")[:rows] = self.pad_slot
        self._copy_inputs()

    def _next_staging_buffer(self) -> None:
        self._k ^= 1
        if self._copied is not None:
            self._copied[self._k].synchronize()  # its copy two steps ago has long finished

    def _copy_inputs(self) -> None:
        if self.inputs is not self.host:
            self.inputs.copy_(self.host, non_blocking=True)
            self._copied[self._k].record()

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
        """Fills the host staging buffer for this step; returns (tokens, sampled rows).
        Decode rows (one position past the prompt, sampling) are written with whole-array
        operations; prefill and recompute chunks one by one."""
        lay, h = self.layout, self.host_np
        token_ids, positions = lay.view(h, "token_ids"), lay.view(h, "positions")
        rows = lay.view(h, "audio_rows").reshape(-1, NUM_CODEBOOKS)
        feedback, slot_mapping = lay.view(h, "feedback_slot"), lay.view(h, "slot_mapping")
        qsl, seq_lens = lay.view(h, "query_start_loc"), lay.view(h, "seq_lens")
        logits_index, sample_slots = lay.view(h, "logits_index"), lay.view(h, "sample_slots")
        tables = lay.view(h, "block_tables").reshape(-1, self.max_blocks)
        bs = self.config.block_size
        chunks = sched.chunks
        num = len(chunks)
        fields = []  # flat: numpy converts a flat list in half the time of one of tuples
        put = fields.extend
        table_lists, table_lens = self._table_lists, self._table_lens
        for chunk in chunks:
            req = chunk.request
            slot, blocks = req.slot, req.block_ids
            # the slot's table row is stale only after admission or a new block (1 step in 16)
            if table_lists[slot] is not blocks or table_lens[slot] != len(blocks):
                self._sync_block_table(req)
            put((chunk.start, chunk.num_tokens, slot, chunk.samples, req.prompt_len))
        cols = np.array(fields, np.int64).reshape(num, 5).T
        starts, ns, slots, prompt_lens = cols[0], cols[1], cols[2], cols[4]
        samples = cols[3].astype(bool)
        qsl[0] = 0
        np.cumsum(ns, out=qsl[1 : num + 1])
        t = int(qsl[num])
        seq_lens[:num] = starts + ns
        # Only the table columns the sequences reach (a few dozen of max_blocks_per_seq): the
        # Triton kernels read a sequence's page ids below its length only, the torch and
        # packed backends up to the step's longest sequence with the rest masked, and the
        # columns past what is staged keep ids of earlier steps, every one a valid block.
        width = -(-int(seq_lens[:num].max()) // bs)
        tables[:num, :width] = self._tables[slots, :width]

        decode = (ns == 1) & (starts >= prompt_lens) & samples
        at, pos, dslots = qsl[:num][decode], starts[decode], slots[decode]
        token_ids[at] = 0
        rows[at] = -1  # the input row is the slot's last sampled row, on the GPU
        feedback[at] = dslots
        positions[at] = pos
        slot_mapping[at] = self._tables[dslots, pos // bs] * bs + pos % bs

        for b in np.flatnonzero(~decode).tolist():
            chunk = chunks[b]
            req, start, n, t0 = chunk.request, chunk.start, chunk.num_tokens, int(qsl[b])
            end = start + n
            self._fill_inputs(req, start, end, token_ids[t0 : t0 + n], rows[t0 : t0 + n])
            feedback[t0 : t0 + n] = -1
            if chunk.samples and end > req.prompt_len:
                feedback[t0 + n - 1] = req.slot  # the row sampled last step, still on the GPU
            p = np.arange(start, end)
            positions[t0 : t0 + n] = p
            slot_mapping[t0 : t0 + n] = self._tables[req.slot, p // bs] * bs + p % bs

        sampled = np.flatnonzero(samples)
        r = len(sampled)
        if r:
            logits_index[:r] = qsl[1 : num + 1][sampled] - 1
            sample_slots[:r] = slots[sampled]
            padded = self.sample_bucket(r)
            logits_index[r:padded] = 0
            sample_slots[r:padded] = self.pad_slot
        return t, r

    def _sync_block_table(self, req: Request) -> None:
        """Makes the slot's block-table row equal to the request's block list (which
        `_prepare` found changed): rewritten when the list is a new one (admission,
        recompute), extended when blocks were appended."""
        slot, blocks = req.slot, req.block_ids
        if self._table_lists[slot] is not blocks:
            row = self._tables[slot]
            row[: len(blocks)] = blocks
            row[len(blocks) :] = NULL_BLOCK
            self._table_lists[slot] = blocks
        else:
            self._tables[slot, self._table_lens[slot] : len(blocks)] = blocks[
                self._table_lens[slot] :
            ]
        self._table_lens[slot] = len(blocks)

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
            # A row still in flight (sampled by the step before, not read yet) is the chunk's
            # last input: it comes from the GPU-resident state (`feedback_slot`), not from here.
            known = min(end, p + len(req.output_rows))
            if known > g0:
                rows_out[g0 - start : known - start] = req.output_rows[g0 - p : known - p]
            rows_out[max(known, g0) - start :] = -1
            assert end - max(known, g0) <= 1, "at most the last input row may be in flight"
