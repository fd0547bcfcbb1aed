"""Every script in benchmarks/ imports on a machine without a GPU: device time is scarce, and
a script that fails at its first line (a name moved to another module) wastes a whole call."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted(p.stem for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py"))


def test_there_are_scripts_to_check():
    assert {"serve_bench", "codec_throughput", "workspace_race_probe"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_script_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__, f"benchmarks/{name}.py opens with what it measures"


def test_server_procs_names_the_server_and_its_engine_and_survives_a_missing_py_spy(
    tmp_path, monkeypatch
):
    """benchmarks/server_procs.py, against a real `clonecast serve` on the CPU: once ready it
    names the server and its engine process; a dump whose py-spy cannot run says so in the
    output file for each process and goes on to the next time."""
    import time

    from benchmarks import server_procs
    from tests.serve_process import children, start_serve, stop_serve

    server, url, _ = start_serve(tmp_path)
    try:
        assert server_procs.wait_ready(int(url.rsplit(":", 1)[1]), limit_s=10)
        pids = server_procs.server_pids()
        assert str(server.pid) in pids
        assert {str(c) for c in children(server.pid)} <= set(pids)
        assert len(pids) >= 2  # the engine runs in a process of its own
        monkeypatch.setattr(server_procs, "PY_SPY", str(tmp_path / "no-py-spy"))
        out = tmp_path / "dump.txt"
        server_procs.dump(out, [0, 0.1], time.time())
        text = out.read_text()
        headers = text.count("=== 0 s after ready")
        assert headers >= 2 * 2  # two times, server and engine at least
        assert text.count("py-spy failed") == headers  # each one said, none stopped the rest
    finally:
        stop_serve(server)


def test_bucket_cost_times_every_shape_against_its_decode_only_twin(tiny_ckpt):
    """benchmarks/bucket_cost.py on the CPU (eager forward, tiny checkpoint): one row per
    (decodes, prompt) with the decode-only step of each D first, the prompt's sequence
    holding fresh pages of its own and each decode its context's, and the table's extra cost
    reckoned against the decode-only twin of the same D."""
    import numpy as np

    from benchmarks.bucket_cost import load_batch, measure
    from engine import Engine, EngineConfig

    config = EngineConfig(max_num_seqs=9, max_num_batched_tokens=64, num_kv_blocks=256)
    engine = Engine.from_pretrained(tiny_ckpt, config)
    lines = []  # what the script prints, a line a row as measured
    rows = measure(engine, decodes=[4, 8], prompts=[5, 0], context=40, iters=2, out=lines.append)
    assert [(d, p, t, b) for d, p, t, b, _ in rows] == [
        (4, 0, 4, "eager"),
        (4, 5, 9, "eager"),
        (8, 0, 8, "eager"),
        (8, 5, 13, "eager"),
    ]
    assert all(ms > 0 for *_, ms in rows)
    assert lines[0].split()[-2:] == ["0.000", "-"]  # the decode-only row against itself
    extra = float(lines[1].split()[-2])
    assert extra == pytest.approx(rows[1][4] - rows[0][4], abs=1e-3)

    runner = engine.runner
    t = load_batch(runner, [5, 1, 1], [0, 40, 40], seed=3)
    lay, h = runner.layout, runner.host_np
    slots = lay.view(h, "slot_mapping")[:t]
    pages = slots // config.block_size
    assert t == 7 and len(set(slots)) == t and 0 not in pages  # block 0 is the reserved one
    assert list(lay.view(h, "positions")[:t]) == [0, 1, 2, 3, 4, 40, 40]
    assert list(lay.view(h, "seq_lens")[:3]) == [5, 41, 41]
    tables = lay.view(h, "block_tables").reshape(-1, runner.max_blocks)
    owned = [set(tables[b, : -(-n // config.block_size)]) for b, n in enumerate([5, 41, 41])]
    assert not (owned[0] & owned[1] or owned[1] & owned[2] or owned[0] & owned[2])
    positions = lay.view(h, "positions")[:t]
    for token, b in enumerate([0] * 5 + [1, 2]):  # each slot lies in its sequence's page
        assert pages[token] == tables[b, positions[token] // config.block_size]
    assert np.all(pages >= 1)


def test_bucket_cost_kernel_table_sets_the_shapes_side_by_side(tiny_ckpt):
    """`--kernels`: each measured shape's kernel times (on the CPU: leaf ops, us a step), one
    column a shape in the order measured; an op one shape runs and another does not reads
    0.0 there, and each column's total is the sum of its own times."""
    from benchmarks.bucket_cost import kernel_table, measure
    from engine import Engine, EngineConfig

    config = EngineConfig(max_num_seqs=9, max_num_batched_tokens=64, num_kv_blocks=256)
    engine = Engine.from_pretrained(tiny_ckpt, config)
    kernels = {}
    measure(engine, decodes=[4], prompts=[5, 0], context=40, iters=2, kernels=kernels)
    assert list(kernels) == ["4+0 eager", "4+5 eager"]
    for times in kernels.values():
        assert times and all(us > 0 for us in times.values())
        assert any("mm" in name or "linear" in name for name in times)  # the projections

    times = [{"x": 5.0, "y": 1.0}, {"y": 3.0}]
    table = kernel_table(["a", "b"], times).splitlines()
    assert table[1].split() == ["x", "5.0", "0.0"]  # longest in any shape first
    assert table[2].split() == ["y", "1.0", "3.0"]
    assert table[-1].split() == ["total", "6.0", "3.0"]
    assert len(kernel_table(["a", "b"], times, top=1).splitlines()) == 3  # head, x, total


