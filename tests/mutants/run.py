"""Mutation check: applies each known mutant (tests/mutants/catalog.py) to a scratch copy of
the tree, one at a time, runs the fast tests that should catch it and prints a table. First
the same tests run on an unmutated copy: a test that fails there would "catch" anything.

    .venv/bin/python tests/mutants/run.py              # every mutant, two at a time
    .venv/bin/python tests/mutants/run.py seed-ignored --jobs 1
    .venv/bin/python tests/mutants/run.py --list

Exit status 0 when every mutant was caught and the clean runs passed; 1 otherwise. A result
is `caught` (its tests failed), `SURVIVED` (they passed), `stale` (the mutated text is not in
the file exactly once: update the catalog) or `error` (pytest could not run them).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.mutants.catalog import MUTANTS, Mutant  # noqa: E402

TIMEOUT_S = 600  # one pytest run; a hang is reported as an error, not as caught


@dataclass
class Outcome:
    result: str
    seconds: float
    detail: str = ""


def scratch_copy(dest: Path) -> None:
    """The files git would commit now (tracked, and untracked ones it does not ignore)."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def apply(tree: Path, mutant: Mutant) -> None:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise LookupError(f"{mutant.path}: the text to mutate occurs {count} times, not once")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(tree: Path, tests: tuple[str, ...]) -> Outcome:
    path = os.pathsep.join([str(tree), str(tree / "clients" / "python")])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    imports = "import engine, service, clonecast_client as c"
    where = subprocess.run(
        [sys.executable, "-c", f"{imports}; print(engine.__file__, service.__file__, c.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    ).stdout.split()
    if len(where) != 3 or not all(Path(p).is_relative_to(tree) for p in where):
        return Outcome("error", 0.0, f"the packages load from elsewhere: {where}")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Outcome("error", time.monotonic() - t0, f"timed out after {TIMEOUT_S} s")
    seconds = time.monotonic() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    if proc.returncode == 0:
        return Outcome("passed", seconds)
    if proc.returncode == 1:
        return Outcome("failed", seconds, failed[0] if failed else "")
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return Outcome("error", seconds, f"pytest exit {proc.returncode}: {tail[0]}")


def in_scratch(mutant: Mutant | None, tests: tuple[str, ...]) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="clonecast-mutant-") as tmp:
        tree = Path(tmp)
        scratch_copy(tree)
        if mutant is not None:
            try:
                apply(tree, mutant)
            except LookupError as exc:
                return Outcome("stale", 0.0, str(exc))
        return run_tests(tree, tests)


def mutant_outcome(mutant: Mutant) -> Outcome:
    outcome = in_scratch(mutant, mutant.tests)
    names = {"failed": "caught", "passed": "SURVIVED"}
    return Outcome(names.get(outcome.result, outcome.result), outcome.seconds, outcome.detail)


def short(tests: tuple[str, ...]) -> str:
    return ", ".join(t.removeprefix("tests/").replace(".py::", "::") for t in tests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at once (2)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; see --list")
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.path:28s} {m.what}")
        return 0

    ok = True
    with ThreadPoolExecutor(args.jobs) as pool:
        if not args.no_baseline:
            selections = sorted({m.tests for m in chosen})
            print(f"clean tree: {len(selections)} test selections ...", flush=True)
            clean = dict(
                zip(selections, pool.map(lambda t: in_scratch(None, t), selections), strict=True)
            )
            for tests, outcome in clean.items():
                if outcome.result != "passed":
                    ok = False
                    print(f"  FAILS UNMUTATED: {short(tests)}: {outcome.result} {outcome.detail}")
        print(f"{len(chosen)} mutants ...", flush=True)
        outcomes = list(pool.map(mutant_outcome, chosen))

    print(f"\n{'mutant':34s} {'result':9s} {'s':>5s}  tests run / first failure")
    for m, outcome in zip(chosen, outcomes, strict=True):
        ok &= outcome.result == "caught"
        print(f"{m.name:34s} {outcome.result:9s} {outcome.seconds:5.0f}  {short(m.tests)}")
        if outcome.detail:
            print(f"{'':50s}-> {outcome.detail.removeprefix('tests/')}")
    caught = sum(o.result == "caught" for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} mutants caught")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
