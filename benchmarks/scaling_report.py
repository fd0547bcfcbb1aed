"""Two GPUs against one: reads serve_bench.py's result files (`serve_bench.json`) of a
one-engine run and a two-engine run (and optionally a two-engine run without voice affinity)
and prints, per voice pool and concurrency, the pooled throughput of each and their ratio,
first audio P95 (two GPUs at C against one GPU at C/2: the goal is no worse), underruns, the
prefix-hit share with and without affinity, and how utterances spread over the engines.

    python benchmarks/scaling_report.py ONE/serve_bench.json TWO/serve_bench.json \\
        [--no-affinity TWO_NOAFF/serve_bench.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOAL_RATIO = 1.9  # at C >= 256
HEAD = "{:<6} {:>4} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>12}"


def _pooled(run: dict, c: int) -> dict | None:
    starts = run.get(str(c)) or run.get(c)
    return starts[-1] if starts else None


def _spread(summary: dict) -> str:
    """Utterances per engine as 'a/b' (affinity + least_loaded), from the routed counts."""
    routed = summary.get("routed") or {}
    per_engine: dict[str, float] = {}
    for key, count in routed.items():
        engine = key.split("/")[0]
        per_engine[engine] = per_engine.get(engine, 0.0) + count
    return "/".join(f"{per_engine[e]:.0f}" for e in sorted(per_engine)) or "-"


def rows(one: dict, two: dict, no_affinity: dict | None) -> list[tuple]:
    out = []
    for pool in [k for k in two if k.startswith("v")]:
        for c_key in two[pool]:
            c = int(c_key)
            a, b = _pooled(one.get(pool, {}), c), _pooled(two[pool], c)
            half = _pooled(one.get(pool, {}), c // 2)
            n = _pooled(no_affinity.get(pool, {}), c) if no_affinity else None
            ratio = b["audio_s_per_s"] / a["audio_s_per_s"] if a and b else None
            out.append(
                (
                    pool,
                    c,
                    a["audio_s_per_s"] if a else None,
                    b["audio_s_per_s"],
                    ratio,
                    half["ttfa_p95"] if half else None,
                    b["ttfa_p95"],
                    b["underruns_per_1000"],
                    b["prefix_hit_share"],
                    n["prefix_hit_share"] if n else None,
                    _spread(b),
                )
            )
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("one", type=Path, help="serve_bench.json of one engine on one GPU")
    ap.add_argument("two", type=Path, help="serve_bench.json of two engines on two GPUs")
    ap.add_argument("--no-affinity", type=Path, help="two engines, CLONECAST_VOICE_AFFINITY=0")
    args = ap.parse_args()
    one, two = json.loads(args.one.read_text()), json.loads(args.two.read_text())
    no_aff = json.loads(args.no_affinity.read_text()) if args.no_affinity else None
    print(
        HEAD.format(
            "pool", "C", "1 GPU", "2 GPUs", "ratio", "P95 1@C/2", "P95 2@C", "ur/1000",
            "hits", "hits-", "goal", "spread",
        )
    )  # fmt: skip
    for pool, c, a, b, ratio, p95_half, p95, ur, hits, hits_off, spread in rows(one, two, no_aff):
        goal = "-"
        if ratio is not None and c >= 256:
            goal = (
                "PASS" if ratio >= GOAL_RATIO and (p95_half is None or p95 <= p95_half) else "FAIL"
            )
        print(
            HEAD.format(
                pool, c, _fmt(a, ".1f"), _fmt(b, ".1f"), _fmt(ratio, ".2f"),
                _fmt(p95_half, ".1f"), _fmt(p95, ".1f"), _fmt(ur, ".1f"),
                _fmt(hits, ".0%"), _fmt(hits_off, ".0%"), goal, spread,
            )
        )  # fmt: skip
    print(
        f"\nratio: two-engine over one-engine audio-s/s (goal >= {GOAL_RATIO} at C >= 256 with "
        "first audio P95 no worse than one GPU at half the load); hits: prefix-hit share of "
        "prompt positions with voice affinity, hits-: without; spread: utterances per engine"
    )


if __name__ == "__main__":
    main()
