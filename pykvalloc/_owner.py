"""``HandleOwner``: the one base of every object that owns a C handle (Pool, VarPool, KVCache).

What it holds for each of them, the way llvmlite's ``ObjectRef`` does for its objects and rmm's
resources for their upstream:

* ``close()`` is idempotent; afterwards every call raises ``PoolClosedError`` (``_open_handle``)
  instead of passing a destroyed handle to C. ``closed`` tells which; the context manager closes
  on exit; the repr says ``open`` or ``closed``; a copy or a pickle is refused (it would share
  the C handle without sharing this bookkeeping).
* Users: what needs the C object after ``close()`` (a numpy view of its memory, a KV cache or a
  VarPool built over a pool). ``close()`` closes the object to calls at once; the C object is
  destroyed then if no user is alive, else when the last one goes.
* A forgotten object is destroyed by ``weakref.finalize`` when it becomes garbage (no
  ``__del__``, so nothing runs against half torn-down modules; ``atexit`` is off: at exit the
  process's memory goes with it, and Pool's exit hook closes idle pools).
* An object built over a ``Pool`` (its upstream) is one of that pool's users from its C
  creation to its C destruction, so the pool outlives it; its destruction calls into that pool
  and holds the pool's lock as every call into it does. An object that made its pool for itself
  owns it and closes it after itself.
* Locks (``_locks.py``): ``_lock`` serializes the object's calls and comes before the lock of
  its upstream pool; ``_users_lock`` is a leaf lock for the count of users, which finalizers
  change from inside garbage collections. Every finalizer takes its locks through
  ``_locks.run_or_defer``, and the fork handlers hold both locks of every live object.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, NoReturn, Protocol, SupportsIndex, TypeVar

from . import _dlpack, _locks
from .errors import PoolClosedError

_Self = TypeVar("_Self", bound="HandleOwner")


class _Counted(Protocol):
    """A handle whose numpy views are users of its owner (an Allocation, a Sequence)."""

    _views: int


def refuse_copy(obj: object) -> NoReturn:
    """What ``__reduce_ex__`` does for an object that must not be copied or pickled."""
    raise TypeError(f"{type(obj).__name__} objects cannot be copied or pickled: a copy would "
                    "share the C resource without sharing its bookkeeping")


class ArrayAnchor:
    """The numpy base object of an array over library memory (``np.asarray(anchor)``): it keeps
    ``owner``, what the memory belongs to, alive while any array over it lives, and a weak
    finalizer on it tells the owner when the last one is gone. ``typestr`` is numpy's
    (``"|u1"``, ``"<u4"``); a read-only anchor makes read-only arrays."""

    __slots__ = ("owner", "_interface", "__weakref__")

    def __init__(self, owner: object, address: int, count: int, typestr: str = "|u1",
                 readonly: bool = False) -> None:
        self.owner = owner
        self._interface = {"version": 3, "shape": (count,), "typestr": typestr,
                           "data": (address, readonly)}

    @property
    def __array_interface__(self) -> dict[str, object]:
        return self._interface

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)


class HandleOwner(ABC):
    """Owns one C handle; see the module docstring. A subclass creates its C object through
    ``_create_over`` (when it is built over a pool), hands the handle to ``_own`` at once, and
    calls ``_open_handle()`` under ``_lock`` in every method that reaches C."""

    __slots__ = ("_handle", "_lock", "_users_lock", "_users", "_closed", "_pool", "_finalizer",
                 "__weakref__")

    # The fork handlers take the locks of objects over a pool (0) before those of pools (1),
    # the order methods take them in.
    _fork_rank: ClassVar[int] = 0
    # Whether the lock of the object's calls is reentrant (a subclass that never takes it twice
    # saves a few ns a call with a plain one).
    _reentrant: ClassVar[bool] = True

    _handle: int
    _lock: _locks.Lock
    _users_lock: _locks.Lock
    _users: int
    _closed: bool
    _pool: HandleOwner | None
    _finalizer: weakref.finalize[..., HandleOwner]

    @staticmethod
    def _create_over(pool: HandleOwner | None, create: Callable[[int | None], int]) -> int:
        """``create(handle of pool)``, the C creation of an object over ``pool`` (None: C gives
        it a pool of its own), holding the pool's lock and counting the new object as a user of
        the pool; a creation that raises leaves no user behind."""
        if pool is None:
            return create(None)
        with pool._lock:
            pool_handle = pool._open_handle()
            pool._add_user()
            try:
                return create(pool_handle)
            except BaseException:
                pool._user_gone()
                raise

    def _own(self, handle: int, destroy: Callable[[int], None],
             pool: HandleOwner | None = None, owns_pool: bool = False) -> None:
        """Takes ownership of ``handle``, which ``destroy`` releases; ``pool`` is the pool the
        object was created over by ``_create_over``, closed after it if ``owns_pool``. Call it
        right after the C creation, before anything else can fail, so that a half-built object
        is released too."""
        self._handle = handle
        self._lock = threading.RLock() if self._reentrant else threading.Lock()
        self._users_lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._pool = pool
        # The finalizer holds the pool, so garbage collection cannot release the pool first.
        self._finalizer = weakref.finalize(self, _destroy_forgotten, _release_locks(pool),
                                           destroy, handle, pool, owns_pool)
        self._finalizer.atexit = False
        _locks.track(self, self._fork_rank)

    # -- calls --------------------------------------------------------------------------------

    def _open_handle(self) -> int:
        """The handle, or PoolClosedError once closed. Callers hold ``_lock``."""
        if self._closed:
            raise PoolClosedError(f"{self!r} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self: _Self) -> _Self:
        self._open_handle()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        refuse_copy(self)

    @abstractmethod
    def _describe(self) -> str:
        """What the repr says between the class name and the state."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<pykvalloc.{type(self).__name__} {self._describe()} {state}>"

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the object to every call; idempotent. Its C object is destroyed now, or when
        the last of its users (numpy views, objects built over it) is gone."""
        _dlpack.sweep()  # DLPack capsules nobody took are users no more
        with self._lock:
            with self._users_lock:
                idle = self._mark_closed()
            if idle:
                self._release(wait=True)

    def _mark_closed(self) -> bool:
        """Both locks held: closes, and says whether the C object is to be destroyed now."""
        if self._closed:
            return False
        self._closed = True
        return self._users == 0

    def _close_soon(self) -> None:
        """close() from a finalizer: with both locks if they are free at once, else later."""
        _locks.run_or_defer([self._lock, self._users_lock], self._close_locked)

    def _close_locked(self) -> None:
        if self._mark_closed():
            self._release(wait=False)

    def _release(self, wait: bool) -> None:
        """Destroys the C object, once, holding the upstream pool's lock: waited for when
        ``wait`` (close(), which holds only locks that come before it), else taken only if free
        at once (a finalizer's work, _locks.py)."""
        # detach() rather than calling the finalizer: after weakref's own exit hook has run,
        # calling a finalizer silently does nothing, and Pool's exit hook may run after it.
        detached = self._finalizer.detach()
        if detached is None:
            return
        _, _, (locks, *work), _ = detached
        if wait:
            _locks.run_locked(locks, _destroy, *work)
        else:
            _locks.run_or_defer(locks, _destroy, *work)

    # -- users --------------------------------------------------------------------------------

    def _add_user(self, viewed: _Counted | None = None) -> None:
        """Counts a user (a numpy view of ``viewed``, or an object built over this one). The
        caller has made sure the C object lives: it holds ``_lock`` and found it open, or it is
        a user already."""
        with self._users_lock:
            if viewed is not None:
                viewed._views += 1
            self._users += 1

    def _user_gone(self, viewed: _Counted | None = None) -> None:
        """A user is gone; the last one out destroys a closed object. Finalizers call it: the
        leaf lock only, never waited on (_locks.py)."""
        _locks.run_or_defer([self._users_lock], self._drop_user_locked, viewed)

    def _drop_user_locked(self, viewed: _Counted | None) -> None:
        if viewed is not None:
            viewed._views -= 1
        self._users -= 1
        if self._closed and self._users == 0:
            self._release(wait=False)

    def _fork_locks(self) -> tuple[list[_locks.Lock], list[_locks.Lock]]:
        return [self._lock], [self._users_lock]


def _release_locks(pool: HandleOwner | None) -> Sequence[_locks.Lock]:
    return [pool._lock] if pool is not None else []


def _destroy(destroy: Callable[[int], None], handle: int, pool: HandleOwner | None,
             owns_pool: bool) -> None:
    """Destroys a C object, then lets go of the pool it was built over (its lock held)."""
    destroy(handle)
    if pool is not None:
        pool._user_gone()
        if owns_pool:
            pool._close_soon()


def _destroy_forgotten(locks: Sequence[_locks.Lock], destroy: Callable[[int], None], handle: int,
                       pool: HandleOwner | None, owns_pool: bool) -> None:
    """The finalizer of an object that became garbage unclosed."""
    _locks.run_or_defer(locks, _destroy, destroy, handle, pool, owns_pool)
