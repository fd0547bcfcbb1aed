"""The Higgs v3 network: a Qwen3 decoder over packed tokens with a paged KV cache, the fused
8x1026 audio table for the summed input embedding, and the audio head tied to that table.

Owns parameters and the forward pass only: no sampling, no scheduling, no request state.
Attention goes through the backend chosen at construction and reads the step's metadata from
`attention_context`. Fused QKV and gate/up projections are built at load time.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, current_metadata
from engine.config import ModelConfig
from engine.plan import ExecutionPlan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE (rotate-half layout), cos/sin tables precomputed for every position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; computed in fp32 and rounded once, as transformers does.
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class TorchOps:
    """The decoder's elementwise steps in plain torch (CPU, and the reference on a GPU)."""

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        total = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        xf = total.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), total

    @staticmethod
    def qk_norm_rope(attn, qkv, positions, rope):
        t = qkv.shape[0]
        q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = rope(attn.q_norm(q.reshape(t, attn.num_heads, attn.head_dim)), positions)
        k = rope(attn.k_norm(k.reshape(t, attn.num_kv_heads, attn.head_dim)), positions)
        return q, k

    qk_norm_rope_store = None  # no fused K/V store: the backend's forward writes them

    # add + RMSNorm whose output only feeds a projection (engine/quantization.py's ops
    # quantize it there)
    projection_norm = add_rms_norm

    @staticmethod
    def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    @staticmethod
    def gated_linear(layer: nn.Linear, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's down projection of silu(gate) * up."""
        return F.linear(TorchOps.silu_mul(gate_up), layer.weight)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps:
    """The same steps as fused Triton kernels (kernels/norm_rope.py)."""

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from kernels.norm_rope import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)

    projection_norm = add_rms_norm

    @staticmethod
    def norm_rope_args(attn, qkv, positions, rope) -> tuple:
        weights = (attn.q_norm.weight, attn.k_norm.weight, rope.cos, rope.sin)
        return (qkv, *weights, positions, attn.num_heads, attn.num_kv_heads, attn.q_norm.eps)

    @staticmethod
    def qk_norm_rope(attn, qkv, positions, rope):
        from kernels.norm_rope import qk_norm_rope

        return qk_norm_rope(*TritonOps.norm_rope_args(attn, qkv, positions, rope))

    @staticmethod
    def qk_norm_rope_store(attn, qkv, positions, rope, kv_cache, slots):
        """q only; k and v written into `kv_cache` at `slots` by the same kernel."""
        from kernels.norm_rope import qk_norm_rope_store

        args = TritonOps.norm_rope_args(attn, qkv, positions, rope)
        return qk_norm_rope_store(*args, kv_cache, slots)

    @staticmethod
    def silu_mul(gate_up):
        from kernels.norm_rope import silu_mul

        return silu_mul(gate_up)

    linear = TorchOps.linear

    @staticmethod
    def gated_linear(layer: nn.Linear, gate_up: torch.Tensor) -> torch.Tensor:
        return F.linear(TritonOps.silu_mul(gate_up), layer.weight)


