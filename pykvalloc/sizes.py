"""Byte sizes: the slab size classes of the library, and reading and writing sizes for people."""

from __future__ import annotations

import math
import operator
import re
import reprlib

from . import _ffi

__all__ = ["size_classes", "size_class_of", "parse_size", "format_size"]

#: The largest size parse_size reads.
SIZE_MAX = (1 << 64) - 1
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# A number, then a unit letter with an optional "b" or "ib", or a lone "b": "4ib" is no size.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)


def size_classes() -> tuple[int, ...]:
    """Object size of every slab size class, smallest first (index = class index)."""
    lib = _ffi.load()
    return tuple(lib.kva_size_class_size(index) for index in range(_ffi.KVA_NUM_SIZE_CLASSES))


def size_class_of(size: int) -> int | None:
    """Index of the size class a request of ``size`` bytes falls in; None above the slab range."""
    size = operator.index(size)  # TypeError for a float, as for any size argument
    if size <= 0 or size > _ffi.KVA_SLAB_MAX_SIZE:
        return None
    index = _ffi.load().kva_size_class_of(size)
    return None if index < 0 else index


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64K"``, ``"64KiB"``, ``"1.5m"``, ``"2G"`` (binary units), at
    most 2^64-1: no size the library takes is wider."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {reprlib.repr(text)} (examples: 4096, 64K, 256MiB, 1.5G)")
    number, unit = match.groups()
    scale = _UNITS[(unit or "").lower()]
    whole, _, fraction = number.partition(".")
    if fraction and scale == 1:  # "1.9" bytes is a typo, not a size
        raise ValueError(f"not a whole number of bytes: {reprlib.repr(text)}")
    # The digit count is checked first: int() refuses text of more than 4,300 digits with a
    # message about itself, and a float of 400 digits is inf.
    digits = whole.lstrip("0") or "0"
    if len(digits) > len(str(SIZE_MAX)):
        raise ValueError(f"more than 2^64-1 bytes: {reprlib.repr(text)}")
    # Whole numbers stay in integer arithmetic so that large sizes are exact; "2.4G" is rounded
    # down to a whole byte.
    size = int(digits) * scale if not fraction else int(float(number) * scale)
    if size > SIZE_MAX:
        raise ValueError(f"more than 2^64-1 bytes: {reprlib.repr(text)}")
    return size


def format_size(size: float) -> str:
    """``4 KiB``, ``1.5 MiB``, ``64 B``: whole numbers stay whole, others get one decimal."""
    if not math.isfinite(size):
        return f"{size} B"
    for suffix, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.0f} {suffix}" if value == int(value) else f"{value:.1f} {suffix}"
    return f"{size:.0f} B"
