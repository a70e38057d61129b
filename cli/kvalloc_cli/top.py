"""``kvalloc top [PID|NAME]``: watch live pools in the terminal (a Textual app, ``kvalloc_tui``).

Without an argument it watches the only live pool, or offers a picker when there are several;
with none yet, it waits for one to appear. With a pid or a pool name that no pool has yet, it
waits for that pool (an engine started after its inspector), and a pool of that name started
again after its engine exited is watched in its place. Keys: q (or Ctrl-C) quit, space pause,
+ / - refresh more / less often (the footer shows the interval), tab next pool, p pick a pool,
v a KV cache's page or the pool's, up / down select a sequence (its block table shows), ? help.
It reads the pools' statistics segments only; the engine is never signalled.
"""

from __future__ import annotations

import argparse
import os
import re
import reprlib
import sys
from typing import Any

from pykvalloc.errors import SegmentNotFound
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


# What a target that is not a path may be: a pid, a pool name (the library's rule: 1 to
# KVA_NAME_MAX = 63 characters of [A-Za-z0-9_.-]) or a segment's file name, kvalloc.<pid>.<name>.
_NAMES_A_POOL = re.compile(r"[A-Za-z0-9_.-]{1,63}\Z|kvalloc\.[0-9]{1,10}\.[A-Za-z0-9_.-]{1,63}\Z")


def _target(text: str) -> str:
    """A pool to watch: a path, or a pid or name that some pool may have. Text that no pool can
    ever be named is a usage error here, rather than a wait that could never end."""
    if os.sep in text or _NAMES_A_POOL.match(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{reprlib.repr(text)} can never name a pool: a pool name is 1 to 63 characters of "
        "A-Z a-z 0-9 _ . - (or give a pid, or a segment file's path)")


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "top", "watch live pools in the terminal", __doc__)
    parser.add_argument("target", nargs="?", metavar="PID|NAME", type=_target,
                        help="the pool to watch first: its writer's pid, its name or its "
                             "segment file; a pid or name that no pool has yet is waited for "
                             "(default: the only live pool, or a picker)")
    parser.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes, 0.1 to 10 (default 1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    hint = extras.install_hint(extras.TEXTUAL)
    if hint:
        print(f"kvalloc top: {hint}", file=sys.stderr)
        return 1
    target: SegmentFile | None = None
    # A pid or name (not a path) is also watched for later: when no pool has it yet, and when
    # its engine exits and a pool of that name is started again.
    wanted = args.target if args.target is not None and os.sep not in args.target else None
    if args.target is not None:
        try:
            target = find_segment(args.target)
        except SegmentNotFound:
            if wanted is None:
                raise
    else:
        list_segments()  # a segment directory that cannot be listed is an error at once
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # Without a terminal nothing could ever press q: the app would run on forever,
        # writing escape codes into whatever stdout is.
        print("kvalloc top: needs a terminal (kvalloc dump prints one snapshot)", file=sys.stderr)
        return 1
    from kvalloc_tui.app import KvallocTop  # Textual loads only for this command

    KvallocTop(target, interval=args.interval, wanted=wanted).run()
    return 0