class SkinnyGemmOps(TritonOps):
    """TritonOps whose weight projections of up to `max_rows` rows run our few-row GEMM
    (kernels/skinny_gemm.py) instead of cuBLAS. The row count of a step is fixed per captured
    graph, so the choice is made once per shape."""

    def __init__(self, max_rows: int, counters: torch.Tensor, **loads):
        self.max_rows = max_rows
        self.counters = counters  # int32 zeros, shared by every launch (each leaves them zero)
        self.loads = loads  # skinny_gemm's tma

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, layer.weight)
        return self._gemm(layer, x, gated=False)

    def gated_linear(self, layer: nn.Linear, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation folded into the down projection's loads: one launch, not two."""
        if gate_up.shape[0] > self.max_rows:
            return TritonOps.gated_linear(layer, gate_up)
        return self._gemm(layer, gate_up, gated=True)

    def _gemm(self, layer: nn.Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        from kernels.skinny_gemm import skinny_gemm, skinny_tiles

        n, k = layer.weight.shape
        tiles = skinny_tiles(x.shape[0], n, k, self.loads.get("tma", False))
        return skinny_gemm(x, layer.weight, self.counters, gated=gated, **self.loads, **tiles)


def _pdl_scope(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    from kernels.launch import use_pdl

    return use_pdl(True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.backend = backend
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, kv_cache, rope: RotaryEmbedding, ops):
        qkv = ops.linear(self.qkv_proj, x)  # x: [T, H], or quantized rows (fp8 weights)
        t = qkv.shape[0]
        meta = current_metadata()
        if ops.qk_norm_rope_store is not None and self.backend.fuses_decode(meta, kv_cache):
            # one kernel: norms, RoPE, the K/V store and attention
            args = ops.norm_rope_args(self, qkv, positions, rope)
            out = self.backend.decode_fused(args, kv_cache, meta, self.scale)
        elif ops.qk_norm_rope_store is not None:  # one kernel: norms, RoPE and the K/V store
            slots = meta.slot_mapping[: meta.num_tokens]
            q = ops.qk_norm_rope_store(self, qkv, positions, rope, kv_cache, slots)
            out = self.backend.attend(q, kv_cache, meta, self.scale)
        else:
            q, k = ops.qk_norm_rope(self, qkv, positions, rope)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return ops.linear(self.o_proj, out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, ops):
        return ops.gated_linear(self.down_proj, ops.linear(self.gate_up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, rope, ops):
        """`(x, residual) -> (x, residual)`; the residual sum is carried to the next norm so
        add and norm run as one step."""
        eps = self.input_layernorm.eps
        h, residual = ops.projection_norm(x, residual, self.input_layernorm.weight, eps)
        h = self.self_attn(h, positions, kv_cache, rope, ops)
        h, residual = ops.projection_norm(h, residual, self.post_attention_layernorm.weight, eps)
        return self.mlp(h, ops), residual


class HiggsModel(nn.Module):
    """`forward(embeds [T, H], positions [T], kv_caches) -> hidden [T, H]` (after the final
    norm); `embed(...)` builds the input embeddings; `audio_logits(hidden)` -> `[R, 8, 1026]`."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, plan: ExecutionPlan):
        """`plan`: fused_ops (Triton norm / RoPE / SiLU), few_row_gemm_rows and
        few_row_gemm_tma (our GEMM for steps of up to that many tokens), pdl."""
        super().__init__()
        self.config = cfg
        self.ops = TritonOps if plan.fused_ops else TorchOps
        self.fused_ops = plan.fused_ops
        self.pdl = plan.pdl  # Triton launches use programmatic dependent launch
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if plan.few_row_gemm_rows:
            if not plan.fused_ops:
                raise ValueError("the few-row GEMM needs the fused (Triton) ops")
            # int32 zeros on the weights' device, shared by every launch (each leaves them 0)
            device = self.embed_tokens.weight.device
            counters = torch.zeros(4096, dtype=torch.int32, device=device)
            self.ops = SkinnyGemmOps(plan.few_row_gemm_rows, counters, tma=plan.few_row_gemm_tma)
        self.audio_embed = nn.Embedding(cfg.num_codebooks * cfg.codebook_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        offsets = torch.arange(cfg.num_codebooks) * cfg.codebook_size
        self.register_buffer("codebook_offsets", offsets, persistent=False)  # [8]

    def embed_audio(self, rows: torch.Tensor) -> torch.Tensor:
        """Summed audio embedding of rows `[N, 8]`, accumulated in fp32 and rounded once."""
        vectors = self.audio_embed(rows + self.codebook_offsets)  # [N, 8, H]
        return vectors.float().sum(1).to(self.audio_embed.weight.dtype)

    def embed(
        self, token_ids: torch.Tensor, audio_rows: torch.Tensor, is_audio: torch.Tensor
    ) -> torch.Tensor:
        """Input embeddings `[T, H]`: the text embedding, or the summed audio embedding of
        `audio_rows[t]` where `is_audio[t]`."""
        text = self.embed_tokens(token_ids)
        audio = self.embed_audio(audio_rows)
        return torch.where(is_audio[:, None], audio, text)

    def forward(self, embeds, positions, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        with _pdl_scope(self.pdl):
            x, residual = embeds, None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, positions, kv_cache, self.rope, self.ops)
            return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied audio head: `hidden [R, H] @ E.T` as fp32 logits `[R, 8, 1026]`."""
        logits = hidden @ self.audio_embed.weight.t()
        return logits.float().view(-1, self.config.num_codebooks, self.config.codebook_size)
