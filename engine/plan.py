"""The execution plan: how the engine runs on its device (attention backend, fused kernels,
launch modes, the few-row GEMM, CUDA graphs, the codec's numerics and layout), resolved once
from the configuration and the device and handed to the model, the attention backend, the
runner and the codec in their constructors. `EngineConfig` says what to serve; the plan says
how. Every field gives the same results within rounding; the measured reasons for each
default are in docs/perf-log/.

`EngineConfig.plan_overrides` may set any field but the graph switches (which follow
`enforce_eager`): absent means "wherever it applies", a feature forced on where it cannot
apply is a ConfigError at start-up rather than a slower path taken silently. The module
imports no torch at its top (the config validates overrides through it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from engine.config import ConfigError

log = logging.getLogger("clonecast.engine")

BACKENDS = ("torch", "triton", "varlen", "flash")
DTYPES = ("float32", "bfloat16", "float16")
# Token counts of the backbone graphs (those up to the step's token budget are captured). A
# step replays the smallest that holds it, so above 64 tokens (where a GEMM's cost grows with
# its rows) they come every 16, every 32 above 512: a 246-position clone prompt beside 64
# decodes replays 320 tokens, not 512 (measured: docs/PERFORMANCE.md).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, *range(80, 513, 16), *range(544, 1025, 32))
DEFAULT_FEW_ROW_GEMM_ROWS = 16  # at 64 rows cuBLAS is faster on the H200
# fp8 weights: steps up to this many tokens take our GEMM over float8 operands, larger ones
# torch._scaled_mm. On the H200 ours is faster at every width up to 128 rows (64 rows:
# docs/perf-log/2026-12-02-session-14.md; 80-128: 2026-12-06-session-27.md), and a step of
# 64 decodes beside a short prompt (the 80-token graph) takes 0.34 ms less. Its tallest x
# tile is 128 rows (kernels/skinny_gemm.TILE_ROWS); up to 512 rows it takes them in blocks
# of 128, slower than torch._scaled_mm at every projection from 144 to 400 rows (H100,
# docs/perf-log/2026-12-07-session-34.md), so the default stays at one tile
DEFAULT_FEW_ROW_FP8_ROWS = 128
MAX_FEW_ROW_FP8_ROWS = 512  # kernels/skinny_gemm.MAX_ROWS (this module imports no torch)
# settings of how the Triton attention backend launches its kernels: refused with another
TRITON_SETTINGS = ("page_prefetch", "flat_attention_grid", "split_mixed_attention")
DEFAULT_CODEC_GRAPH_BATCH = 64  # a step rarely completes more windows
# With graphs, a step with a prompt in it replays a mixed graph, slower than the decode graph
# for the same decodes: admitting at most every 4th step while streams run gave 16% more
# audio-s/s at 256 streams (no underruns, against 5.5 a thousand chunks); at 64, +2.8% and
# first audio 1 ms later, within what single starts vary (H100, fp8, one voice, one start
# each; docs/perf-log/2026-12-06-session-28.md)
DEFAULT_ADMISSION_WAIT_STEPS = 3
FOLLOW_EAGER = ("cuda_graphs", "sampler_graphs")  # set by enforce_eager, never overridden


@dataclass(frozen=True)
class ExecutionPlan:
    """The defaults are the plain torch path (what the CPU runs)."""

    # torch: the reference; triton: our paged kernels; varlen / flash: FlashAttention (CUDA,
    # eager: no graphs)
    attention_backend: str = "torch"
    fused_ops: bool = False  # Triton norm / RoPE / SiLU in the model and Snake in the codec
    # decode-only steps of enough sequences: q/k-norm + RoPE, the K/V store and attention in
    # one launch per layer (needs fused ops and the Triton backend)
    fused_decode: bool = False
    page_prefetch: bool = False  # Triton attention reads page ids a tile ahead (pipelined)
    # Triton attention of mixed steps of more than 128 tokens launches one program per query
    # block that can exist (kernels/paged_attention.py, flat_grid), not sequences x blocks of
    # the longest query: the graph of 256 decodes beside a prompt stops launching thousands
    # of empty programs (engine/attention.py, FLAT_GRID_MIN_TOKENS). On with the Triton backend
    flat_attention_grid: bool = False
    # Triton attention of mixed steps in two launches: prompt rows in tall query tiles, decode
    # rows in the decode launch's small ones (engine/attention.py). Off until served faster
    split_mixed_attention: bool = False
    pdl: bool = False  # programmatic dependent launch of the forward's Triton kernels
    few_row_gemm_rows: int = 0  # projections of steps up to this many tokens: our GEMM
    few_row_gemm_tma: bool = False  # ... fetching tiles with TMA tensor descriptors
    # with quantization="fp8": projections of steps up to this many tokens in our GEMM over
    # float8 operands (tiles through TMA where few_row_gemm_tma applies), others _scaled_mm
    few_row_fp8_rows: int = 0
    # with quantization="fp8" on CUDA: torch._scaled_mm called with a power-of-two row count
    # (zero rows padded): once the mitigation of a served fault whose cause was the codec
    # graphs sharing the backbone's cuBLAS workspace (fixed since), kept as a fallback. Off,
    # a 272-token step multiplies 272 rows, not 512: 4-5% more audio-s/s served (H100)
    fp8_pow2_rows: bool = False
    cuda_graphs: bool = False  # FULL backbone graphs over `graph_buckets` (Triton backend)
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    sampler_graphs: bool = False  # one graph per sampler row bucket
    async_scheduling: bool = True  # step N+1 is launched before step N's rows are read
    noise_kernel: bool = False  # the sampler's noise in one Triton launch
    codec_dtype: str = "float32"  # float16 by default where the codec is autotuned
    codec_channels_last: bool = False  # codec activations in NHWC memory
    codec_graph_max_batch: int = 0  # codec graphs per batch size up to this; 0: none
    # cuDNN times its convolution algorithms for each codec graph's shape at capture, instead
    # of taking its heuristic's pick (in bf16 and fp16 NHWC 6-10x slower than fp32 at some
    # batch sizes); by default wherever codec graphs are captured, unless float32 is asked
    codec_autotune: bool = False
    # steady chunks may wait up to this many steps (0: none) to join a larger codec batch,
    # which goes as soon as it holds codec_defer_batch windows (engine/audio_output.py);
    # the audio is the same, only when its chunks are decoded moves
    codec_defer_steps: int = 0
    codec_defer_batch: int = 8
    # while streams decode, new requests are admitted at most once every N + 1 steps (0:
    # every step), so prompts that arrive close together share one mixed step: each mixed
    # step costs the decodes beside it leaving the decode graph (engine/scheduler.py); a
    # request waits up to N steps more for its first row; only prompts that compute few
    # positions are held (scheduler.HOLD_POSITIONS). Default 3 where graphs run
    admission_wait_steps: int = 0

    def describe(self) -> dict:
        """JSON-ready, for the start-up log and `/ready`."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


