"""The benchmark's running server, found from outside for py-spy (benchmarks/gpu_check.sh):
waits until it answers /ready, then names its processes (the `service.cli` server and its
children, the engine processes) or dumps their threads, native frames included, at set
times after ready. Knows nothing of the load.

    python benchmarks/server_procs.py pid                  # the server's pid, once ready
    python benchmarks/server_procs.py dump OUT.txt 40 80   # dumps 40 and 80 s after ready
"""

from __future__ import annotations

import argparse
import subprocess
import time
import urllib.request
from pathlib import Path

PY_SPY = "/tmp/site/bin/py-spy"  # where gpu_check.sh installs the carried wheels


def wait_ready(port: int, limit_s: float = 900.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
            return True
        except OSError:
            time.sleep(1)
    return False


def server_pids(proc: Path = Path("/proc")) -> list[str]:
    """The `service.cli` processes, then their children."""
    found = {}  # pid -> (parent pid, command line)
    for p in proc.glob("[0-9]*"):
        try:  # stat's fields after the command name: state, then the parent pid
            parent = (p / "stat").read_text().rpartition(")")[2].split()[1]
            found[p.name] = (parent, (p / "cmdline").read_bytes())
        except OSError:  # gone meanwhile
            pass
    servers = [pid for pid, (_, cmd) in found.items() if b"service.cli" in cmd]
    return servers + [pid for pid, (parent, _) in found.items() if parent in servers]


def dump(out: Path, delays: list[float], ready: float) -> None:
    for delay in delays:
        time.sleep(max(0.0, ready + delay - time.time()))
        with out.open("a") as f:
            for pid in server_pids():
                f.write(f"=== {delay:.0f} s after ready, pid {pid}\n")
                f.flush()
                try:
                    subprocess.run(
                        [PY_SPY, "dump", "--native", "--pid", pid],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        timeout=60,
                    )
                except (OSError, subprocess.TimeoutExpired) as exc:  # the other dumps still run
                    f.write(f"py-spy failed: {exc}\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8790)  # serve_bench's
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("pid")
    dumps = sub.add_parser("dump")
    dumps.add_argument("out", type=Path)
    dumps.add_argument("delays", type=float, nargs="+")
    args = ap.parse_args()
    if not wait_ready(args.port):
        raise SystemExit("the server never got ready")
    if args.what == "pid":
        print(server_pids()[0] if server_pids() else "")
    else:
        dump(args.out, args.delays, time.time())


if __name__ == "__main__":
    main()
