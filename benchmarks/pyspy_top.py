"""Summarises a py-spy raw (collapsed-stack) file recorded with `--threads --subprocesses
--gil`: for each process and thread, the share of samples in which it held the interpreter
lock, and the functions it held it in (own time, and time inside, counting each stack once).

    python benchmarks/pyspy_top.py pyspy.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def parse(lines):
    """(process, thread, [function frames root first], samples) per stack line."""
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = next((f for f in frames if f.startswith("process ")), "process ?")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        funcs = [short(f) for f in frames if not f.startswith(("process ", "thread "))]
        yield _process_label(process), thread, funcs, int(count)


def _process_label(frame: str) -> str:
    """'process 123:"python -m service.cli serve ..."' -> 'process 123 (service.cli serve)'."""
    pid = frame.split(":", 1)[0]
    words = frame.split('"')[1].split() if '"' in frame else []
    tail = [w for w in words[1:] if not w.startswith("-")][:3]
    return f"{pid} ({' '.join(tail)})"


def short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m["file"].replace("\\", "/")
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker)[-1]
    parts = path.split("/")
    return f"{m['func']} ({'/'.join(parts[-2:])})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.path) as f:
        rows = list(parse(f))
    total = sum(n for *_, n in rows) or 1
    by_thread = collections.Counter()
    own: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    inside: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for process, thread, funcs, n in rows:
        key = (process, thread)
        by_thread[key] += n
        if funcs:
            own[key][funcs[-1]] += n
        for func in set(funcs):
            inside[key][func] += n
    print(f"{total} samples holding the interpreter lock")
    for key, n in by_thread.most_common():
        if n < 0.01 * total:
            continue
        print(f"\n== {key[0]} {key[1]}: {n} samples ({100 * n / total:.1f}% of all) ==")
        print("  own:")
        for func, k in own[key].most_common(args.top):
            print(f"    {100 * k / n:5.1f}%  {func}")
        print("  inside:")
        for func, k in inside[key].most_common(args.top):
            print(f"    {100 * k / n:5.1f}%  {func}")


if __name__ == "__main__":
    main()