_FIELDS = {f.name: f for f in fields(ExecutionPlan)}


def check_overrides(overrides: Mapping[str, object], device: str) -> None:
    """What can be refused from the configuration alone (names, types, and features that
    need a GPU or another setting); the device's own capabilities are checked by `resolve`."""
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown plan override(s) {unknown}; known: {sorted(_FIELDS)}")
    follows = sorted(set(overrides) & set(FOLLOW_EAGER))
    if follows:
        raise ConfigError(f"{follows} follow enforce_eager: set that instead")
    for name, value in overrides.items():
        _check_type(name, value)
    o = overrides
    cpu = device.split(":")[0] != "cuda"  # what needs a GPU needs CUDA: not cpu, not mps
    backend = o.get("attention_backend")
    fused = o.get("fused_ops", not cpu)
    rows, tma = o.get("few_row_gemm_rows"), o.get("few_row_gemm_tma")

    refusals = (
        (
            backend in ("varlen", "flash") and cpu,
            f"attention_backend {backend!r} (FlashAttention) needs CUDA",
        ),
        (o.get("fused_ops") is True and cpu, "fused_ops needs a CUDA device"),
        (
            o.get("fused_decode") is True
            and (not fused or backend in ("torch", "varlen", "flash")),
            "fused_decode needs fused_ops and the Triton attention backend",
        ),
        *(
            (
                o.get(name) is True and backend in ("torch", "varlen", "flash"),
                f"{name} is a setting of the Triton attention backend",
            )
            for name in TRITON_SETTINGS
        ),
        (
            o.get("pdl") is True and (cpu or not fused),
            "pdl needs fused_ops on a CUDA device (compute capability 9+)",
        ),
        (
            rows is not None and not 0 <= rows <= 64,
            f"few_row_gemm_rows must be in 0..64, got {rows}",
        ),
        (bool(rows) and (cpu or not fused), "few_row_gemm_rows needs fused_ops on a CUDA device"),
        (
            not 0 <= o.get("few_row_fp8_rows", 0) <= MAX_FEW_ROW_FP8_ROWS,
            f"few_row_fp8_rows must be in 0..{MAX_FEW_ROW_FP8_ROWS}, "
            f"got {o.get('few_row_fp8_rows')}",
        ),
        (
            bool(o.get("few_row_fp8_rows")) and (cpu or not fused),
            "few_row_fp8_rows needs fused_ops on a CUDA device",
        ),
        (tma is True and (cpu or not fused), "few_row_gemm_tma needs fused_ops on a CUDA device"),
        (
            o.get("fp8_pow2_rows") is True and cpu,
            "fp8_pow2_rows is a setting of the CUDA fp8 matmul (torch._scaled_mm)",
        ),
        (
            tma is True and rows == 0,
            "few_row_gemm_tma needs the few-row GEMM (few_row_gemm_rows > 0)",
        ),
        (o.get("noise_kernel") is True and cpu, "noise_kernel needs a CUDA device"),
        (bool(o.get("codec_graph_max_batch")) and cpu, "codec graphs need a CUDA device"),
        (o.get("codec_autotune") is True and cpu, "codec_autotune needs a CUDA device"),
        (
            o.get("codec_autotune") is True and o.get("codec_graph_max_batch") == 0,
            "codec_autotune needs codec graphs (codec_graph_max_batch > 0)",
        ),
        (
            not 0 <= o.get("codec_defer_steps", 0) <= 24,
            "codec_defer_steps must be in 0..24 (fewer than a default steady chunk's 25 "
            f"rows), got {o.get('codec_defer_steps')}",
        ),
        (o.get("codec_defer_batch") == 0, "codec_defer_batch must be at least 1"),
        (
            not 0 <= o.get("admission_wait_steps", 0) <= 16,
            f"admission_wait_steps must be in 0..16, got {o.get('admission_wait_steps')}",
        ),
    )
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


