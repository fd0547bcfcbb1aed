"""benchmarks/scaling_report.py on result files shaped like serve_bench.py's: the ratio of
two engines over one per concurrency, first audio at C against one GPU at C/2, the spread
over engines from the routed counts, and the goal's verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pooled(audio: float, p95: float, hits: float = 0.5, routed: dict | None = None) -> list:
    summary = {
        "audio_s_per_s": audio,
        "ttfa_p95": p95,
        "underruns_per_1000": 0.0,
        "prefix_hit_share": hits,
        "routed": routed or {},
    }
    return [summary]  # one start: its pooled row is the last


def test_ratio_spread_and_verdict(tmp_path):
    one = {"v64": {"128": _pooled(400, 100), "256": _pooled(450, 200)}}
    two = {
        "v64": {
            "256": _pooled(
                880, 90, routed={"0/affinity": 60, "0/least_loaded": 70, "1/least_loaded": 126}
            ),
            "512": _pooled(900, 400),
        }
    }
    noaff = {"v64": {"256": _pooled(800, 95, hits=0.1)}}
    paths = []
    for name, data in (("one", one), ("two", two), ("noaff", noaff)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"identity": {}, **data}))
        paths.append(str(path))
    script = "benchmarks/scaling_report.py"
    command = [sys.executable, script, paths[0], paths[1], "--no-affinity", paths[2]]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    row_256 = next(line for line in out.splitlines() if line.startswith("v64") and " 256 " in line)
    fields = row_256.split()
    # 880 / 450 = 1.96 >= 1.9, and P95 90 ms on two GPUs <= 100 ms on one at C=128: PASS
    assert fields[2:5] == ["450.0", "880.0", "1.96"] and "PASS" in fields
    assert fields[-1] == "130/126" and "50%" in fields and "10%" in fields
    row_512 = next(line for line in out.splitlines() if line.startswith("v64") and " 512 " in line)
    # no one-GPU run at 512 (no ratio): no verdict; its C/2 = 256 P95 is 200 ms
    assert row_512.split()[2:5] == ["-", "900.0", "-"] and "PASS" not in row_512
