"""The ``kvalloc`` command: a package of its own on top of pykvalloc and kvalloc_tui, which it
imports and which never import it.

Each subcommand is one module of this package with ``register(subparsers)``, which adds its
parser and sets ``run``: a function taking the parsed arguments and returning the exit status.
Every command keeps the conventions of ``CONVENTIONS``, which ``kvalloc --help`` lists.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pykvalloc import __version__, _ffi
from pykvalloc.errors import KvallocError

from . import extras


def version_text() -> str:
    """``kvalloc --version``: the package version and which library file it loads."""
    try:
        library = str(_ffi.load().path)
    except KvallocError as exc:
        library = f"not loadable: {exc}"
    return f"kvalloc (pykvalloc) {__version__}\nlibrary: {library}"


class _VersionAction(argparse.Action):
    # argparse's own "version" action formats its text when the parser is built; this one
    # looks for the library only when --version is actually asked for.
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, help="show the version and the library file in use, then exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()


CONVENTIONS = """\
conventions of every command:
  output   stdout holds the report alone, a table or, with --json, JSON (ls, dump,
           replay, bench); -o FILE writes the JSON to FILE, not to stdout
  JSON     one object: ls {"segments", "removed"}, dump the snapshot's figures,
           replay {"runs": [one per configuration]}, bench {"benchmarks": {...}}
  stderr   progress bars, status lines and "wrote FILE"; export's "serving URL"
  export   serves the metrics over HTTP; --once prints one scrape on stdout instead
  --speed  simulated seconds per second, in demo and replay alike
  errors   one line on stderr, "kvalloc COMMAND: message"; exit status 1, or 2 for
           a usage error
  extras   pip install 'pykvalloc[cli,tui]': rich for every command, Textual for top
           and the demo watched live; 'pykvalloc[plot]' for replay --plot
"""


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors take the form of every error of the command: one line,
    ``kvalloc COMMAND: message`` (``--help`` shows the usage), and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvalloc",
        description="Exercise and inspect libkvalloc KV-cache memory pools.",
        epilog=CONVENTIONS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Imported here, not with the package: they import rich, which main() checks for first.
    from . import bench, demo, dump, export, ls, replay, top

    for command in (demo, replay, bench, ls, dump, top, export):
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvalloc`` console script; returns the exit status."""
    hint = extras.install_hint(extras.RICH)
    if hint:
        print(f"kvalloc: the command {hint}", file=sys.stderr)
        return 1
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KvallocError as exc:
        print(f"kvalloc {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`kvalloc demo | head`).
        _silence_stdout()
        return 1
    except OSError as exc:
        # Output that cannot be written (a full disk, `> /dev/full`, an -o file the system
        # refuses): one line, not a traceback.
        _silence_stdout()
        print(f"kvalloc {args.command}: {exc}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Points stdout at /dev/null so that the interpreter's final flush of what could not be
    written does not fail a second time on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
