"""The kvalloc commands' parsers and the types of their arguments: argparse calls a type on the
text given, so a bad value is a usage error naming the option (exit status 2) before anything
runs, never a traceback or a hang half way through a replay."""

from __future__ import annotations

import argparse
import math
import os
import reprlib
import sys
from pathlib import Path
from typing import Any, Callable

from pykvalloc.errors import InvalidArgument
from pykvalloc.kvcache import KVGroup, dtype_bytes
from pykvalloc.sizes import parse_size


#: The most a count of the commands may be: no token, request or byte count is wider than 64 bits.
COUNT_MAX = (1 << 64) - 1
#: The most of what the KV cache keeps in 32 bits: layers, heads, head dimension, block tokens, blocks.
U32_MAX = (1 << 32) - 1


def whole_number(most: int) -> Callable[[str], int]:
    """The type of an option taking a whole number from 1 to ``most``."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            # int() reads no more than 4,300 digits, and says so in words about itself.
            if text.strip().isdigit():
                raise argparse.ArgumentTypeError(f"must be at most {most:,}, not {reprlib.repr(text)}") from None
            raise argparse.ArgumentTypeError(f"not a whole number: {reprlib.repr(text)}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:,}, not {reprlib.repr(text)}")
        return value

    return whole


#: A count of at least 1 (requests, tokens).
positive_int = whole_number(COUNT_MAX)
#: A count the KV cache keeps in 32 bits (layers, heads, head dimension, tokens per block).
positive_int32 = whole_number(U32_MAX)


# The range of a speed or a time scale: a replay paced or scaled by 1e-320 computed "inf s"
# of simulated time (invalid JSON), or waited past what a timestamp holds (a traceback); one a
# million times slower than real time never ends either.
NUMBER_RANGE = (1e-6, 1e6)


def positive_number(text: str) -> float:
    """A finite number above 0 (a speed, a time scale), within NUMBER_RANGE. NaN and infinity
    are refused: a replay paced or scaled by either never ends."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {reprlib.repr(text)}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {reprlib.repr(text)}")
    low, high = NUMBER_RANGE
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must lie between {low:g} and {high:g}, not {reprlib.repr(text)}")
    return value


def positive_size(text: str) -> int:
    """A byte size above 0 (``parse_size``: 4096, 64K, 2G)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, not {reprlib.repr(text)}")
    return value


def kv_dtype(text: str) -> str:
    """A dtype name the KV cache knows (``kvcache.dtype_bytes``, the one table of them)."""
    try:
        dtype_bytes(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def kv_group(text: str) -> KVGroup:
    """LAYERS:KV_HEADS:HEAD_DIM[:PARTS], each a whole number of at least 1 (PARTS 1 or 2)."""
    fields = text.split(":")
    try:
        numbers = [int(field) for field in fields]
    except ValueError:
        numbers = []
    if len(numbers) not in (3, 4) or any(n < 1 or n > U32_MAX for n in numbers) or \
            (len(numbers) == 4 and numbers[3] not in (1, 2)):
        raise argparse.ArgumentTypeError(f"not LAYERS:KV_HEADS:HEAD_DIM[:PARTS] (PARTS 1 or 2): {text!r}")
    return KVGroup(*numbers)


def output_file(text: str) -> Path:
    """A file the command will write at its end: its directory must exist and be writable now,
    so that a long run does not end in a traceback (the file itself is not created yet)."""
    path = Path(text)
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no directory {directory}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a directory")
    if not os.access(directory, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return path


def usage_error(command: str, message: str) -> int:
    """Says on one line why arguments that are each valid are refused together, before anything
    runs; returns the exit status of a usage error (2, as argparse's)."""
    print(f"kvalloc {command}: {message}", file=sys.stderr)
    return 2


def add_command(subparsers: Any, name: str, summary: str, doc: str | None, *,
                after_usage: bool = True) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: ``summary`` is its line in ``kvalloc --help``, and its
    module docstring ``doc`` its own --help, from the second paragraph on when the first is its
    usage line (``after_usage``), with ``literal`` markup read as plain text, as a terminal
    shows it."""
    text = doc or ""
    if after_usage:
        text = text.split("\n\n", 1)[-1].strip()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=text.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser
