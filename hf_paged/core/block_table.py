"""Logical-to-physical block tables of a batch of sequences. Plain Python, no torch.

Row `r` of the batch owns `tables[r]` (physical block ids, logical order) and holds
`lengths[r]` real tokens: token `t` lives in block `tables[r][t // block_size]` at
offset `t % block_size`. Rows may share blocks (beam search, parallel sampling);
the first write into a shared, partly filled block copies it first (copy-on-write).
Every change to the tables is returned as a plan the cache mirrors on the device.
Leading blocks no query will read again (outside a sliding window) can be released; their
entries become `FREED` and stay in place, so logical indices do not move.

Several `BlockTables` may draw from one `BlockPool` side by side (one per cache or
request); each holds only the blocks it took or forked itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .block_pool import BlockPool
from ..errors import KVCacheExhaustedError
from ..utils import cdiv

FREED = -1  # table entry of a released leading block


def first_visible(length: int, window: int) -> int:
    """The first slot the next query of a row holding `length` tokens sees under a sliding
    `window`: it sits at slot `length` and sees slots above `length - window` (Transformers'
    convention; the kernels mask by the same rule)."""
    return length - window + 1


def blocks_to_add(blocks: int, length: int, count: int, block_size: int) -> int:
    """New blocks a row of `blocks` blocks holding `length` tokens takes for `count` more
    (copies of a shared partial block not counted)."""
    return -(-(length + count) // block_size) - blocks  # cdiv, inlined: a per-row call


def _live(blocks):
    return [b for b in blocks if b != FREED]


@dataclass
class AppendPlan:
    """What one `append` changed.

    entries: (row, logical index, physical block) to write into the device block table.
    copies:  (src, dst) block pairs to copy (all layers, K and V) before the step writes.
    """

    entries: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class BlockTables:
    """Block tables of `num_rows` sequences drawing blocks from one `BlockPool`."""

    def __init__(self, pool: BlockPool, num_rows: int = 0):
        self.pool = pool
        self.block_size = pool.block_size
        self.tables: list[list[int]] = [[] for _ in range(num_rows)]
        self.lengths: list[int] = [0] * num_rows
        self.freed: list[int] = [0] * num_rows  # leading FREED entries per row
        # Distinct blocks these tables hold. Every holder of such a block is one of these
        # rows (blocks are never shared across owners), so a block leaves this count
        # exactly when the pool frees it. (Not kept by `assign`, whose blocks have other
        # holders: the engine, which uses it, counts blocks itself.)
        self.num_held = 0

    @property
    def num_rows(self) -> int:
        return len(self.tables)

    def _needs_copy(self, row: int) -> bool:
        """True when the next write to `row` lands in a shared, partly filled block."""
        n = self.lengths[row]
        return n % self.block_size != 0 and self.pool.refcount(self.tables[row][-1]) > 1

    def blocks_needed(self, counts: Sequence[int]) -> int:
        """Free blocks an `append(counts)` would take (new blocks plus copies).

        Of `w` rows writing into a shared partial block with refcount `r`, the first
        `min(w, r - 1)` copy it; the last holder writes in place.
        """
        bs, lengths, tables, refcounts = self.block_size, self.lengths, self.tables, \
            self.pool.refcounts
        needed = 0
        writers: dict[int, int] = {}  # shared partial blocks only (a block of one holder: none)
        for row, c in enumerate(counts):
            if c <= 0:
                continue
            n = lengths[row]
            table = tables[row]
            needed += -(-(n + c) // bs) - len(table)  # blocks_to_add, inlined: a per-row call
            if n % bs and refcounts[table[-1]] > 1:
                last = table[-1]
                writers[last] = writers.get(last, 0) + 1
        for block, w in writers.items():
            needed += min(w, refcounts[block] - 1)
        return needed

    def append(self, counts: Sequence[int], needed: int | None = None) -> AppendPlan:
        """Makes room for `counts[r]` more tokens in each row. All or nothing.

        needed: `blocks_needed(counts)` if the caller already has it.
        """
        if len(counts) != self.num_rows:
            raise ValueError(f"append got {len(counts)} counts for {self.num_rows} rows.")
        if needed is None:
            needed = self.blocks_needed(counts)
        if needed > self.pool.num_free:
            raise KVCacheExhaustedError(
                needed, self.pool.num_free, self.pool.num_blocks, self.block_size
            )
        fresh = self.pool.allocate(needed)
        self.num_held += needed
        plan = AppendPlan()
        bs, lengths, tables, refcounts = self.block_size, self.lengths, self.tables, \
            self.pool.refcounts
        for row, c in enumerate(counts):
            if c <= 0:
                continue
            table, n = tables[row], lengths[row]
            if n % bs and n % bs + c <= bs and refcounts[table[-1]] == 1:
                lengths[row] = n + c  # fits in its own last block (most decodes)
                continue
            if self._needs_copy(row):
                src, dst = table[-1], fresh.pop()
                plan.copies.append((src, dst))
                table[-1] = dst
                plan.entries.append((row, len(table) - 1, dst))
                self.num_held -= self.pool.decref([src])
            for _ in range(blocks_to_add(len(table), self.lengths[row], c, bs)):
                b = fresh.pop()
                plan.entries.append((row, len(table), b))
                table.append(b)
            self.lengths[row] += c
        assert not fresh
        return plan

    def fork_rows(self, src_rows: Sequence[int]) -> None:
        """New row `i` becomes a copy of old row `src_rows[i]`, sharing its blocks.

        Old rows nobody copies release their blocks. The row count may change. Rows that
        stay where they are (beam search's common case) cost nothing.
        """
        old_tables, old_lengths = self.tables, self.lengths
        for r in src_rows:
            if not 0 <= r < len(old_tables):
                raise IndexError(f"fork_rows source row {r} out of range [0, {len(old_tables)}).")
        kept = min(len(src_rows), len(old_tables))
        moved = [i for i, r in enumerate(src_rows[:kept]) if r != i]
        self.tables = [t if i == r else list(old_tables[r])
                       for i, (r, t) in enumerate(zip(src_rows, old_tables))]
        self.tables += [list(old_tables[r]) for r in src_rows[len(old_tables):]]
        self.lengths = [old_lengths[r] for r in src_rows]
        self.freed = [self.freed[r] for r in src_rows]
        # Take the new references before dropping the old ones.
        for i in moved + list(range(kept, len(src_rows))):
            self.pool.incref(_live(self.tables[i]))
        dropped = [b for i in moved + list(range(kept, len(old_tables)))
                   for b in _live(old_tables[i])]
        self.num_held -= self.pool.decref(dropped)

    def truncate(self, new_lengths: Sequence[int]) -> None:
        """Keeps the first `new_lengths[r]` tokens of each row, releasing blocks past them."""
        if len(new_lengths) != self.num_rows:
            raise ValueError(f"truncate got {len(new_lengths)} lengths for {self.num_rows} rows.")
        for row, n in enumerate(new_lengths):
            if not 0 <= n <= self.lengths[row]:
                raise ValueError(
                    f"truncate: row {row} holds {self.lengths[row]} tokens, cannot keep {n}."
                )
            if n and n % self.block_size and cdiv(n, self.block_size) <= self.freed[row]:
                raise ValueError(
                    f"truncate: row {row} would end inside a released block (its first "
                    f"{self.freed[row] * self.block_size} tokens were released)."
                )
        bs = self.block_size
        for row, n in enumerate(new_lengths):
            keep = cdiv(n, bs)
            table = self.tables[row]
            self.num_held -= self.pool.decref(_live(table[keep:]))
            del table[keep:]
            self.lengths[row] = n
            self.freed[row] = min(self.freed[row], keep)

    def release_outside_window(self, window: int,
                               lengths: Sequence[int] | None = None) -> list[int]:
        """Releases the blocks no next query can see under a sliding `window`, for rows
        holding `lengths[r]` tokens (default: their table lengths); see `first_visible`."""
        lengths = self.lengths if lengths is None else lengths
        return self.release_before([first_visible(n, window) for n in lengths])

    def release_before(self, positions: Sequence[int]) -> list[int]:
        """Releases, in each row, the blocks lying wholly before token `positions[r]`.

        For tokens no query will read again (outside a sliding window). Returns the blocks
        whose reference was dropped.
        """
        released: list[int] = []
        for row, p in enumerate(positions):
            table = self.tables[row]
            upto = min(p // self.block_size, len(table))
            if upto > self.freed[row]:
                dead = _live(table[self.freed[row]:upto])
                self.num_held -= self.pool.decref(dead)
                table[self.freed[row]:upto] = [FREED] * (upto - self.freed[row])
                released += dead
                self.freed[row] = upto
        return released

    # -- single rows (the engine: a row per running sequence, rows reused) ------------------
    def free_row(self, row: int) -> list[int]:
        """Empties `row`, dropping its references; returns the blocks it held."""
        blocks = _live(self.tables[row])
        self.num_held -= self.pool.decref(blocks)
        self.tables[row], self.lengths[row], self.freed[row] = [], 0, 0
        return blocks

    def truncate_row(self, row: int, length: int) -> list[int]:
        """Keeps the first `length` tokens of `row` (at most it holds, and past any blocks
        it released), dropping its blocks past them; returns those blocks."""
        table, keep = self.tables[row], cdiv(length, self.block_size)
        if not self.freed[row] * self.block_size <= length <= self.lengths[row]:
            raise ValueError(f"truncate_row: row {row} holds {self.lengths[row]} tokens "
                             f"(the first {self.freed[row]} block(s) released); cannot keep "
                             f"{length}.")
        dropped = _live(table[keep:])
        self.num_held -= self.pool.decref(dropped)
        del table[keep:]
        self.lengths[row] = length
        return dropped

    def assign(self, row: int, blocks: Sequence[int], length: int, incref: bool = True) -> None:
        """Fills the empty `row` with `blocks` (already holding `length` tokens): a cached
        prefix or a sibling's blocks (a reference is taken on each), or blocks just
        allocated for it (`incref=False`: the allocation's reference is the row's). FREED
        entries are kept as they are."""
        assert not self.tables[row], f"assign into row {row}, which holds blocks"
        if not 0 <= length <= len(blocks) * self.block_size:
            raise ValueError(f"assign: {len(blocks)} block(s) cannot hold {length} tokens.")
        live = _live(blocks)
        if incref:
            self.pool.incref(live)
        self.tables[row] = list(blocks)
        self.lengths[row] = length
        self.freed[row] = len(blocks) - len(live) if FREED in blocks else 0

    def release(self, later: bool = False) -> None:
        """Frees every row's blocks and forgets the rows.

        later: hand the blocks back through `BlockPool.release_later` (from a finalizer).
        """
        blocks = [b for t in self.tables for b in _live(t)]
        if later:
            self.pool.release_later(blocks)
        else:
            self.pool.decref(blocks)
        self.num_held = 0
        self.tables, self.lengths, self.freed = [], [], []

    def resize(self, num_rows: int) -> None:
        """Starts over with `num_rows` empty rows."""
        self.release()
        self.tables = [[] for _ in range(num_rows)]
        self.lengths = [0] * num_rows
        self.freed = [0] * num_rows
