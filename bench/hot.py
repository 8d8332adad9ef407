"""Read py-spy's collapsed stacks (--format raw): where the samples are, self and inclusive.

    python -m bench.hot bench/results/profile-paced.txt [--top 25] [--match hal0d/]

Self time is the leaf frame of each sample; inclusive time counts a frame once per sample it
appears in. Frames are shown as py-spy names them: `function (file:line)`; with --by-function
the line numbers are dropped, so a function's lines add up.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def load(path: Path, by_function: bool) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if not frames or not count.isdigit():
            continue
        names = frames.split(";")
        if by_function:
            names = [_LINE.sub(")", name) for name in names]
        stacks.append((names, int(count)))
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="", help="only frames whose name contains this")
    parser.add_argument("--by-function", action="store_true")
    args = parser.parse_args()
    stacks = load(args.profile, args.by_function)
    total = sum(count for _, count in stacks) or 1
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    print(f"{args.profile}: {total} samples")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n-- {title} --")
        shown = 0
        for name, count in counter.most_common():
            if args.match not in name:
                continue
            print(f"{100 * count / total:6.1f}%  {name}")
            shown += 1
            if shown >= args.top:
                break


if __name__ == "__main__":
    main()
