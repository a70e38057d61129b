"""The package's Python locks: their order, finalizers that must not wait on them, and fork.

Order. A ``KVCache``'s or ``VarPool``'s lock comes before the lock of the ``Pool`` it calls
into; each object's count of users has a leaf lock of its own (``HandleOwner``, _owner.py),
under which no other lock is waited for. Every method takes locks in that order, so methods
cannot deadlock one another.

Finalizers. ``weakref.finalize`` callbacks and ``__del__`` methods run inside a garbage collection, which may start in
any thread at any allocation, that thread holding any of these locks. A finalizer that waited
on a lock there could close a cycle no method can (a thread in a ``Pool`` method collecting a
forgotten sequence waits on the cache's lock, held by a thread in a ``KVCache`` method waiting
on that pool's lock), or wait on a leaf lock its own thread holds (the forking thread holds
every lock between the fork handlers). So every finalizer takes its locks, leaf locks
included, through ``run_or_defer``: only if they are free at once; otherwise its work goes to a
reaper thread, which waits for them in order, holding nothing else.

Fork. A child of ``os.fork`` has only the forking thread; a lock another thread held at that
moment would stay held in the child forever. Before the fork the forking thread takes every
lock of every live object, in order, and releases them in parent and child after it, the way
the C library's ``pthread_atfork`` handlers treat its own locks.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol


class Lock(Protocol):
    """threading.Lock and threading.RLock, as this module and the objects use them."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None, /) -> None: ...


class Tracked(Protocol):
    """An object whose locks the fork handlers hold: its outer locks, in order, and its leaf
    locks."""

    def _fork_locks(self) -> tuple[list[Lock], list[Lock]]: ...


# ---- finalizers --------------------------------------------------------------------------

_pending: collections.deque[tuple[Sequence[Lock], Callable[..., None], tuple[Any, ...]]] = \
    collections.deque()
_wake = threading.Event()
_reaper_pid = 0
# Between the fork handlers: a finalizer's work then waits in _pending (starting a thread there,
# in the child before threading has reinitialized itself, breaks threading's bookkeeping).
_in_fork = False


class LockPair:
    """Two locks taken in order as one context manager (``with pair:`` as ``with first,
    second:``), for a call made thousands of times a second that would otherwise also enter a
    second, often empty, context manager."""

    __slots__ = ("first", "second")

    def __init__(self, first: Lock, second: Lock) -> None:
        self.first = first
        self.second = second

    def __enter__(self) -> None:
        self.first.acquire()
        try:
            self.second.acquire()
        except BaseException:
            self.first.release()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None, /) -> None:
        self.second.release()
        self.first.release()


def run_locked(locks: Sequence[Lock], work: Callable[..., None], *args: Any) -> None:
    """Runs ``work(*args)`` holding ``locks``, waited for in the package's order."""
    for lock in locks:
        lock.acquire()
    try:
        work(*args)
    finally:
        for lock in reversed(locks):
            lock.release()


def _reap() -> None:
    while True:
        _wake.wait()
        _wake.clear()
        while _pending:
            locks, work, args = _pending.popleft()
            try:
                run_locked(locks, work, *args)
            except Exception:  # a finalizer's failure is not the reaper's to report
                pass


def run_or_defer(locks: Sequence[Lock], work: Callable[..., None], *args: Any) -> None:
    """Runs ``work(*args)`` holding ``locks`` (in the package's order) if every one can be had
    at once, else hands it to the reaper thread. For finalizers only."""
    taken: list[Lock] = []
    for lock in locks:
        if not lock.acquire(blocking=False):
            break
        taken.append(lock)
    if len(taken) == len(locks):
        try:
            work(*args)
        finally:
            for lock in reversed(taken):
                lock.release()
        return
    for lock in reversed(taken):
        lock.release()
    _pending.append((tuple(locks), work, args))
    if not _in_fork:  # no thread is started between the fork handlers: the after ones start it
        _start_reaper()


def _start_reaper() -> None:
    global _reaper_pid
    if _reaper_pid != os.getpid():  # none yet, or this is a forked child, which has none
        _reaper_pid = os.getpid()
        threading.Thread(target=_reap, name="pykvalloc-reaper", daemon=True).start()
    _wake.set()


def drain_deferred(timeout: float = 5.0) -> bool:
    """Waits until the reaper has run everything deferred so far; whether it did (tests)."""
    if _reaper_pid != os.getpid():
        return not _pending  # nothing was deferred in this process
    done = threading.Event()
    _pending.append(((), done.set, ()))
    _wake.set()
    return done.wait(timeout)


# ---- fork ----------------------------------------------------------------------------------

# Objects whose locks a fork must hold, by rank: 0 caches and VarPools, 1 pools.
_ranked: tuple[weakref.WeakSet[Tracked], ...] = (weakref.WeakSet(), weakref.WeakSet())
# One fork at a time: two threads forking at once would otherwise each wait on locks the other
# took, and release each other's.
_forking = threading.Lock()
_held: list[Lock] = []


def track(obj: Tracked, rank: int) -> None:
    """Registers ``obj`` with the fork handlers: rank 0 for a KVCache or VarPool, 1 for a
    Pool."""
    _ranked[rank].add(obj)


def _locks_to_hold() -> list[Lock]:
    """Every tracked object's outer locks, rank by rank, then every leaf lock. Only the locks
    come back: holding the objects themselves while waiting on a lock would make this thread
    the one to run the finalizer of an object another thread drops meanwhile."""
    objects = [list(group) for group in _ranked]
    outer = [lock for group in objects for obj in group for lock in obj._fork_locks()[0]]
    leaves = [lock for group in objects for obj in group for lock in obj._fork_locks()[1]]
    return outer + leaves


def _before_fork() -> None:
    global _in_fork
    _forking.acquire()
    _in_fork = True
    for lock in _locks_to_hold():
        lock.acquire()
        _held.append(lock)


def _after_fork() -> None:
    global _in_fork
    while _held:
        _held.pop().release()
    _in_fork = False
    _forking.release()
    if _pending:
        _start_reaper()


def _after_fork_in_child() -> None:
    global _reaper_pid, _wake
    _reaper_pid = 0  # the reaper thread did not come along; the next deferral starts one
    _wake = threading.Event()
    _after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                        after_in_child=_after_fork_in_child)
