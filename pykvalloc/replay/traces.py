"""Readers for the two public LLM-serving trace formats.

- The Azure LLM inference trace (CSV): ``TIMESTAMP,ContextTokens,GeneratedTokens``, one request a
  row, timestamps as ``YYYY-MM-DD HH:MM:SS.fffffff`` in UTC. Patel et al., "Splitwise: Efficient
  Generative LLM Inference Using Phase Splitting", ISCA 2024 (Azure/AzurePublicDataset).
- The Mooncake trace (JSON lines): ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token prompt block; equal ids mean an identical prefix block;
  each below 2^64, the width of the KV cache's block keys).
  Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST 2025.

Both become a list of :class:`Request`, arrival times in seconds from the first request. A
malformed row is a :class:`TraceError` naming its line, or, with ``skip_bad``, is counted and
skipped. A row is malformed also when it is not UTF-8 text, when a CSV field exceeds the csv
module's limit, or when a JSON number is not finite (NaN, Infinity, or too large for a float).
"""
from __future__ import annotations

import csv
import json
import math
import reprlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator, Optional

from ..errors import InvalidArgument

#: Tokens covered by one Mooncake hash id.
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(InvalidArgument):
    """A trace file that cannot be read; ``line`` is 1-based, 0 when not about one line."""

    def __init__(self, path: str, line: int, message: str) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    #: Prefix-block ids (one per MOONCAKE_BLOCK_TOKENS prompt tokens), or None.
    hash_ids: Optional[tuple[int, ...]] = None


@dataclass
class Trace:
    requests: list[Request]
    source: str
    skipped: int = 0
    #: (line, reason) of the first skipped rows, for the report.
    skipped_examples: list[tuple[int, str]] = field(default_factory=list)


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        text = str(value).strip()
        try:
            number = int(text)
        except ValueError:
            if text.isdigit():   # more digits than int() reads (4,300)
                raise ValueError(f"{name} {reprlib.repr(value)} is too large") from None
            number = 0
    else:
        number = value
    if number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {reprlib.repr(value)}")
    return number


def _check_text(text: str) -> None:
    """ValueError for a line that was not UTF-8: the file's reader keeps each undecodable byte
    as a lone surrogate (errors="surrogateescape"), so that one bad line is one bad row."""
    if text.isascii():
        return
    for column, char in enumerate(text, start=1):
        if "\udc80" <= char <= "\udcff":
            raise ValueError(f"not UTF-8 text: byte {ord(char) - 0xDC00:#04x} at column {column}")


def _finite_float(text: str) -> float:
    # json.loads takes 1e400 as inf: a number no trace time or length can be.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {reprlib.repr(text)} is too large")
    return value


def _no_constant(name: str) -> float:
    # json.loads accepts NaN, Infinity and -Infinity, which are not JSON; as a timestamp, NaN
    # passes every comparison and the replay would wait for it forever.
    raise ValueError(f"{name} is not a JSON number")


def _whole(text: str) -> int:
    # int() reads no more than 4,300 digits, and says so in words about itself.
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the number {reprlib.repr(text)} is too large") from None


