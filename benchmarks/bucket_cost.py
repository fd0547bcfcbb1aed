"""What a step of each served shape costs the GPU: D decoding sequences (each with about
`--context` positions of K/V) alone, and beside one prompt chunk of P positions, on the
full-size shape, one backbone graph replayed (the one serving would pick) or, eagerly, the
forward itself. The served benchmark prints how many steps replay each bucket (64 decodes and
a 9-position prompt replay the 80-token mixed graph; 64 and a 246-position one, 320); this
prints what each costs against the decode-only step of the same D. The D decodes alone are
also replayed through the mixed graph of their bucket: the difference between the two
decode-only rows is what leaving the decode graph costs (no fused decode attention), the
rest is the bucket's extra rows. So levers that change the mix (admitting prompts together,
our fp8 GEMM above 64 rows) can be judged before they are built.

    python benchmarks/bucket_cost.py --ckpt DIR [--decodes 64,128,256] [--prompts 0,9,25,246]
        [--context 400] [--set quantization=fp8] [--eager] [--kernels FILE]

GPU time through CUDA events around back-to-back replays; with `--eager` (or on the CPU) the
figure is the forward's wall time, launch gaps included. `--kernels FILE` adds each shape's
kernels side by side (torch.profiler, us a step), to say where a mixed step's extra time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.overrides import engine_config  # noqa: E402
from engine import Engine  # noqa: E402


def load_batch(
    runner, q_lens: list[int], ctx_lens: list[int], seed: int = 0, shared: int = 0
) -> int:
    """Puts a real-looking batch into the runner's input buffers: sequence b has `ctx_lens[b]`
    positions of K/V already (random, in pages drawn at random) and `q_lens[b]` new ones. The
    caches are filled with noise. `shared`: the first that many positions (whole pages) of
    every sequence whose context holds them are the same pages, as when every stream clones
    one voice through the prefix cache. Returns the batch's token count."""
    lay, h = runner.layout, runner.host_np
    bs = runner.config.block_size
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, runner.kv_caches[0].shape[1]))
    common = free[: shared // bs]  # the shared prefix's pages
    qsl, t, used = lay.view(h, "query_start_loc"), 0, len(common)
    tables = lay.view(h, "block_tables").reshape(-1, runner.max_blocks)
    qsl[0] = 0
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        pages = -(-(ctx + n) // bs)
        mine = len(common) if ctx >= len(common) * bs else 0  # pages taken from the prefix
        blocks = np.concatenate([common[:mine], free[used : used + pages - mine]])
        used += pages - mine
        tables[b, :pages] = blocks
        pos = np.arange(ctx, ctx + n)
        lay.view(h, "positions")[t : t + n] = pos
        lay.view(h, "slot_mapping")[t : t + n] = blocks[pos // bs] * bs + pos % bs
        lay.view(h, "token_ids")[t : t + n] = rng.integers(0, 256, n)
        lay.view(h, "seq_lens")[b] = ctx + n
        t += n
        qsl[b + 1] = t
    lay.view(h, "audio_rows")[: t * 8] = -1
    lay.view(h, "feedback_slot")[:t] = -1
    for cache in runner.kv_caches:  # float8 caches have no normal_(): through bf16
        cache.copy_(torch.randn(cache.shape, dtype=torch.bfloat16, device=cache.device))
    return t


def step_fn(runner, q_lens: list[int], ctx_lens: list[int], mixed: bool = False, shared=0):
    """(the graph replayed, e.g. "decode 64" or "mixed 80", or "eager"; a callable that runs
    the step's backbone once) for the batch, loaded into the runner's buffers. `mixed`: a
    decode-only batch through the mixed graph of its bucket, as when a prompt is beside it.
    `shared`: as load_batch's."""
    t = load_batch(runner, q_lens, ctx_lens, shared=shared)
    n, max_q = len(q_lens), max(q_lens)
    decode = max_q == 1 and not mixed
    graph = runner.graphs.lookup(t, decode_only=decode) if runner.graphs else None
    if graph is None:
        runner._copy_inputs()
        max_len = max(q + c for q, c in zip(q_lens, ctx_lens, strict=True))
        return "eager", lambda: runner.forward(t, n, max_q, max_len)
    runner._pad(t, graph.num_tokens, n, graph.num_seqs)
    runner._copy_inputs()
    kind = "decode" if decode and graph.max_query_len == 1 else "mixed"
    return f"{kind} {graph.num_tokens}", graph.replay


def time_ms(fn, device: torch.device, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean ms of `iters` back-to-back calls (GPU time through
    events on CUDA, wall time on the CPU), after two untimed calls."""
    cuda = device.type == "cuda"
    with torch.inference_mode():
        for _ in range(2):
            fn()
        means = []
        for _ in range(repeats):
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                means.append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                means.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(means)


HEADER = "{:>7} {:>6} {:>6} {:>10} {:>9} {:>14} {:>14}".format(
    "decodes", "prompt", "tokens", "graph", "ms", "+ms vs alone", "us a position"
)


def kernel_times(fn, device: torch.device, iters: int) -> dict[str, float]:
    """Microseconds per call of `fn` in each kernel it runs (on the CPU: in each leaf op),
    through torch.profiler over `iters` calls after one untimed call. Kernels of a replayed
    graph are recorded one by one."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.inference_mode():
        fn()
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        with profile(activities=[activity], acc_events=True) as p:  # one cycle: no warning
            for _ in range(iters):
                fn()
            if cuda:
                torch.cuda.synchronize()
    times = {}
    for e in p.key_averages():
        us = (e.self_device_time_total if cuda else e.self_cpu_time_total) / iters
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us
    return times


def kernel_table(shapes: list[str], times: list[dict[str, float]], top: int = 0) -> str:
    """Kernels down, shapes across, us per step; the kernels that take longest in any shape
    first (`top`: only that many), a total last. Shows what one shape runs that another
    does not, or runs slower."""
    names = sorted({k for t in times for k in t}, key=lambda k: -max(t.get(k, 0) for t in times))
    width = max(12, *(len(s) for s in shapes))
    head = f"{'kernel (us a step)':<60}" + "".join(f" {s:>{width}}" for s in shapes)
    lines = [head]
    for k in names[:top] if top else names:
        cells = "".join(f" {t.get(k, 0.0):>{width}.1f}" for t in times)
        lines.append(f"{k[:60]:<60}{cells}")
    lines.append(f"{'total':<60}" + "".join(f" {sum(t.values()):>{width}.1f}" for t in times))
    return "\n".join(lines)


def measure(
    engine,
    decodes: list[int],
    prompts: list[int],
    context: int,
    iters: int,
    out=None,
    shared=0,
    kernels: dict | None = None,
):
    """Rows of (decodes, prompt, tokens, graph, ms): for each D the decode-only step first,
    then the same decodes through the mixed graph, then beside each prompt. `out`: called
    with each row's printed line as it is measured (a run cut by its time limit keeps what
    it printed). `shared`: positions of context every decode shares (load_batch).
    `kernels`: filled with each shape's `kernel_times`, keyed "D+P graph" ("D+0 via mixed
    graph" for the decode-only batch through the mixed graph)."""
    rows = []
    for d in decodes:
        shapes = [(0, False), (0, True)] + [(p, False) for p in sorted(set(prompts) - {0})]
        for p, mixed in shapes:
            q_lens = ([p] if p else []) + [1] * d
            ctx_lens = ([0] if p else []) + [context] * d
            graph, fn = step_fn(engine.runner, q_lens, ctx_lens, mixed, shared)
            if mixed and graph == "eager":
                continue  # no graphs: the decode-only row already is this forward
            rows.append((d, p, sum(q_lens), graph, time_ms(fn, engine.device, iters)))
            if kernels is not None:
                # "via mixed": the decode-only twin, which may replay the same graph
                key = f"{d}+{p}{' via mixed' if mixed else ''} {graph}"
                kernels[key] = kernel_times(fn, engine.device, iters)
            if out:
                out(line(rows[-1], rows[_alone(rows, d)][4]))
    return rows


def _alone(rows, d: int) -> int:
    return next(i for i, r in enumerate(rows) if r[0] == d and r[1] == 0)


def line(row, alone_ms: float) -> str:
    """One row of the table: its ms and what it costs over the decode-only step of its D."""
    d, p, t, graph, ms = row
    extra = ms - alone_ms
    per = f"{extra / p * 1e3:.1f}" if p else "-"
    return f"{d:>7} {p:>6} {t:>6} {graph:>10} {ms:>9.3f} {extra:>14.3f} {per:>14}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--decodes", default="64,128,256")
    ap.add_argument("--prompts", default="0,9,25,60,246")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="positions of every decode's context in pages all decodes share (one voice "
        "through the prefix cache: its K/V read from L2 more than from DRAM)",
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="no graphs: the forward itself")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument(
        "--kernels",
        metavar="FILE",
        help="also each shape's kernels side by side (us a step, torch.profiler): the whole "
        "table to FILE, its 25 longest rows printed",
    )
    args = ap.parse_args()
    decodes = [int(x) for x in args.decodes.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    budget = max(512, max(decodes) + max(prompts))
    fields = dict(
        device=args.device,
        # the prompt's sequence beside the decodes; at least the served 256, which sizes the
        # graphs' attention grids (a graph of B tokens launches min(B, max_num_seqs) sequences)
        max_num_seqs=max(256, max(decodes) + 1),
        max_num_batched_tokens=budget,
        # pages of 16 positions: each decode's context and its new row, and the prompt's
        num_kv_blocks=max(decodes) * (args.context // 16 + 2) + max(prompts) // 16 + 64,
        enable_prefix_caching=False,
        enforce_eager=args.eager,
    )
    # the backbone only: the codec has its own benchmark (codec_throughput.py)
    plan = {"codec_graph_max_batch": 0} if args.device.startswith("cuda") else {}
    config = engine_config(fields, plan, args.set)
    bs, shared = config.block_size, args.shared_prefix
    if shared < 0 or shared % bs or shared > args.context:  # load_batch would share less
        raise SystemExit(
            f"--shared-prefix {shared}: whole pages of {bs} positions, at most --context "
            f"{args.context}"
        )
    engine = Engine.from_pretrained(args.ckpt, config)
    name = torch.cuda.get_device_name() if engine.device.type == "cuda" else "CPU"
    print(
        f"\nbackbone step per batch shape, {name}, context ~{args.context} "
        f"({shared} shared), "
        f"{' '.join(args.set) or 'default settings'}"
    )
    print(HEADER, flush=True)
    kernels = {} if args.kernels else None
    out = lambda s: print(s, flush=True)  # noqa: E731
    measure(engine, decodes, prompts, args.context, args.iters, out, shared, kernels)
    if kernels:
        shapes, times = list(kernels), list(kernels.values())
        print(f"\nkernels per shape (whole table: {args.kernels})")
        print(kernel_table(shapes, times, top=25), flush=True)  # kept if the file fails
        Path(args.kernels).write_text(kernel_table(shapes, times) + "\n")


if __name__ == "__main__":
    main()
