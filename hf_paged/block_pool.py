"""Physical KV blocks: a free list and refcounts. Plain Python, no torch.

A block id indexes dimension 0 of every layer's K and V pool tensor. The pool
only counts owners; what a block holds and who holds it is `BlockTables`' job.
"""

from __future__ import annotations

from typing import Iterable

from .errors import KVCacheExhaustedError


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
        self._refcount: list[int] = [0] * num_blocks
        self.peak_used = 0

    # -- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def free_blocks(self) -> list[int]:
        """A copy of the free list (for tests and invariant checks)."""
        return list(self._free)

    # -- ownership -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Takes `n` free blocks, each with refcount 1. Raises before taking any if short."""
        if n > len(self._free):
            raise KVCacheExhaustedError(n, len(self._free), self.num_blocks, self.block_size)
        if n == 0:
            return []
        taken = self._free[-n:][::-1]
        del self._free[-n:]
        for b in taken:
            self._refcount[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return taken

    def incref(self, blocks: Iterable[int]) -> None:
        """One more table holds each of `blocks` (a fork)."""
        for b in blocks:
            assert self._refcount[b] > 0, f"incref of free block {b}"
            self._refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """One table fewer holds each of `blocks`; blocks nobody holds return to the free list."""
        for b in blocks:
            assert self._refcount[b] > 0, f"decref of free block {b}"
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def grow(self, num_blocks: int) -> None:
        """Adds free blocks so the pool holds `num_blocks` in all (ids stay valid)."""
        if num_blocks <= self.num_blocks:
            return
        new_ids = list(range(num_blocks - 1, self.num_blocks - 1, -1))
        self._free[:0] = new_ids  # below the existing free ids: old ids are reused first
        self._refcount.extend([0] * (num_blocks - self.num_blocks))
        self.num_blocks = num_blocks
