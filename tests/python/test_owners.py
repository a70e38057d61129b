"""What every owner of a C handle does the same way (HandleOwner, pykvalloc/_owner.py): Pool,
VarPool and KVCache close once, refuse every call after, work as context managers, refuse
copies, outlive close() for their users and are released when they become garbage. Then what
is VarPool's own: a pool given to it, and the pool the library sizes for it."""

from __future__ import annotations

import copy
import gc
import pickle
from collections.abc import Callable
from ctypes import byref

import numpy as np
import pytest
from support import MiB, mapped
from test_backends import fake_driver, run_with_driver  # noqa: F401 - the fixture, for pytest

import pykvalloc
from pykvalloc import _ffi
from pykvalloc.pool import PageMode


def make_pool() -> pykvalloc.Pool:
    return pykvalloc.Pool(4 * MiB, pages="small")


def make_var_pool() -> pykvalloc.VarPool:
    return pykvalloc.VarPool(1 * MiB, pages="small")


def make_cache() -> pykvalloc.KVCache:
    return pykvalloc.KVCache(num_blocks=16, block_tokens=4, layers=1, kv_heads=1, head_dim=8,
                             pages="small")


def memory_of(owner: object) -> int:
    """An address of the owner's memory, mapped exactly as long as its C object lives."""
    if isinstance(owner, pykvalloc.KVCache):
        return owner.info.base
    assert isinstance(owner, (pykvalloc.Pool, pykvalloc.VarPool))
    return owner.base


def view_of(owner: object) -> np.ndarray:
    """A numpy view of the owner's memory: a user of it."""
    if isinstance(owner, pykvalloc.KVCache):
        return owner.allocate(4).block_table
    assert isinstance(owner, (pykvalloc.Pool, pykvalloc.VarPool))
    return owner.alloc(4096).view()


def a_call(owner: object) -> None:
    if isinstance(owner, pykvalloc.KVCache):
        owner.allocate(4)
    else:
        assert isinstance(owner, (pykvalloc.Pool, pykvalloc.VarPool))
        owner.alloc(64)


OWNERS: dict[str, Callable[[], pykvalloc.Pool | pykvalloc.VarPool | pykvalloc.KVCache]] = {
    "Pool": make_pool, "VarPool": make_var_pool, "KVCache": make_cache}
each_owner = pytest.mark.parametrize("kind", list(OWNERS))


@each_owner
def test_close_is_idempotent_and_says_so(kind: str) -> None:
    owner = OWNERS[kind]()
    assert not owner.closed and repr(owner).startswith(f"<pykvalloc.{kind} ")
    assert repr(owner).endswith(" open>")
    address = memory_of(owner)
    owner.close()
    assert owner.closed and repr(owner).endswith(" closed>")
    assert not owner._finalizer.alive and not mapped(address)
    owner.close()
    assert owner.closed


@each_owner
def test_every_call_after_close_raises(kind: str) -> None:
    owner = OWNERS[kind]()
    owner.close()
    for call in (a_call, lambda o: o.stats(), lambda o: o.check(), lambda o: o.__enter__()):
        with pytest.raises(pykvalloc.PoolClosedError, match="is closed"):
            call(owner)


@each_owner
def test_a_context_manager_closes_on_exit_and_on_error(kind: str) -> None:
    with OWNERS[kind]() as owner:
        a_call(owner)
    assert owner.closed
    with pytest.raises(ZeroDivisionError):
        with OWNERS[kind]() as owner:
            1 / 0
    assert owner.closed


@each_owner
def test_copies_and_pickles_are_refused(kind: str) -> None:
    with OWNERS[kind]() as owner:
        for copier in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=f"{kind} objects cannot be copied or pickled"):
                copier(owner)


@each_owner
@pytest.mark.parametrize("in_a_cycle", [False, True])
def test_a_forgotten_owner_is_released(kind: str, in_a_cycle: bool) -> None:
    owner = OWNERS[kind]()
    a_call(owner)
    finalizer, address = owner._finalizer, memory_of(owner)
    if in_a_cycle:  # only the cycle collector frees it
        cycle: list[object] = [owner]
        cycle.append(cycle)
        del cycle
    del owner
    gc.collect()
    assert not finalizer.alive and not mapped(address)


@each_owner
def test_a_view_outlives_close_and_the_last_view_releases(kind: str) -> None:
    owner = OWNERS[kind]()
    view = view_of(owner)
    address = memory_of(owner)
    # A VarPool's views are users of its pool, which holds the memory.
    holder = owner.pool if isinstance(owner, pykvalloc.VarPool) else owner
    owner.close()
    assert owner.closed and holder._users == 1 and holder._finalizer.alive and mapped(address)
    with pytest.raises(pykvalloc.PoolClosedError):
        a_call(owner)
    view.sum()  # still mapped, still readable
    del view
    gc.collect()
    assert holder._users == 0 and not holder._finalizer.alive and not mapped(address)


# -- VarPool over a given pool ---------------------------------------------------------------

