"""The package's Python locks (pykvalloc/_locks.py): a finalizer never waits on a lock, so a
garbage collection cannot close a cycle with a method; and os.fork() while another thread holds
one leaves the child a usable pool."""

from __future__ import annotations

import gc
import os
import signal
import textwrap
import threading
import time

import pytest
from support import MiB, run_python

import pykvalloc
from pykvalloc import _locks


def _forget_in_a_cycle(cache: pykvalloc.KVCache, tokens: int) -> None:
    """A sequence only the cycle collector can free (its finalizer frees it in C)."""
    cycle: list = [cache.allocate(tokens)]
    cycle.append(cycle)


def test_a_collection_holding_the_pool_lock_does_not_wait_on_the_cache() -> None:
    # Thread A is in a KVCache method: it holds the cache's lock and waits for the pool's.
    # This thread holds the pool's lock (as a Pool method does) when a collection frees a
    # forgotten sequence. A finalizer that waited for the cache's lock would hang both threads.
    pool = pykvalloc.Pool(64 * MiB, pages="small")
    cache = pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=1, kv_heads=1, head_dim=64,
                              pool=pool)
    gc.collect()
    gc.disable()
    try:
        _forget_in_a_cycle(cache, 40)
        assert cache.stats().used_blocks == 3
        holds_cache = threading.Event()

        def cache_method() -> None:
            with cache._lock:
                holds_cache.set()
                with pool._lock:
                    pass

        collector_done = threading.Event()

        def collector() -> None:
            with pool._lock:
                a = threading.Thread(target=cache_method, daemon=True)
                a.start()
                assert holds_cache.wait(60)
                gc.collect()  # runs the sequence's finalizer with the pool's lock held
            a.join(60)
            collector_done.set()

        # The bounds guard against a hang only: without a deadlock all of this takes a moment.
        t = threading.Thread(target=collector, daemon=True)
        t.start()
        t.join(120)
        assert collector_done.is_set(), "hung: the finalizer waited on the cache's lock (a deadlock)"
    finally:
        gc.enable()
    # The free went to the reaper, which took the locks in order once they were free.
    assert _locks.drain_deferred()
    assert cache.stats().used_blocks == 0
    cache.check()
    cache.close()
    pool.close()


def test_a_view_finalizer_takes_no_pool_lock() -> None:
    # The last view of a closed pool's allocation becomes garbage while another thread holds
    # the pool's lock: the finalizer only counts under the pool's leaf lock and destroys the
    # closed pool without the main lock, so it finishes at once (two pools' view finalizers,
    # each run in a thread holding the other pool's lock, could otherwise wait on each other).
    pool = pykvalloc.Pool(16 * MiB, pages="small")
    view = pool.alloc(4096).view()
    view[:] = 1
    pool.close()
    assert pool._users == 1
    release = threading.Event()
    holding = threading.Event()

    def hold_lock() -> None:
        with pool._lock:
            holding.set()
            release.wait(120)

    holder = threading.Thread(target=hold_lock, daemon=True)
    holder.start()
    assert holding.wait(60)
    finished = threading.Event()

    def drop_view() -> None:
        nonlocal view
        del view
        gc.collect()
        finished.set()

    dropper = threading.Thread(target=drop_view, daemon=True)
    dropper.start()
    done_while_held = finished.wait(60)  # a bound against a hang only
    release.set()
    holder.join(60)
    dropper.join(60)
    assert done_while_held, "hung: the view's finalizer waited on the pool's lock"
    assert pool._users == 0 and not pool._finalizer.alive


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_fork_while_another_thread_holds_a_pool_lock() -> None:
    # The child has only the forking thread: a Python lock another thread held at the fork
    # would stay held in the child for ever, and its first call on the pool would hang. The
    # fork waits for the lock, so the child starts with it free.
    pool = pykvalloc.Pool(16 * MiB, pages="small")
    cache = pykvalloc.KVCache(num_blocks=16, block_tokens=4, layers=1, kv_heads=1, head_dim=8,
                              pool=pool)
    holding = threading.Event()

    def hold_locks_a_while() -> None:
        with cache._lock, pool._lock:
            holding.set()
            time.sleep(0.3)

    t = threading.Thread(target=hold_locks_a_while)
    t.start()
    assert holding.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: any failure or hang (its alarm, a bound against a hang only) is its status
        signal.alarm(60)
        try:
            pool.free(pool.alloc(4096))
            seq = cache.allocate(8)
            seq.free()
            cache.check()
            os._exit(0)
        except BaseException:
            os._exit(3)
    t.join()
    _, status = os.waitpid(pid, 0)
    hung = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        "hung: the child's pool calls did not return within 60 s" if hung else f"child status {status:#x}"
    pool.free(pool.alloc(4096))  # the parent's locks came back free too
    cache.close()
    pool.close()


def _run_and_expect(code: str, expected: str) -> None:
    done = run_python(textwrap.dedent(code), timeout=120)
    hung = "Timeout (" in done.stderr  # faulthandler's report of a child that hung, with its stacks
    assert done.returncode == 0 and expected in done.stdout, ("hung: " if hung else "") + done.stdout + done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.parametrize("which", ["varpool", "kvcache"])
def test_an_object_dropped_while_a_fork_waits_is_not_finalized_by_the_fork(which) -> None:
    # A fork handler that held every tracked object while it waited for their locks would let
    # the forking thread finalize an object another thread dropped meanwhile, holding every
    # leaf lock, and that finalizer would wait on one of them: the parent would hang in os.fork().
    _run_and_expect(f"""
        import faulthandler, os, threading, time
        import pykvalloc
        faulthandler.dump_traceback_later(60, exit=True)
        busy = pykvalloc.Pool(1 << 22, pages="small")
        if {which!r} == "varpool":
            obj = pykvalloc.VarPool(1 << 20, pages="small")
        else:
            shared = pykvalloc.Pool(1 << 26, pages="small")
            obj = pykvalloc.KVCache(num_blocks=16, layers=1, kv_heads=1, head_dim=64, pool=shared)
        holding = threading.Event()
        def in_a_method_of_busy():
            global obj
            with busy._lock:      # the fork waits for this lock ...
                holding.set()
                time.sleep(0.5)
                del obj           # ... while the object's last reference goes
        threading.Thread(target=in_a_method_of_busy).start()
        holding.wait()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("forked")
    """, "forked")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_two_threads_forking_at_once_leave_every_lock_usable() -> None:
    # Forks are one at a time: handlers sharing one list of held locks would let the first
    # fork to finish release the second's, fail with RuntimeError half way, and leave locks
    # held for ever.
    _run_and_expect("""
        import faulthandler, os, threading, time
        import pykvalloc
        faulthandler.dump_traceback_later(60, exit=True)
        p1 = pykvalloc.Pool(1 << 22, pages="small")
        p2 = pykvalloc.Pool(1 << 22, pages="small")
        def fork():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        def hold_p2():
            with p2._lock:
                time.sleep(1.0)
        holder = threading.Thread(target=hold_p2); holder.start(); time.sleep(0.1)
        first = threading.Thread(target=fork); first.start(); time.sleep(0.2)  # waits on p2
        cache = pykvalloc.KVCache(num_blocks=16, layers=1, kv_heads=1, head_dim=64, pages="small")
        second = threading.Thread(target=fork); second.start()
        for t in (holder, first, second):
            t.join()
        for lock in (p1._lock, p2._lock, cache._lock, p1._users_lock, cache._users_lock):
            assert lock.acquire(timeout=30), "hung: a lock stayed held"
            lock.release()
        print("all usable")
    """, "all usable")
