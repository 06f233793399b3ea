"""Prefix caching: full blocks addressed by the content of every token up to their end.

A block's key is a SHA-256 chain over the parent block's key, a namespace and the block's
tokens. The namespace (`namespace(adapter, cache_salt)`) holds the adapter whose K/V the
block has and the request's cache salt (its tenant), so two tenants, or two adapters, never
share a block. Every part is framed by its length, so no two different inputs give one key
(the adapter "m" with tokens "123, ..." is not the adapter "m1" with "23, ...").
A block is registered once it is full; the cache
then holds one reference on it, so it outlives the sequence that computed it. A cached block
no sequence holds is *evictable*: it goes back to the free list, least recently used first,
only when the pool needs the space. Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Iterable, Sequence

from .block_pool import BlockPool


def _framed(part: str | None) -> bytes:
    """None, or a string with its length in front."""
    if part is None:
        return b"\0"
    data = part.encode("utf-8", "surrogatepass")
    return b"\1" + struct.pack("<Q", len(data)) + data


def namespace(adapter: str | None = None, cache_salt: str | None = None,
              rope: str | None = None) -> bytes:
    """The prefix-cache namespace of a request: its adapter and cache salt, framed, then
    the rotary frequencies its prompt's length picks, if they depend on it (hf/rope.py)."""
    return _framed(adapter) + _framed(cache_salt) + rope_namespace(rope)


def rope_namespace(rope: str | None) -> bytes:
    """The namespace part of a prompt's rotary length class (None: its K/V does not depend
    on it)."""
    return b"" if rope is None else _framed(rope)


def block_key(parent: bytes | None, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """parent: the previous block's key (None for the first block); salt: the namespace."""
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(struct.pack("<Q", len(salt)))
    digest.update(salt)
    digest.update(struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens))
    return digest.digest()


class PrefixCache:
    """Content keys -> blocks of one pool, with LRU eviction of blocks nobody holds."""

    def __init__(self, pool: BlockPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._salt_of: dict[int, bytes] = {}  # a cached block's namespace
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached run of `keys` from the first."""
        blocks = []
        if self.enabled:
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """`blocks` are about to be held by a sequence: no longer evictable."""
        for b in blocks:
            self._evictable.pop(b, None)

    def register(self, block: int, key: bytes, salt: bytes = b"") -> None:
        """A sequence of namespace `salt` filled `block`, whose content has `key`. Keeps
        the first block seen for a key (another with the same content stays private to its
        sequence)."""
        if self.enabled and key not in self._block_of and block not in self._key_of:
            self.pool.incref([block])
            self._block_of[key] = block
            self._key_of[block] = key
            self._salt_of[block] = salt

    def forget(self, prefix: bytes) -> int:
        """Drops the blocks of every namespace starting with `prefix` (an unloaded adapter's):
        never found again; a block nobody holds is freed. Returns how many."""
        dropped = [b for b, salt in self._salt_of.items() if salt.startswith(prefix)]
        for block in dropped:
            self._evictable.pop(block, None)
            del self._block_of[self._key_of.pop(block)], self._salt_of[block]
        self.pool.decref(dropped)  # the cache's own reference
        return len(dropped)

    def released(self, blocks: Iterable[int]) -> None:
        """Sequences dropped their references on `blocks`: cached ones held by nobody else
        become evictable, as the most recently used."""
        for b in blocks:
            if b in self._key_of and self.pool.refcount(b) == 1:
                self._evictable.pop(b, None)
                self._evictable[b] = None

    def evict(self, count: int) -> int:
        """Returns up to `count` least recently used evictable blocks to the free list."""
        evicted = 0
        while evicted < count and self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)], self._salt_of[block]
            self.pool.decref([block])
            evicted += 1
        return evicted

    def clear(self) -> None:
        """Drops every evictable block (blocks in use stay cached until released)."""
        self.evict(len(self._evictable))
