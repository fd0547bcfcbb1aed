"""Our Triton kernels compiled for the H200 (sm_90a) on any machine, GPU or not: Triton's own
compiler and the ptxas it ships turn each launch configuration the engine uses into a cubin,
so a kernel that the Triton interpreter runs but the GPU compiler would reject fails here in
CI, before it reaches a GPU. It also reads what the compiler decided: shared memory tells
whether a loop's loads are multi-buffered (pipelined) or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compile_sm90(kernel, types: dict, constexprs: dict, num_warps=4, num_stages=3):
    """The compiled kernel for sm_90; `types`: the Triton type of each runtime argument
    (default i32); pointers and strides are taken as 16-byte aligned, as torch's are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [
        (i,)
        for i, n in enumerate(names)
        if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride"))
    ]
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={i: [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


GEMM_TYPES = {
    "x_ptr": "*bf16",
    "up_ptr": "*bf16",
    "w_ptr": "*bf16",
    "out_ptr": "*bf16",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "ws_ptr": "*fp32",  # the fp8 scales (unused with FP8 off)
    "xs_ptr": "*fp32",
}
GEMM = dict(BM=16, BN=64, BK=128, SPLIT=3, EVEN_K=True, IEEE=False, GATED=False, TMA=False)


ATTENTION_TYPES = {
    **{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "qkv_ptr", "qw_ptr", "kw_ptr")},
    # the engine passes its index tensors as int64 views of one staging buffer (runner.py)
    **{n: "*i64" for n in ("qsl_ptr", "seq_lens_ptr", "bt_ptr")},
    **{n: "*fp32" for n in ("cos_ptr", "sin_ptr")},
    **{n: "*i64" for n in ("pos_ptr", "slot_ptr")},
    "qk_scale": "fp32",
    "eps": "fp32",
}
# the batch-64 decode launch: the fused one-pass kernel at the engine's default knobs
DECODE = dict(
    G=4, D=128, PAGE=16, BLOCK_M=4, BLOCK_N=64, K_ROWS=True, HEADS_FIRST=False, FUSED=True,
    HQ=32, HKV=8, FUSED_ROWS=8, FLAT=False, PDL=True,
)  # fmt: skip
# a mixed step's launch over the flat grid (plan flat_attention_grid): 16-token query tiles
MIXED_FLAT = dict(DECODE, BLOCK_M=16, FUSED=False, FLAT=True, PREFETCH=True)

# the split-KV decode launch (batches of up to 16 sequences) at its default tiles
SPLIT_DECODE = dict(
    G=4, HQ=32, ROWS=16, D=128, PAGE=16, BLOCK_N=32, SPLITS=4, K_ROWS=False, HEADS_FIRST=False,
    PDL=True,
)  # fmt: skip
SPLIT_TYPES = {**ATTENTION_TYPES, "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32"}


H200_SHARED = 232_448  # bytes a block may use (the limit Triton's launch reports on the H200)
HIGGS_PROJECTIONS = {  # name: (N, K)
    "qkv": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
}
LOADS = {"pointer": {}, "tma": {"TMA": True}}


def _gemm_case(rows: int, n: int, k: int, gated: bool, loads: str, fp8: bool = False):
    """The few-row GEMM as `skinny_gemm` launches it for this shape (`skinny_tiles`); `fp8`:
    over float8 operands, as engine/quantization.py launches it."""
    from kernels.skinny_gemm import skinny_tiles

    tiles = skinny_tiles(rows, n, k, tma=loads == "tma", element_size=1 if fp8 else 2)
    bm, bn, bk = tiles["block_m"], tiles["block_n"], tiles["block_k"]
    constexprs = dict(
        BM=bm, BN=bn, BK=bk, SPLIT=tiles["split"], EVEN_K=k % bk == 0, IEEE=False, GATED=gated,
        TMA=False, PDL=True, FP8=fp8,
    )  # fmt: skip
    constexprs.update(LOADS[loads])
    operand = "fp8e4nv" if fp8 else "bf16"
    types = GEMM_TYPES
    if fp8:
        types = dict(types, x_ptr="*fp8e4nv", up_ptr="*fp8e4nv", w_ptr="*fp8e4nv")
    if constexprs["TMA"]:  # x, up and w come as tensor descriptors of their tiles
        x_desc = f"tensordesc<{operand}[{bm}, {bk}]>"
        w_desc = f"tensordesc<{operand}[{bn}, {bk}]>"
        types = dict(types, x_ptr=x_desc, up_ptr=x_desc, w_ptr=w_desc)
    return constexprs, types, tiles["num_warps"], tiles["num_stages"]


def _compile_cases() -> dict[str, int]:
    """Shared memory (bytes) of every case, compiled in this process (no interpreter)."""
    from kernels.paged_attention import _paged_attention_kernel
    from kernels.paged_decode import _decode_split_kernel
    from kernels.skinny_gemm import _skinny_gemm_kernel

    out = {}
    for name, (n, k) in HIGGS_PROJECTIONS.items():
        for rows in (1, 16, 64):
            for loads in LOADS:
                for gated in (False, True) if name == "down" else (False,):
                    constexprs, types, warps, stages = _gemm_case(rows, n, k, gated, loads)
                    kernel = compile_sm90(_skinny_gemm_kernel, types, constexprs, warps, stages)
                    label = f"gemm {name} rows={rows} {loads}" + " gated" * gated
                    out[label] = kernel.metadata.shared
        # fp8 weights; more than 128 rows launch the 128-row kernel over blocks of rows
        # (skinny_tiles: test_skinny_gemm.py), which compiles with M_BLOCKS a runtime value
        for rows in (16, 64, 128):
            for loads in LOADS:
                constexprs, types, warps, stages = _gemm_case(rows, n, k, False, loads, fp8=True)
                kernel = compile_sm90(_skinny_gemm_kernel, types, constexprs, warps, stages)
                out[f"fp8 gemm {name} rows={rows} {loads}"] = kernel.metadata.shared
    for prefetch in (False, True):
        for stages in (2, 3, 4):
            constexprs = {**DECODE, "PREFETCH": prefetch}
            kernel = compile_sm90(_paged_attention_kernel, ATTENTION_TYPES, constexprs, 4, stages)
            out[f"attention prefetch={prefetch} stages={stages}"] = kernel.metadata.shared
            constexprs = {**SPLIT_DECODE, "PREFETCH": prefetch}
            kernel = compile_sm90(_decode_split_kernel, SPLIT_TYPES, constexprs, 4, stages)
            out[f"split prefetch={prefetch} stages={stages}"] = kernel.metadata.shared
    fp8 = {n: "*fp8e4nv" for n in ("k_ptr", "v_ptr")}
    for prefetch in (False, True):  # a float8 cache, at the engine's decode tiles
        for name, kernel, types, constexprs in (
            ("attention", _paged_attention_kernel, ATTENTION_TYPES, DECODE | {"BLOCK_N": 32}),
            ("split", _decode_split_kernel, SPLIT_TYPES, SPLIT_DECODE),
        ):
            compiled = compile_sm90(kernel, types | fp8, constexprs | {"PREFETCH": prefetch})
            ptx = compiled.asm["ptx"]
            label = f"float8 {name} prefetch={prefetch}"
            out[f"{label} byte loads"] = ptx.count("ld.shared.b8")
            out[f"{label} fp16 mma"] = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16")
    for label, extra in (("", {}), (" one sequence", {"num_seqs": 1})):
        # Triton passes an integer argument of 1 as a constant: the search loop compiles then too
        kernel = compile_sm90(_paged_attention_kernel, ATTENTION_TYPES, MIXED_FLAT | extra, 4, 3)
        out[f"flat{label}"] = kernel.metadata.shared
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[str, int]:
    # The test session runs kernels under the Triton interpreter (no GPU here), which
    # replaces them with interpreted functions: compile in a process without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = (
        "import json, tests.kernels.test_sm90_compile as t; print(json.dumps(t._compile_cases()))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_few_row_gemm_compiles_and_fits_the_h200(compiled):
    """Every Higgs projection at 1, 16 and 64 rows, as `skinny_tiles` sets it up, with each
    load variant (and the down projection with the activation folded in): it compiles, its
    loop is multi-buffered, and its shared memory fits a block on the H200 (four stages of the
    folded down projection at 64 rows did not: caught on the GPU at `d6b32e1`; nor did an
    extra early weight buffer at 64 rows, a variant since removed: caught here)."""
    gemms = {k: v for k, v in compiled.items() if k.startswith("gemm")}
    assert len(gemms) == (4 + 1) * 3 * len(LOADS)  # (projections + down folded) x rows x loads
    too_big = {k: v for k, v in gemms.items() if v > H200_SHARED}
    assert not too_big, too_big
    # one stage of the qkv tiles at one row: [64, 128] weight + [128, 16] x, bf16 = 20,480 B
    assert gemms["gemm qkv rows=1 pointer"] >= 2 * 20_480


def test_the_fp8_gemm_compiles_and_fits_the_h200_up_to_its_row_blocks(compiled):
    """fp8 weights take our GEMM for steps of up to few_row_fp8_rows tokens (engine/plan.py),
    past 128 rows in blocks of 128: every Higgs projection at 16 to 128 rows, with each load
    variant, compiles for the H200 and fits its shared memory; 272 rows launch the very
    kernel of 128 rows (the same constants and launch settings), over three row blocks."""
    gemms = {k: v for k, v in compiled.items() if k.startswith("fp8 gemm")}
    assert len(gemms) == 4 * 3 * len(LOADS)  # projections x rows x loads
    too_big = {k: v for k, v in gemms.items() if v > H200_SHARED}
    assert not too_big, too_big
    for n, k in HIGGS_PROJECTIONS.values():
        for loads in LOADS:
            tall = _gemm_case(272, n, k, False, loads, fp8=True)
            assert tall == _gemm_case(128, n, k, False, loads, fp8=True)


def test_page_prefetch_lets_the_attention_loop_pipeline(compiled):
    """Without `prefetch_pages` the one-pass kernel's shared memory does not grow with
    num_stages: its K/V tiles are not multi-buffered (each tile's addresses wait on a page-id
    load of the same iteration; Nsight Compute read 39,168 bytes for the batch-64 launch with
    int32 index tensors, 39,424 here with the engine's int64 ones). With the page ids read a
    tile ahead, more stages mean more buffers. The index types are the engine's: with int32
    ones the prefetch compiled here but failed on the H200 (its first tile's ids, int32, and
    the loop's, int64, were one loop-carried variable)."""
    shared = {k.split(" ", 1)[1]: v for k, v in compiled.items() if k.startswith("attention")}
    assert shared["prefetch=False stages=3"] == shared["prefetch=False stages=4"] < 40_000
    assert shared["prefetch=True stages=2"] < shared["prefetch=True stages=3"]
    assert shared["prefetch=True stages=3"] < shared["prefetch=True stages=4"]


def test_the_flat_attention_grid_compiles_for_the_h200(compiled):
    """The mixed launch over the flat grid (each program finds its sequence in a loop over
    query_start_loc) compiles for sm_90, with a runtime sequence count and with the constant
    1 Triton substitutes for it, and fits a block's shared memory."""
    assert 0 < compiled["flat"] <= H200_SHARED
    assert 0 < compiled["flat one sequence"] <= H200_SHARED


def test_page_prefetch_lets_the_split_kv_loop_pipeline(compiled):
    """The split-KV decode kernel, the same way: without `prefetch_pages` more stages add
    no K/V buffers (21,504 / 22,016 / 22,016 bytes at 2 / 3 / 4 stages); with the page ids
    read a tile ahead, each stage adds its K and V tiles (32 keys x 128 x 2 x bf16)."""
    shared = {k.split(" ", 1)[1]: v for k, v in compiled.items() if k.startswith("split")}
    kv_tiles = 2 * 32 * 128 * 2
    assert shared["prefetch=False stages=3"] == shared["prefetch=False stages=4"]
    assert shared["prefetch=False stages=4"] - shared["prefetch=False stages=2"] < kv_tiles
    assert shared["prefetch=True stages=3"] - shared["prefetch=True stages=2"] >= kv_tiles
    assert shared["prefetch=True stages=4"] - shared["prefetch=True stages=3"] >= kv_tiles


def test_a_float8_cache_is_read_without_byte_loads(compiled):
    """With a float8 cache both decode kernels multiply in fp16 and stage V widened, read back
    with ldmatrix.trans: Triton's default staged float8 V and read the transposed operand a
    byte at a time (32 ld.shared.b8 a thread per 32-key tile), which the select in `_load_v`
    avoids."""
    fp8 = {k: v for k, v in compiled.items() if k.startswith("float8")}
    assert len(fp8) == 2 * 2 * 2  # kernels x prefetch x (byte loads, fp16 mma)
    assert all(v == 0 for k, v in fp8.items() if k.endswith("byte loads")), fp8
    assert all(v > 0 for k, v in fp8.items() if k.endswith("fp16 mma")), fp8
