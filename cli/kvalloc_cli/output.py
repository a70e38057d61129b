"""Where a command's report goes, the same in every command that has one (ls, dump, replay,
bench): stdout holds the report alone, a table or, with ``--json``, JSON; ``-o FILE`` writes the
JSON to FILE instead of stdout; progress and status lines go to stderr, "wrote FILE" among them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pykvalloc._strict_json import json_ready

from .arguments import output_file


def add_report_options(parser: argparse.ArgumentParser, report: str) -> None:
    """``--json`` and ``-o/--output`` for a command whose report is ``report`` ("the list")."""
    parser.add_argument("--json", action="store_true",
                        help=f"print {report} as JSON on stdout instead of the table")
    parser.add_argument("-o", "--output", type=output_file, metavar="FILE",
                        help=f"write {report} as JSON to FILE (the table still goes to stdout, "
                             "unless --json)")


def wants_table(args: argparse.Namespace) -> bool:
    """Whether the report goes to stdout as a table (no ``--json``)."""
    return not args.json


def emit_json(args: argparse.Namespace, payload: Any) -> None:
    """The report as strict JSON (a figure that is not a finite number is null: NaN and Infinity
    are not JSON) to ``-o``'s file, else to stdout with ``--json``; nowhere without either."""
    if args.output is None and not args.json:
        return
    text = json.dumps(json_ready(payload), indent=1, allow_nan=False) + "\n"
    if args.output is not None:
        Path(args.output).write_text(text)
        wrote(args.output)
    else:
        sys.stdout.write(text)


def wrote(path: str | Path) -> None:
    """Says on stderr that the command wrote a file."""
    print(f"wrote {path}", file=sys.stderr)
