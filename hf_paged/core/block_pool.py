"""Physical KV blocks: a free list and refcounts. Plain Python, no torch.

A block id indexes dimension 0 of every layer's K and V pool tensor. The pool
only counts owners; what a block holds and who holds it is `BlockTables`' job.

One pool may serve several owners at once (concurrent generate calls, engine
requests): every change of the free list happens under a lock. An owner that is
garbage-collected hands its blocks back through `release_later`, which takes no
lock, because a finalizer may run inside a locked section of the same thread;
they return to the free list at the next locked call.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable

from ..errors import KVCacheExhaustedError


class BlockPool:
    """Hands out block ids `0..num_blocks-1` and tracks how many tables hold each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(
                f"BlockPool needs num_blocks >= 0 and block_size > 0; got {num_blocks}, {block_size}."
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Stack with the lowest id on top, so the pool stays compact when it is not full.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Read by hot loops (block tables, scheduler) directly; changed only here.
        self.refcounts: list[int] = [0] * num_blocks
        self._deferred: deque[list[int]] = deque()  # blocks of owners that were collected
        self._lock = threading.Lock()
        self.peak_used = 0

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        with self._lock:
            self._drain()
            return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        return self.refcounts[block]

    def free_blocks(self) -> list[int]:
        """A copy of the free list (for tests and invariant checks)."""
        with self._lock:
            self._drain()
            return list(self._free)

    # -- ownership -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Takes `n` free blocks, each with refcount 1. Raises before taking any if short."""
        with self._lock:
            self._drain()
            if n > len(self._free):
                raise KVCacheExhaustedError(n, len(self._free), self.num_blocks, self.block_size)
            if n == 0:
                return []
            taken = self._free[-n:][::-1]
            del self._free[-n:]
            for b in taken:
                self.refcounts[b] = 1
            self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))
            return taken

    def incref(self, blocks: Iterable[int]) -> None:
        """One more table holds each of `blocks` (a fork)."""
        with self._lock:
            for b in blocks:
                assert self.refcounts[b] > 0, f"incref of free block {b}"
                self.refcounts[b] += 1

    def decref(self, blocks: Iterable[int]) -> int:
        """One table fewer holds each of `blocks`; blocks nobody holds return to the free list.

        Returns how many blocks were freed.
        """
        with self._lock:
            return self._decref(blocks)

    def release_later(self, blocks: Iterable[int]) -> None:
        """`decref(blocks)` at the next locked call; safe from finalizers (takes no lock)."""
        self._deferred.append(list(blocks))

    def _decref(self, blocks: Iterable[int]) -> int:
        freed = 0
        for b in blocks:
            assert self.refcounts[b] > 0, f"decref of free block {b}"
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def _drain(self) -> None:
        while self._deferred:
            self._decref(self._deferred.popleft())

    def grow(self, num_blocks: int) -> None:
        """Adds free blocks so the pool holds `num_blocks` in all (ids stay valid)."""
        with self._lock:
            if num_blocks <= self.num_blocks:
                return
            new_ids = list(range(num_blocks - 1, self.num_blocks - 1, -1))
            self._free[:0] = new_ids  # below the existing free ids: old ids are reused first
            self.refcounts.extend([0] * (num_blocks - self.num_blocks))
            self.num_blocks = num_blocks