def test_bucket_cost_shares_a_prefix_of_pages_among_the_decodes(tiny_ckpt):
    """`--shared-prefix`: every decode whose context holds the prefix reads its first pages
    from the same blocks (one voice through the prefix cache), its later pages and the slot
    of its new row its own; the prompt beside them (no context) shares nothing."""
    from benchmarks.bucket_cost import load_batch
    from engine import Engine, EngineConfig

    config = EngineConfig(max_num_seqs=9, max_num_batched_tokens=64, num_kv_blocks=256)
    engine = Engine.from_pretrained(tiny_ckpt, config)
    runner, bs = engine.runner, config.block_size
    # decodes of 40 positions, one of exactly the prefix (its new row opens a page of its
    # own), one shorter than the prefix (shares nothing)
    ctx = [0, 40, 40, 40, 2 * bs, bs]
    t = load_batch(runner, [5] + [1] * 5, ctx, seed=2, shared=2 * bs)
    lay, h = runner.layout, runner.host_np
    tables = lay.view(h, "block_tables").reshape(-1, runner.max_blocks)
    q_lens = [5] + [1] * 5
    owned = [list(tables[b, : -(-(c + q_lens[b]) // bs)]) for b, c in enumerate(ctx)]
    prefix = owned[1][:2]
    assert owned[2][:2] == owned[3][:2] == owned[4][:2] == prefix  # whole pages of the prefix
    private = [set(owned[b][2:]) for b in (1, 2, 3, 4)] + [set(owned[5]), set(owned[0])]
    for i, a in enumerate(private):  # every other page is one sequence's own
        assert not a & set(prefix) and all(not a & b for b in private[i + 1 :])
    assert 0 not in set().union(*private)
    slots = lay.view(h, "slot_mapping")[:t]
    assert len(set(slots)) == t and not set(slots // bs) & set(prefix)


@pytest.mark.parametrize("shared", ["10", "48", "-16"])
def test_bucket_cost_refuses_a_shared_prefix_it_cannot_lay_out(tiny_ckpt, monkeypatch, shared):
    """Part of a page, more than the context or negative: the run would time another layout
    than asked, so it stops first, saying what it takes."""
    from benchmarks import bucket_cost

    argv = ["bucket_cost.py", "--ckpt", str(tiny_ckpt), "--device", "cpu", "--context", "40"]
    monkeypatch.setattr("sys.argv", [*argv, "--shared-prefix", shared])
    with pytest.raises(SystemExit, match=f"--shared-prefix {shared}: whole pages of 16 "):
        bucket_cost.main()


def test_bucket_cost_replays_the_graph_serving_would_pick(tiny_ckpt, monkeypatch):
    """The graph path of benchmarks/bucket_cost.py, with the runner's graphs stood in for (no
    GPU here): decode-only batches ask for the decode graph, then the mixed graph of the same
    bucket; a prompt beside them the mixed graph; the batch is padded to the graph's tokens
    and sequences before each replay."""
    from types import SimpleNamespace

    from benchmarks.bucket_cost import measure
    from engine import Engine, EngineConfig

    engine = Engine.from_pretrained(tiny_ckpt, EngineConfig(max_num_seqs=9, num_kv_blocks=256))
    runner, asked, padded, replays = engine.runner, [], [], []

    def lookup(tokens, decode_only):
        asked.append((tokens, decode_only))
        bucket = 16 if tokens <= 16 else 32
        bound = 1 if decode_only else bucket
        return SimpleNamespace(
            num_tokens=bucket, num_seqs=9, max_query_len=bound, replay=lambda: replays.append(1)
        )

    monkeypatch.setattr(runner, "graphs", SimpleNamespace(lookup=lookup))
    monkeypatch.setattr(runner, "_pad", lambda *args: padded.append(args))
    lines = []
    rows = measure(engine, decodes=[8], prompts=[0, 12], context=40, iters=1, out=lines.append)
    assert asked == [(8, True), (8, False), (20, False)]
    assert padded == [(8, 16, 8, 9), (8, 16, 8, 9), (20, 32, 9, 9)]
    assert [r[3] for r in rows] == ["decode 16", "mixed 16", "mixed 32"]
    assert len(replays) == 3 * (2 + 5) and len(lines) == 3  # untimed twice, five repeats


def test_host_cost_simulated_times_the_served_host_work(monkeypatch, capsys):
    """benchmarks/host_cost.py --simulate: the real engine steps with the GPU's work
    replaced by waits, so the table is the host's work alone; every request keeps decoding
    (rows a step near the concurrency) and each part the served engine runs has time."""
    import re
    import sys

    from benchmarks import host_cost

    monkeypatch.setattr(
        sys, "argv", ["host_cost.py", "--concurrency", "8", "--simulate", "0", "--steps", "30"]
    )
    host_cost.main()
    out = capsys.readouterr().out
    rows = float(re.search(r"([\d.]+) rows", out).group(1))
    assert 6 <= rows <= 8  # one row a step per request, a few between finishing and refilling
    for part in ("schedule", "prepare inputs", "append rows", "audio windows + codec launch"):
        ms = float(re.search(rf"^{re.escape(part)}\s+([\d.]+) ms", out, re.M).group(1))
        assert ms > 0, part
    assert float(re.search(r"eager forward\s+([\d.]+) ms", out).group(1)) == 0.0  # simulated