def test_a_var_pool_over_a_given_pool_uses_it_without_owning_it() -> None:
    with pykvalloc.Pool(8 * MiB, pages="small") as pool:
        before = pool.stats().live_allocations
        with pykvalloc.VarPool(1 * MiB, pool=pool) as var:
            assert var.pool is pool and pool._users == 1
            assert pool.base <= var.base and var.base + var.capacity <= pool.base + pool.capacity
            assert pool.stats().live_allocations == before + 1  # the range
            allocation = var.alloc(4096)
            allocation.view()[:] = 3
            var.free(allocation)
            var.check()
        assert var.closed and not pool.closed and pool._users == 0
        assert pool.stats().live_allocations == before  # the range went back
        pool.check()


def test_a_given_pool_closed_first_lives_until_its_var_pool_goes() -> None:
    pool = pykvalloc.Pool(8 * MiB, pages="small")
    var = pykvalloc.VarPool(1 * MiB, pool=pool)
    pool.close()
    with pytest.raises(pykvalloc.PoolClosedError):
        pool.alloc(64)
    values = var.alloc(4096).view(np.int64)  # the VarPool goes on in the pool C still has
    values[:] = 5
    assert mapped(pool.base)
    var.close()
    assert mapped(pool.base) and (values == 5).all()  # the view is a user of the pool too
    del values
    gc.collect()
    assert not mapped(pool.base)


def test_a_view_keeps_a_var_pool_and_its_given_pool_alive() -> None:
    def make_view() -> tuple[np.ndarray, object, object]:
        pool = pykvalloc.Pool(8 * MiB, pages="small")
        var = pykvalloc.VarPool(1 * MiB, pool=pool)
        view = var.alloc(MiB).view(np.uint8)
        view[:] = 42
        return view, var._finalizer, pool._finalizer  # both objects dropped unclosed

    view, var_alive, pool_alive = make_view()
    gc.collect()
    assert var_alive.alive and pool_alive.alive and view.sum() == 42 * MiB
    del view
    gc.collect()
    assert not var_alive.alive and not pool_alive.alive


def test_a_given_pool_is_checked_and_nothing_changes_on_a_refusal() -> None:
    with pykvalloc.Pool(2 * MiB, pages="small") as pool:
        with pytest.raises(pykvalloc.InvalidArgument, match="must be a pykvalloc.Pool"):
            pykvalloc.VarPool(1 * MiB, pool=pykvalloc.VarPool(1 * MiB))
        with pytest.raises(pykvalloc.InvalidArgument, match="pages: options of the pool"):
            pykvalloc.VarPool(1 * MiB, pool=pool, pages="small")
        with pytest.raises(pykvalloc.OutOfMemory, match="cannot hold"):
            pykvalloc.VarPool(4 * MiB, pool=pool)
        assert pool._users == 0 and pool.stats().live_allocations == 0
        pool.check()
    with pytest.raises(pykvalloc.PoolClosedError):
        pykvalloc.VarPool(1 * MiB, pool=pool)
    assert pool._users == 0


# -- the pool the library sizes for a VarPool (kva_var_backing_config) -----------------------

def backing_config(capacity: int, alignment: int = 256, checked: bool = False) -> _ffi.KvaConfig:
    lib = _ffi.load()
    config = _ffi.KvaVarConfig()
    lib.kva_var_config_init(byref(config))
    config.capacity, config.alignment = capacity, alignment
    pool = _ffi.KvaConfig()
    lib.kva_config_init(byref(pool))
    pool.checked = int(checked)
    lib.kva_var_backing_config(byref(config), byref(pool))
    return pool


@pytest.mark.parametrize("capacity, alignment, checked, pool_capacity", [
    (4 * MiB, 256, False, 4 * MiB),
    (3 * MiB + 100, 4096, False, 4 * MiB),
    (MiB + 100, 256, False, MiB),     # the range is the capacity rounded down to the alignment
    (4096, 256, False, MiB),          # never below 1 MiB
    (MiB, 16, True, 2 * MiB),         # a checked pool's red zones around a power of two
])
def test_a_var_pool_s_own_pool_is_the_one_the_library_describes(capacity, alignment, checked,
                                                                pool_capacity) -> None:
    described = backing_config(capacity, alignment, checked)
    assert described.capacity == pool_capacity
    with pykvalloc.VarPool(capacity, alignment=alignment, checked=checked) as var:
        own = var.pool
        assert own.capacity == pool_capacity and own.min_block == described.min_block
        assert own.stats().page_kind.name == PageMode(described.pages).name
        assert own._users == 1 and var._users == 0


def test_the_described_pool_refuses_what_no_pool_holds() -> None:
    with pytest.raises(pykvalloc.InvalidArgument, match="more than a pool can hold"):
        backing_config((1 << 63) + 1)
    assert backing_config(1 << 44, alignment=1 << 30).min_block == 8192  # u32 block indices


def test_a_var_pool_on_gpu_memory(fake_driver) -> None:  # noqa: F811 - the fixture
    # A CUDA pool takes only the "auto" page mode: the pool the library describes keeps it.
    run_with_driver("""
        import pykvalloc
        from pykvalloc.pool import Backend
        with pykvalloc.VarPool(4 << 20, backend="cuda") as var:
            assert var.pool.backend is Backend.CUDA and var.pool.capacity == 4 << 20
            allocation = var.alloc(1 << 20)
            var.free(allocation)
            var.check()
        """, fake_driver)
