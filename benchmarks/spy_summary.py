"""py-spy's collapsed stacks (`spy_on_stage.sh`) as a table: samples per thread, and per thread its frames by the
share of its samples they appear in (inclusive), most first."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def read_stacks(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames outermost first, samples) per line of a collapsed-stacks file."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if frames[0].startswith("thread"):  # py-spy --threads: "thread (id): name (target)" leads
            stacks.append((frames[0].split(": ", 1)[-1].split(" (", 1)[0], frames[1:], int(count)))
        else:
            stacks.append(("?", frames, int(count)))
    return stacks


def summary(path: Path, top: int) -> str:
    stacks = read_stacks(path)
    per_thread: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {}
    for thread, stack, count in stacks:
        per_thread[thread] += count
        counter = frames.setdefault(thread, Counter())
        for frame in set(stack):
            counter[frame] += count
    total = sum(per_thread.values()) or 1
    lines = [f"## {path.name}: {total} samples", ""]
    for thread, count in per_thread.most_common():
        lines += [f"### {thread}: {count} samples ({count / total:.0%})", ""]
        lines += [f"{n / count:6.1%}  {frame}" for frame, n in frames[thread].most_common(top)] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spy_summary", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25, help="frames per thread")
    args = parser.parse_args(argv)
    print("\n".join(summary(path, args.top) for path in args.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