def _check_type(name: str, value: object) -> None:
    kind = _FIELDS[name].type
    ok = {
        "bool": isinstance(value, bool),
        "int": type(value) is int and value >= 0,
        "str": isinstance(value, str),
        "tuple[int, ...]": isinstance(value, (tuple, list))
        and bool(value)
        and all(type(b) is int and b > 0 for b in value)
        and list(value) == sorted(set(value)),
    }[kind]
    if ok and name == "attention_backend":
        ok = value in BACKENDS
    if ok and name == "codec_dtype":
        ok = value in DTYPES
    if not ok:
        choices = {"attention_backend": BACKENDS, "codec_dtype": DTYPES}.get(name)
        want = f"one of {list(choices)}" if choices else f"a {kind}"
        if kind == "int":
            want = "an integer >= 0"
        if kind == "tuple[int, ...]":
            want = "increasing positive token counts"
        raise ConfigError(f"plan override {name} must be {want}, got {value!r}")


def resolve(config, model_config, device) -> ExecutionPlan:
    """The plan for `config` (an EngineConfig) on `device` (a torch.device) for a model of
    `model_config`'s shape; ConfigError where an override cannot apply on this device."""
    o = dict(config.plan_overrides)
    cuda = device.type == "cuda"
    graphs = cuda and not config.enforce_eager
    backend = o.get("attention_backend", "triton" if cuda else "torch")
    fused = o.get("fused_ops", cuda)
    triton = backend == "triton"
    for name in TRITON_SETTINGS:
        if o.get(name) is True and not triton:
            raise ConfigError(f"{name} is a setting of the Triton attention backend, not {backend}")
    item = resolve_dtype(config.dtype, device).itemsize  # bytes of an activation
    rows = o.get("few_row_gemm_rows", DEFAULT_FEW_ROW_GEMM_ROWS if fused else 0)
    codec_batch = o.get(
        "codec_graph_max_batch", min(config.max_num_seqs, DEFAULT_CODEC_GRAPH_BATCH)
    )
    if codec_batch and not graphs:
        if "codec_graph_max_batch" in o:
            raise ConfigError("codec_graph_max_batch needs CUDA graphs (not enforce_eager)")
        codec_batch = 0
    # autotuning happens while the codec graphs are captured: without them it cannot
    if o.get("codec_autotune") and not codec_batch:
        raise ConfigError("codec_autotune needs codec graphs (not enforce_eager)")
    # Where the codec has graphs it runs in fp16 with cuDNN's algorithms timed at capture:
    # with fp8 weights 7.5% more audio-s/s at 64 streams, for about 30 s more start-up (H100,
    # docs/perf-log/2026-12-06-session-26.md). Half precision only with the timing: cuDNN's
    # heuristic picks make some fp16 batch sizes 6-10x slower than fp32. An fp32 codec asked
    # for by name is the untimed one of before (the fast start).
    half = o.get("codec_dtype", "float16") != "float32"
    autotune = o.get("codec_autotune", bool(codec_batch) and half)
    codec_dtype = o.get("codec_dtype", "float16" if autotune else "float32")
    if cuda and codec_dtype != "float32" and not autotune:
        log.warning(
            "codec in %s without timed cuDNN algorithms (the plan's codec_autotune, with "
            "codec graphs): some batch sizes run 6-10x slower than in float32",
            codec_dtype,
        )
    return ExecutionPlan(
        attention_backend=backend,
        fused_ops=fused,
        fused_decode=o.get("fused_decode", fused and triton),
        page_prefetch=o.get("page_prefetch", triton),
        flat_attention_grid=o.get("flat_attention_grid", triton),
        split_mixed_attention=o.get("split_mixed_attention", False),
        pdl=resolve_pdl(o.get("pdl"), fused, device),
        few_row_gemm_rows=rows,
        few_row_fp8_rows=o.get(
            "few_row_fp8_rows",
            DEFAULT_FEW_ROW_FP8_ROWS if fused and config.quantization == "fp8" else 0,
        ),
        few_row_gemm_tma=resolve_tma(o.get("few_row_gemm_tma"), model_config, item, device)
        if rows or o.get("few_row_fp8_rows", fused and config.quantization == "fp8")
        else False,
        fp8_pow2_rows=o.get("fp8_pow2_rows", False),
        cuda_graphs=graphs and triton,
        graph_buckets=tuple(o.get("graph_buckets", DEFAULT_BUCKETS)),
        sampler_graphs=graphs,
        async_scheduling=o.get("async_scheduling", True),
        noise_kernel=o.get("noise_kernel", cuda),
        codec_dtype=codec_dtype,
        codec_channels_last=o.get("codec_channels_last", cuda),
        codec_graph_max_batch=codec_batch,
        codec_autotune=autotune,
        codec_defer_steps=o.get("codec_defer_steps", 0),
        codec_defer_batch=o.get("codec_defer_batch", 8),
        admission_wait_steps=o.get(
            "admission_wait_steps", DEFAULT_ADMISSION_WAIT_STEPS if graphs else 0
        ),
    )


def resolve_dtype(name: str, device):
    """EngineConfig.dtype: auto -> bfloat16 on a GPU, float32 on the CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_pdl(setting: bool | None, fused: bool, device) -> bool:
    """None -> wherever it applies; True -> required."""
    from kernels.launch import pdl_supported

    supported = fused and pdl_supported(device)
    if setting is True and not supported:
        raise ConfigError("pdl=True needs fused kernels on a GPU of compute capability 9.0+")
    return supported if setting is None else setting


def resolve_tma(setting: bool | None, model_config, item: int, device) -> bool:
    """None -> wherever it applies; True -> required. TMA tiles need compute capability 9.0+
    and every projection's input rows (of `item`-byte elements) 16-byte aligned."""
    from kernels.skinny_gemm import tma_supported

    cfg = model_config
    inputs = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    supported = tma_supported(device, item, *inputs)
    if setting is True and not supported:
        raise ConfigError(
            "few_row_gemm_tma=True needs a GPU of compute capability 9.0+ and projection "
            f"inputs of 16-byte rows (got {inputs} x {item} bytes)"
        )
    return supported if setting is None else setting