def _json_row(text: str) -> object:
    try:
        return json.loads(text, parse_float=_finite_float, parse_int=_whole, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


class _Collector:
    """Applies the skip-or-raise rule and keeps the requests in arrival order."""

    def __init__(self, path: str, skip_bad: bool) -> None:
        self.trace = Trace(requests=[], source=path)
        self.path = path
        self.skip_bad = skip_bad

    def bad(self, line: int, reason: str) -> None:
        if not self.skip_bad:
            raise TraceError(self.path, line, reason)
        self.trace.skipped += 1
        if len(self.trace.skipped_examples) < 5:
            self.trace.skipped_examples.append((line, reason))

    def finish(self, arrivals: list[float]) -> Trace:
        if not arrivals:
            raise TraceError(self.path, 0, "no usable request in the trace")
        start = min(arrivals)
        requests = [
            Request(arrival - start, r.input_tokens, r.output_tokens, r.hash_ids)
            for arrival, r in zip(arrivals, self.trace.requests)
        ]
        requests.sort(key=lambda r: r.arrival_s)
        self.trace.requests = requests
        return self.trace


def parse_azure_csv(lines: Iterable[str], path: str = "<azure csv>", skip_bad: bool = False) -> Trace:
    collector = _Collector(path, skip_bad)
    arrivals: list[float] = []
    reader = csv.reader(lines)
    try:
        header = next(reader, None)
        for cell in header or ():
            _check_text(cell)
    except (csv.Error, ValueError) as exc:
        raise TraceError(path, 1, f"expected the header TIMESTAMP,ContextTokens,GeneratedTokens: {exc}") from None
    if header is None or [h.strip() for h in header][:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise TraceError(path, 1, "expected the header TIMESTAMP,ContextTokens,GeneratedTokens")
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:        # a field over the csv module's limit: that row only
            collector.bad(reader.line_num, str(exc))
            continue
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        try:
            for cell in row:
                _check_text(cell)
        except ValueError as exc:
            collector.bad(line, str(exc))
            continue
        if len(row) != 3:
            collector.bad(line, f"expected 3 columns, found {len(row)}")
            continue
        try:
            when = _utc_seconds(row[0])
            request = Request(0.0, _positive(row[1], "ContextTokens"), _positive(row[2], "GeneratedTokens"))
        except ValueError as exc:
            collector.bad(line, str(exc))
            continue
        arrivals.append(when)
        collector.trace.requests.append(request)
    return collector.finish(arrivals)


def _utc_seconds(text: str) -> float:
    # The trace's times are UTC. A naive datetime's timestamp() reads them in the machine's own
    # zone, where a daylight-saving change adds or removes an hour between two requests.
    when = datetime.fromisoformat(_trim_fraction(text.strip()))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def _trim_fraction(stamp: str) -> str:
    # The trace writes 7 fractional digits; datetime parses at most 6.
    if "." in stamp:
        head, fraction = stamp.split(".", 1)
        return f"{head}.{fraction[:6]}"
    return stamp


def parse_mooncake_jsonl(lines: Iterable[str], path: str = "<mooncake jsonl>", skip_bad: bool = False) -> Trace:
    collector = _Collector(path, skip_bad)
    arrivals: list[float] = []
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            _check_text(text)
            row = _json_row(text)
            if not isinstance(row, dict):
                raise ValueError("a line must be a JSON object")
            timestamp = row["timestamp"]
            if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
                raise ValueError(f"timestamp must be a non-negative number, got {timestamp!r}")
            try:
                timestamp = float(timestamp) / 1000.0
            except OverflowError:
                raise ValueError(f"the timestamp {reprlib.repr(timestamp)} is too large") from None
            input_tokens = _positive(row["input_length"], "input_length")
            output_tokens = _positive(row["output_length"], "output_length")
            ids = row.get("hash_ids")
            if ids is not None:
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                        and 0 <= i < 1 << 64 for i in ids):
                    raise ValueError("hash_ids must be a list of integers in 0 .. 2^64-1")
                needed = -(-input_tokens // MOONCAKE_BLOCK_TOKENS)
                if len(ids) > needed:
                    raise ValueError(f"{len(ids)} hash_ids for {input_tokens} input tokens (at most {needed})")
        except KeyError as exc:
            collector.bad(line, f"missing field {exc.args[0]!r}")
            continue
        except (ValueError, TypeError) as exc:
            collector.bad(line, str(exc))
            continue
        arrivals.append(timestamp)
        collector.trace.requests.append(
            Request(0.0, input_tokens, output_tokens, tuple(ids) if ids is not None else None))
    return collector.finish(arrivals)


# The longest line a trace may have (the Mooncake conversation trace's longest is 2,053 bytes).
# A file with no line end (a disk image, /dev/zero) was read whole into memory as one line.
MAX_LINE = 1 << 20


def _open_lines(path: Path) -> Iterator[str]:
    # newline="" lets the csv module handle the trace's CRLF line ends; surrogateescape keeps a
    # byte that is not UTF-8 for the parser to report with its line (_check_text).
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as handle:
        for number, line in enumerate(iter(lambda: handle.readline(MAX_LINE), ""), start=1):
            if len(line) == MAX_LINE and line[-1] not in "\r\n":
                raise TraceError(str(path), number, f"a line longer than {MAX_LINE:,} characters: not a trace")
            yield line


def load_trace(path: str | Path, skip_bad: bool = False) -> Trace:
    """Reads either format, chosen by the file's suffix (.csv, .jsonl/.json), else by its first
    non-blank character."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise TraceError(str(path), 0, f"cannot read: {exc.strerror}") from exc
    if b"\0" in head:  # no text trace holds a NUL byte
        raise TraceError(str(path), 0, "a binary file (a NUL byte in its first 4 KiB), not a trace")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson") or (suffix != ".csv" and head.lstrip().startswith(b"{")):
        return parse_mooncake_jsonl(_open_lines(path), str(path), skip_bad)
    return parse_azure_csv(_open_lines(path), str(path), skip_bad)
