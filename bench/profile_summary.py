"""Summarize a py-spy collapsed-stack profile: where the samples are, by own time and by inclusive time.

Run: python bench/profile_summary.py PROFILE.txt [--top 25] [--filter receivers]

Inclusive time counts a sample for every distinct function on its stack; own time only for the innermost
frame. Idle samples (the event loop's select/epoll wait) are reported apart, so the shares are of busy time.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

IDLE = re.compile(r"epoll_wait|select \(selectors|poll \(|futex")
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    file = match["file"]
    for marker in ("site-packages/", "python3.11/", "/work/main/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{match['func']} ({file})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--filter", default="", help="inclusive table only for frames containing this")
    args = parser.parse_args()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    busy = idle = 0
    for line in args.profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";")]
        if not frames or IDLE.search(stack.split(";")[-1]) or "(selectors.py" in stack:
            idle += count
            continue
        busy += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    total = busy + idle
    print(f"{args.profile}: {total} samples, {busy} busy ({busy / max(total, 1):.0%}), {idle} idle")
    print(f"\nown time (share of busy samples), top {args.top}:")
    for name, count in own.most_common(args.top):
        print(f"  {count / busy:6.1%}  {name}")
    print(f"\ninclusive time (share of busy samples), top {args.top}:")
    shown = 0
    for name, count in inclusive.most_common():
        if args.filter in name:
            print(f"  {count / busy:6.1%}  {name}")
            shown += 1
            if shown >= args.top:
                break


if __name__ == "__main__":
    main()
