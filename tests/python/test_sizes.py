"""Sizes read and written for people (pykvalloc.sizes), and the size class of a request."""

from __future__ import annotations

import pytest

from pykvalloc import KVCache, Pool
from pykvalloc.errors import InvalidArgument
from pykvalloc.sizes import format_size, parse_size, size_class_of, size_classes


@pytest.mark.parametrize("text, size", [("4096", 4096), ("64K", 64 << 10), ("64KiB", 64 << 10), ("64kb", 64 << 10),
                                        ("1.5m", 3 << 19), ("2G", 2 << 30), ("512b", 512), (" 3 T ", 3 << 40),
                                        ("2.4G", int(2.4 * (1 << 30))), ("1.1k", 1126)])
def test_sizes_people_write(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4ib", "ib", "1.9", "1.9b", "-1", "K", "", "4 KiBs", "0x10"])
def test_what_is_no_size(text):
    # "4ib" read as 4 bytes and "1.9" as 1: a typo or a fraction of a byte passed silently.
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size_writes_what_it_cannot_scale():
    assert format_size(4096) == "4 KiB" and format_size(1536) == "1.5 KiB" and format_size(64) == "64 B"
    assert format_size(float("inf")) == "inf B" and format_size(float("nan")) == "nan B"


def test_size_class_of_takes_whole_numbers_only():
    assert size_classes()[size_class_of(64)] == 64
    assert size_class_of(0) is None and size_class_of(1 << 20) is None
    with pytest.raises(TypeError):
        size_class_of(1.5)  # a TypeError, not a ctypes.ArgumentError


def test_a_bool_is_no_page_mode_for_a_cache():
    # True was read as page mode 1 (hugetlb) and failed with BackendError, where Pool reads
    # hugepages=True as "auto".
    with pytest.raises(InvalidArgument, match="not a page mode"):
        KVCache(layers=1, kv_heads=1, head_dim=64, num_blocks=16, pages=True)


def test_a_view_of_a_fractional_shape_says_what_a_shape_is():
    with Pool(capacity=1 << 20) as pool:
        allocation = pool.alloc(4096)
        with pytest.raises(TypeError, match="shape must be an int or a sequence of ints, not 2.5"):
            allocation.view(shape=2.5)
        assert allocation.view(shape=(2, 8)).shape == (2, 8)
        pool.free(allocation)
