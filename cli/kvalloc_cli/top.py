"""``kvalloc top [PID|NAME]``: watch live pools in the terminal (a Textual app, ``kvalloc_tui``).

Without an argument it watches the only live pool, or offers a picker when there are several;
with none yet, it waits for one to appear. Keys: q quit, space pause, + / - refresh more / less
often (the footer shows the interval), tab next pool, p pick a pool, ? help. It reads the pools' statistics segments only; the engine is never signalled.
"""

from __future__ import annotations

import argparse
import reprlib
import sys
from typing import Any

from pykvalloc.stats import SegmentFile, find_segment, list_segments

from . import extras
from .arguments import add_command


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {reprlib.repr(text)}") from None
    if not 0.1 <= value <= 10:
        raise argparse.ArgumentTypeError("the interval must lie in [0.1, 10] seconds")
    return value


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "top", "watch live pools in the terminal", __doc__)
    parser.add_argument("target", nargs="?", metavar="PID|NAME",
                        help="the pool to watch first: its writer's pid, its name or its "
                             "segment file (default: the only live pool, or a picker)")
    parser.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes, 0.1 to 10 (default 1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    hint = extras.install_hint(extras.TEXTUAL)
    if hint:
        print(f"kvalloc top: {hint}", file=sys.stderr)
        return 1
    target: SegmentFile | None = None
    if args.target is not None:
        target = find_segment(args.target)
    else:
        list_segments()  # a segment directory that cannot be listed is an error at once
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # Without a terminal nothing could ever press q: the app would run on forever,
        # writing escape codes into whatever stdout is.
        print("kvalloc top: needs a terminal (kvalloc dump prints one snapshot)", file=sys.stderr)
        return 1
    from kvalloc_tui.app import KvallocTop  # Textual loads only for this command

    KvallocTop(target, interval=args.interval).run()
    return 0
