"""What the served benchmark prints: the run's identity (commit, dirty flag, GPU, clocks,
versions, non-default settings, the servers' CLONECAST_* environment), one row per start and
the pooled row per concurrency and voice pool, the share of steps per graph bucket, the ratio
to the decode-step floor and to vLLM-Omni's published figures, PASS / FAIL per target, and
VALID only when a point has at least 3 starts, a spread of audio-s/s within 5% and saturated
windows of at least 10 s."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks.floor import floor_ms

ROOT = Path(__file__).resolve().parents[1]
# vLLM-Omni's published Higgs v3 streaming throughput (audio-s/s) on one H200
VLLM_OMNI = {32: 197.88, 64: 329.59}
# docs/PERFORMANCE.md's targets per concurrency: audio-s/s at least, first audio mean and
# P95 at most (ms), underruns (None: not a target there)
TARGETS = {
    1: {"ttfa_mean": 50, "ttfa_p95": 60},
    32: {"audio_s_per_s": 400, "ttfa_mean": 80, "ttfa_p95": 120, "underruns": 0},
    64: {"audio_s_per_s": 600, "ttfa_mean": 100, "ttfa_p95": 150, "underruns": 0},
    256: {"audio_s_per_s": 1200, "ttfa_p95": 400, "underruns": 0},
}
MIN_STARTS, MAX_SPREAD, MIN_WINDOW_S = 3, 0.05, 10.0


def _run(cmd: list[str], env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def tree_id() -> str:
    """The git tree id of the files here (tracked and untracked, ignore rules applied; the
    GPU machine's wheels in .whl left out), through a throwaway index: it names the code
    that ran even where the copied .git is stale, and equals `git rev-parse COMMIT^{tree}`
    of the commit whose files these are. "?" without git."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        _run(["git", "add", "-A", "--", ".", ":(exclude).whl"], env)
        # write-tree fails (no output) where the add did not make the index
        return _run(["git", "write-tree"], env).strip()[:12] or "?"


def server_environment(env=os.environ) -> dict[str, str]:
    """The CLONECAST_* settings the benchmark's servers inherit (a lever's, say), which the
    command line does not show. A key's or secret's value is never printed, only that it
    was set, nor any URL (a voice store's postgresql:// URL may hold a password)."""

    def secret(name: str, value: str) -> bool:
        return "KEY" in name or "SECRET" in name or "://" in value

    return {
        k: "(set)" if secret(k, v) else v
        for k, v in sorted(env.items())
        if k.startswith("CLONECAST_")
    }


def identity(args, parser) -> dict:
    """Where and how this run ran."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        module = sys.modules.get(name) or __import__(name)
        versions[name] = getattr(module, "__version__", "?")
    gpu = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.limit,driver_version",
            "--format=csv,noheader",
        ]
    ).strip()
    settings = {k: v for k, v in vars(args).items() if k != "out" and parser.get_default(k) != v}
    # A copied tree (the GPU machine's) may carry a stale .git: the caller then names the
    # commit it copied, clean, in BENCH_COMMIT; the tree id names the files either way.
    given = os.environ.get("BENCH_COMMIT")
    return {
        "commit": given or _run(["git", "rev-parse", "--short", "HEAD"]).strip() or "?",
        "dirty": False
        if given
        else bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]).strip()),
        "tree": tree_id(),
        "gpu": gpu or "none (nvidia-smi absent)",
        "versions": versions,
        "settings": settings,
        "environment": server_environment(),
    }


def describe_identity(ident: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in ident["versions"].items())
    settings = ", ".join(f"{k}={v}" for k, v in ident["settings"].items()) or "defaults"
    dirty = " (dirty tree)" if ident["dirty"] else ""
    tree = f", tree {ident['tree']}" if ident.get("tree") else ""
    environment = ", ".join(f"{k}={v}" for k, v in ident.get("environment", {}).items())
    return (
        f"commit {ident['commit']}{dirty}{tree}; GPU: {ident['gpu']}; {versions}; "
        f"settings: {settings}; environment: {environment or 'none'}"
    )


def bucket_shares(step_tokens: dict, buckets: list[int]) -> dict[int | str, float]:
    """The share of launched steps that replayed each graph bucket (the smallest bucket that
    holds their tokens), and "eager" for steps larger than every bucket; from the cumulative
    histogram of step tokens (whose edges include every bucket)."""
    if not step_tokens or not buckets:
        return {}
    total = step_tokens[max(step_tokens, key=float)]  # the +Inf bucket: every launched step
    if not total:
        return {}
    below = {float(e): n for e, n in step_tokens.items()}
    shares: dict[int | str, float] = {}
    previous = 0.0
    for b in sorted(buckets):
        if float(b) not in below:  # a bucket between two edges: its share would be a guess
            raise ValueError(f"the step-token histogram has no edge at graph bucket {b}")
        at = below[float(b)]
        shares[b] = (at - previous) / total
        previous = at
    shares["eager"] = (total - previous) / total
    return {k: v for k, v in shares.items() if v > 0}


def verdicts(c: int, pool: dict) -> list[str]:
    """PASS / FAIL per target at this concurrency."""
    out = []
    for key, bound in TARGETS.get(c, {}).items():
        value = pool[key]
        ok = value >= bound if key == "audio_s_per_s" else value <= bound
        sign = ">=" if key == "audio_s_per_s" else "<="
        out.append(f"{key} {value:.1f} {sign} {bound}: {'PASS' if ok else 'FAIL'}")
    return out


def validity(pool: dict, starts: list[dict]) -> str:
    problems = []
    if len(starts) < MIN_STARTS:
        problems.append(f"{len(starts)} starts < {MIN_STARTS}")
    low, high = pool["audio_s_per_s_range"]
    spread = (high - low) / pool["audio_s_per_s"] if pool["audio_s_per_s"] else 0.0
    if spread > MAX_SPREAD:
        problems.append(f"spread {spread:.1%} > {MAX_SPREAD:.0%}")
    short = min(s["saturated_s"] for s in starts)
    if short < MIN_WINDOW_S:
        problems.append(f"a window of {short:.1f} s < {MIN_WINDOW_S:g} s")
    return "VALID" if not problems else "NOT VALID (" + "; ".join(problems) + ")"


HEAD = "{:<9}{:>4}{:>6}{:>10}{:>15}{:>7}{:>7}{:>7}{:>7}{:>7}{:>7}{:>9}{:>8}{:>8}{:>9}{:>8}"
ROW = (
    "{:<9}{:>4}{:>6}{:>10.1f}{:>15}{:>7.2f}{:>7.1f}{:>7.1f}{:>7.1f}{:>7.1f}{:>7.1f}{:>9.2f}"
    "{:>8.0f}{:>8}{:>9.0%}{:>8.0f}"
)


def print_table(runs: dict) -> None:
    print(
        "\n"
        + HEAD.format(
            "mode",
            "C",
            "start",
            "audio-s/s",
            "min-max",
            "req/s",
            "TTFA",
            "P50",
            "P95",
            "P99",
            "step",
            "ur/1000",
            "window",
            "reqs",
            "prefix",
            "prefill",
        )
    )
    print(
        HEAD.format(
            "",
            "",
            "",
            "",
            "",
            "window",
            "mean",
            "",
            "",
            "",
            "ms",
            "chunks",
            "s",
            "",
            "hits",
            "/req",
        )  # fmt: skip
    )
    for mode, per_c in runs.items():
        for c, starts in per_c.items():
            for i, s in enumerate(starts):
                last = i == len(starts) - 1
                span = s.get("audio_s_per_s_range")
                row = (
                    mode,
                    c,
                    "pool" if last else str(i + 1),
                    s["audio_s_per_s"],
                    f"{span[0]:.0f}-{span[1]:.0f}" if span else "",
                    s["window_requests_per_s"],
                    s["ttfa_mean"],
                    s["ttfa_p50"],
                    s["ttfa_p95"],
                    s["ttfa_p99"],
                    s["step_ms"],
                    s["underruns_per_1000"],
                    s["saturated_s"],
                    s["window_requests"],
                    s["prefix_hit_share"],
                    s["prefill_per_request"],
                )
                print(ROW.format(*row))
    print()
    for mode, per_c in runs.items():
        for c, starts in per_c.items():
            pool, each = starts[-1], starts[:-1]
            line = [f"{mode} C={c}: {validity(pool, each)}"]
            if c in VLLM_OMNI:
                line.append(f"x{pool['audio_s_per_s'] / VLLM_OMNI[c]:.2f} vLLM-Omni")
            batch = min(c, 256)
            ratio = pool["step_ms"] / floor_ms(batch, 400)
            line.append(f"served step {pool['step_ms']:.2f} ms = x{ratio:.2f} batch-{batch} floor")
            line += verdicts(c, pool)
            print("; ".join(line))
            shares = bucket_shares(pool.get("step_tokens", {}), pool.get("graph_buckets", []))
            if shares:
                print(
                    "  steps per graph bucket: "
                    + ", ".join(f"{k}: {v:.1%}" for k, v in shares.items())
                )
